// The placement policy: where each role of a unit's memory lives, derived once from
// the configuration. DDP and the ZeRO stages differ only here (DESIGN.md's table):
//
//   role                 DDP (0)        ZeRO-1         ZeRO-2               ZeRO-3
//   compute parameters   full           full           full                 sharded, full around each use
//   gradients            full           full           sharded, full during sharded, full during
//                        all-reduced    reduce-scattered the unit's backward the unit's backward
//   master + Adam m, v   full           sharded        sharded              sharded
//
// Every other file asks this policy a question ("are the compute weights gathered
// around each use?"), never a stage number. Host placement (offload) is a Location here.
#pragma once

#include <string>

#include "tensor/error.h"

namespace zg::dist {

enum class Layout : uint8_t {
  full,     // every rank holds the whole unit
  sharded,  // rank r holds slice r; a full copy exists only when FullWhen says
};
enum class FullWhen : uint8_t {
  always,          // the full buffer is the persistent one
  around_use,      // compute weights: all-gathered before each use, freed after
  during_backward, // gradients: the unit's full gradient lives from its first arrival to its reduction
  never,           // only the shard exists (master weights and Adam state)
};
enum class Location : uint8_t { device, host };

struct RolePlacement {
  Layout layout;
  FullWhen full_when;
  Location where = Location::device;
};

struct Placement {
  RolePlacement compute, gradients, optimizer_state;

  // DDP is stage 0; ZeRO-1, 2, 3 shard optimizer state, then gradients, then parameters.
  static constexpr bool valid_stage(int64_t stage) { return stage >= 0 && stage <= 3; }
  static Placement for_stage(int stage) {
    ZG_CHECK(valid_stage(stage), "ShardedModel: stage must be 0, 1, 2 or 3, got ", stage);
    const bool opt = stage >= 1, grads = stage >= 2, params = stage >= 3;
    return {{params ? Layout::sharded : Layout::full, params ? FullWhen::around_use : FullWhen::always},
            {grads ? Layout::sharded : Layout::full, grads ? FullWhen::during_backward : FullWhen::always},
            {opt ? Layout::sharded : Layout::full, opt ? FullWhen::never : FullWhen::always}};
  }

  // ZeRO-3: compute weights are gathered before each use and freed after.
  bool gathers_parameters() const { return compute.layout == Layout::sharded; }
  // DDP: gradients are all-reduced in buckets and every rank updates everything.
  bool all_reduces_gradients() const { return optimizer_state.layout == Layout::full; }
  // ZeRO-2, 3: a unit's full gradient exists only during its backward.
  bool frees_full_gradients() const { return gradients.layout == Layout::sharded; }
  // ZeRO-1: the full gradient stays; the reduce-scatter sums into slice r, step() divides by N.
  bool sums_into_full_gradient() const { return gradients.layout == Layout::full && !all_reduces_gradients(); }
  // ZeRO-1, 2: every rank updates its slice, then all-gathers everyone's into its full weights.
  bool gathers_after_step() const { return compute.layout == Layout::full && !all_reduces_gradients(); }
  // The optimizer updates slice r (else the whole buffer).
  bool optimizer_sharded() const { return optimizer_state.layout == Layout::sharded; }

  // "DDP (stage 0)", "ZeRO-2": the stage number is derived back, only to name it.
  int stage() const {
    return gathers_parameters() ? 3 : frees_full_gradients() ? 2 : optimizer_sharded() ? 1 : 0;
  }
  std::string name() const { return stage() == 0 ? "DDP (stage 0)" : "ZeRO-" + std::to_string(stage()); }
};

}  // namespace zg::dist
