// The placement policy: where each role of a unit's memory lives, derived once from
// the configuration. DDP and the ZeRO stages differ only here (docs/design.md's table):
//
//   role                 DDP (0)        ZeRO-1         ZeRO-2               ZeRO-3
//   compute parameters   full           full           full                 sharded, full around each use
//   gradients            full           full           sharded, full during sharded, full during
//                        all-reduced    reduce-scattered the unit's backward the unit's backward
//   master + Adam m, v   full           sharded        sharded              sharded
//
// Every other file asks this policy a question ("are the compute weights gathered
// around each use?"), never a stage number.
//
// Offload (ZeRO-Offload, ZeRO-Infinity's CPU tier) moves roles to host memory, the
// rank's host pool (bytes per parameter per rank, bf16 compute, stage 3 at N ranks):
//
//   offload                 device                          host
//   none                    16/N (+ the units in use)       0
//   optimizer               2/N  (+ the units in use)       14/N: master, m, v, gradient shard
//   optimizer + parameters  the units in use only           14/N: the f32 master doubles as the
//                                                           parameter shard, cast per gather
//   nvme (ZeRO-Infinity)    stage 3: the units in use only  a few units' state at a time; the
//                           (stages 1, 2: 2 full)           16/N in a file (tensor/file_tier.h)
//
// The gradient shard goes with the optimizer: the CPU AdamW reads it where it runs. With
// nvme the master (at stage 3 the parameter shard too), m, v and the gradient shard are
// paged in for each use and out after (dist/zero/state_pager.h).
#pragma once

#include <string>
#include <string_view>

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
enum class Location : uint8_t { device, host, file };  // file: host memory only while paged in

// Which roles live in host memory (ZeroConfig::offload).
enum class Offload : uint8_t {
  none,
  optimizer,              // master weights, Adam m and v, the gradient shard; stages 1-3
  optimizer_and_params,   // and the parameter shards (ZeRO-3)
  nvme,                   // all of these in the file tier (ZeroConfig::offload_dir); stages 1-3
};
const char* name(Offload offload);  // "none", "optimizer", "optimizer+params", "nvme"
// Parses name(); throws zg::Error listing the choices.
Offload parse_offload(std::string_view text);

struct RolePlacement {
  Layout layout;
  FullWhen full_when;
  Location where = Location::device;
};

struct Placement {
  RolePlacement compute, gradients, optimizer_state;

  // What is wrong with a stage and offload: "" when they go together (ZeroConfig::problem
  // asks this for its part).
  static std::string problem(int stage, Offload offload);
  // DDP is stage 0; ZeRO-1, 2, 3 shard optimizer state, then gradients, then parameters.
  static Placement for_stage(int stage, Offload offload = Offload::none) {
    const std::string wrong = problem(stage, offload);
    ZG_CHECK(wrong.empty(), wrong);
    const bool opt = stage >= 1, grads = stage >= 2, params = stage >= 3;
    const bool nvme = offload == Offload::nvme;
    const Location state = offload == Offload::none ? Location::device : nvme ? Location::file : Location::host;
    const Location weights = offload == Offload::optimizer_and_params ? Location::host
                             : nvme && params                         ? Location::file
                                                                      : Location::device;
    return {{params ? Layout::sharded : Layout::full, params ? FullWhen::around_use : FullWhen::always, weights},
            {grads ? Layout::sharded : Layout::full, grads ? FullWhen::during_backward : FullWhen::always, state},
            {opt ? Layout::sharded : Layout::full, opt ? FullWhen::never : FullWhen::always, state}};
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

  // Offload: the optimizer state (and the gradient shard it reads) in host memory.
  bool offloads_optimizer() const { return optimizer_state.where != Location::device; }
  // ZeRO-3 with parameter offload: the parameter shards in host memory (or the file tier).
  bool offloads_parameters() const { return compute.where != Location::device; }
  // ZeRO-Infinity: the optimizer state, gradient shard (and ZeRO-3's parameter shard) paged from a file.
  bool pages_to_file() const { return optimizer_state.where == Location::file; }

  // "DDP (stage 0)", "ZeRO-2": the stage number is derived back, only to name it.
  int stage() const {
    return gathers_parameters() ? 3 : frees_full_gradients() ? 2 : optimizer_sharded() ? 1 : 0;
  }
  std::string name() const {
    const std::string stage_name = stage() == 0 ? "DDP (stage 0)" : "ZeRO-" + std::to_string(stage());
    return pages_to_file()          ? stage_name + " + offload nvme"
           : offloads_parameters() ? stage_name + " + offload optimizer+params"
           : offloads_optimizer()  ? stage_name + " + offload optimizer"
                                   : stage_name;
  }
};

}  // namespace zg::dist
