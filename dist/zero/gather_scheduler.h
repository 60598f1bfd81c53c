// ZeRO-3's gather scheduler: a unit's full compute weights exist only around its uses.
//
// For each use (a block, or the modules of the plan's root_before / root_after), in
// forward order u_0 ... u_{k-1}:
//   forward pre-hook   gather the unit (waiting for its prefetch, if one is in
//                      flight); prefetch the units of u_{i+1} ... u_{i+prefetch}
//   forward hook       release it -- except for the last use (the backward starts
//                      there at once), a unit kept after forward (keep_after_forward:
//                      FSDP2's reshard_after_forward=False) and inside a checkpoint's
//                      recompute
//   output gradient    (only if the use's backward reads weights) gather it again;
//                      prefetch the units of u_{i-1} ... u_{i-prefetch}
//   input gradient     the use's backward is done: release it; if it is the unit's
//                      first use, the gradient reducer reduce-scatters the unit now
//   end of backward    release every unit still whole
// Each unit is thus gathered twice per step and its gradient reduce-scattered once:
// 3 Ψ elements of traffic per step, the ZeRO paper's figure (2 Ψ for kept units).
// Prefetch issues up to `prefetch` units ahead, and no more than `prefetch_bytes` of
// them (when set).
//   Nothing is asked of the user per step: the first use's pre-hook of a new forward
// (the first one, or one that starts over from an earlier use) releases what an
// earlier forward without backward left whole. A root unit whose plan names no module
// is gathered in the model's own forward pre-hook and kept until the backward ends.
//   Under summon_full_params() every unit is gathered once and none is released until
// the scope ends: the hooks find them current.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/zero/gradient_reducer.h"

namespace zg::dist {

class GatherScheduler {
 public:
  // The uses of each unit in forward order, from the plan (checks its module paths);
  // `root` is the root unit when it has weights to gather (else null).
  GatherScheduler(const nn::UnitPlan& plan, nn::Module& model, Unit* root, const std::vector<Unit*>& units,
                  GradientReducer& reducer, int prefetch, int64_t prefetch_bytes);
  // Hooks the uses, and checks under the plan that every module holding a unit's
  // parameters finds them whole and current when it reads them.
  void hook(std::weak_ptr<ParameterOwner> alive);

  void release(Unit& unit);  // unless summoned
  void release_all();        // the end of a backward
  // summon_full_params(): every unit gathered and kept while any scope lives.
  void summon();
  bool end_summon();  // the last scope ended: releases, and says whether summoned weights were written
  bool summoned() const { return summoned_ > 0; }
  void after_step();  // while summoned: the new weights, gathered at once

 private:
  struct Use {
    Unit* unit = nullptr;
    std::vector<nn::Module*> modules;
    bool backward_reads = true;  // some module's backward reads the unit's weights
    // The unit's first use: when its backward is done, so is the unit's, and the unit's
    // gradient is reduced then (the same moment on every rank).
    bool reduces = false;
    bool whole_forward = false;   // the model itself: a root gathered for the whole forward and backward
    size_t ran = 0;               // modules of this use whose forward has run in this pass
    size_t backwards_waiting = 0;  // if it reduces: its calls in this forward whose backward is not done
  };
  void hook_use(size_t index, const std::weak_ptr<ParameterOwner>& alive);
  void hook_holders(const std::weak_ptr<ParameterOwner>& alive);
  void begin_forward();
  void prefetch_from(size_t use, int direction);

  nn::Module& model_;
  std::vector<Unit*> units_;
  GradientReducer& reducer_;
  int prefetch_;
  int64_t prefetch_bytes_;  // 0: no bound
  std::vector<Use> uses_;
  std::vector<std::string> no_weight_backward_;  // plan.backward_reads_no_weights
  bool forward_open_ = false;  // a forward began and its backward has not ended
  size_t last_use_ = 0;        // the latest use whose forward began, in the open forward
  int summoned_ = 0;           // FullParameters scopes alive; while > 0 no unit is released
};

}  // namespace zg::dist
