// ZeRO-3's gather scheduler: a unit's full compute weights exist only around its uses.
//
// A use is a block, or the modules of the plan's root_before / root_after; in forward
// order u_0 ... u_{k-1}. The module hooks call one named event each:
//
//   on_pre_forward(i)    (forward pre-hook) gather the unit, waiting for its prefetch;
//                        prefetch the units of u_{i+1} ... u_{i+prefetch}
//   on_post_forward(i)   (forward hook) release it -- except for the last use (the
//                        backward starts there at once), a unit kept after forward
//                        (keep_after_forward: FSDP2's reshard_after_forward=False) and
//                        inside a checkpoint's recompute
//   on_pre_backward(i)   (the output's gradient arrives; only if the use's backward reads
//                        weights) gather it again; prefetch u_{i-1} ... u_{i-prefetch}
//   on_post_backward(i)  (the input's gradient arrives: the use's backward is done)
//                        release it once no other call of the unit is in its backward;
//                        once every call of the unit's first use is done, the gradient
//                        reducer reduce-scatters the unit
//   on_backward_end()    release every unit still whole
// Each unit is thus gathered twice per step and its gradient reduce-scattered once:
// 3 Ψ elements of traffic per step, the ZeRO paper's figure (2 Ψ for kept units).
// Prefetch issues up to `prefetch` units ahead, and no more than `prefetch_bytes` of
// them (when set).
//   A use may be called more than once in one step (a siamese loss, net(x) and net(y)):
// the calls are counted, so the unit is released after its last call's backward and
// reduced after its last gradient. A forward that starts over at an earlier use opens a
// new step when the last backward has ended, or when grad is off (evaluation after a
// forward without backward); with grad on, it is another forward of the same step.
//   Nothing is asked of the user per step. A root unit whose plan names no module is
// gathered in the model's own forward pre-hook and kept until the backward ends. Under
// summon_full_params() every unit is gathered once and none is released until the scope
// ends: the hooks find them current.
#pragma once

#include <map>
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

  // One forward call of a use, as its backward hooks know it.
  struct Call {
    bool in_backward = false;  // between its on_pre_backward and on_post_backward
  };
  // The events, as the hooks call them (`use`: an index into the uses in forward order).
  // on_pre_forward returns the tensor the module reads instead of `input` (an alias
  // carrying the post-backward hook), or an undefined one.
  Tensor on_pre_forward(size_t use, const Tensor& input);
  void on_post_forward(size_t use, const Tensor& output);
  void on_pre_backward(size_t use, Call& call);
  void on_post_backward(size_t use, Call& call);
  void on_backward_end();

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
    bool whole_forward = false;  // the model itself: a root gathered for the whole forward and backward
    size_t ran = 0;              // modules of this use whose forward has run in this call
    size_t calls_waiting = 0;    // if it reduces: its calls in this step whose backward is not done
    std::shared_ptr<Call> call;  // the latest call, made by its first module's on_pre_forward
  };
  void hook_use(size_t index, const std::weak_ptr<ParameterOwner>& alive);
  void hook_holders(const std::weak_ptr<ParameterOwner>& alive);
  void begin_step();
  void prefetch_from(size_t use, int direction);
  void release(Unit& unit);  // unless summoned

  nn::Module& model_;
  std::vector<Unit*> units_;
  GradientReducer& reducer_;
  int prefetch_;
  int64_t prefetch_bytes_;  // 0: no bound
  std::vector<Use> uses_;
  std::map<const Unit*, size_t> in_backward_;  // per unit: its calls in their backward now
  std::vector<std::string> no_weight_backward_;  // plan.backward_reads_no_weights
  bool forward_open_ = false;  // a forward began and its backward has not ended
  size_t last_use_ = 0;        // the latest use whose forward began, in the open forward
  int summoned_ = 0;           // FullParameters scopes alive; while > 0 no unit is released
};

}  // namespace zg::dist
