// ShardedModel's unit, bucket and use: private to dist/ (see sharded_model.h for
// what each stage keeps).
#pragma once

#include <string_view>

#include "dist/zero/sharded_model.h"
#include "optim/flat_parameters.h"

namespace zg::dist {

// A range [begin, end) of a unit's flat gradient, full once the gradients of its
// `members` parameters have all landed (then reduced in the fixed order). DDP cuts a unit into buckets of about
// ZeroConfig::bucket_bytes; the ZeRO stages use one bucket per unit.
struct ShardedModel::Bucket {
  int64_t begin = 0, end = 0;
  size_t members = 0;
  size_t arrived = 0;  // stages 0-2: members whose gradient landed in this backward
  bool reduced = false;  // in this backward
  int64_t tag = 0;     // its reduction's CollectiveTag: the unit's, or (DDP) one of its own
};

// Compute weights in one flat buffer, padded to a multiple of N; slice r is rank r's.
// Stages 0-2: `full` is the buffer and `shard` a view of its slice r. Stage 3: `shard`
// has its own storage, and `full` (`communication`) is all-gathered from every rank's
// shard around each use of the unit and released between uses.
struct ShardedModel::ShardedWeights {
  Tensor full, shard;
  WorkHandle gathering;        // ZeRO-3: an all-gather of `full` in flight (a prefetch)
  uint64_t gathered_from = 0;  // ZeRO-3: shard's storage version at the last gather
};

struct ShardedModel::Unit {
  std::string name;
  int64_t tag = 0;               // its gathers' CollectiveTag: its place in the units, from 1
  nn::Module* module = nullptr;  // null for the root unit
  std::vector<optim::FlatParameters::Entry> entries;  // the trained parameters
  int64_t numel = 0, decay_numel = 0, padded = 0, shard = 0;
  ShardedWeights weights;  // the trained parameters' compute weights: [padded], [shard]
  Tensor grad_full;        // [padded]: stages 0-1 always; stages 2-3 only during the unit's backward
  Tensor grad_shard;       // [shard]: slice r of grad_full (stages 0-1) or its own storage
  Tensor master, m, v;     // [padded] (stage 0) or [shard]
  // Stage 3: the unit's frozen parameters (requires_grad false when the ShardedModel was
  // built), sharded and gathered with the trained ones but in a buffer of their own, for
  // they have no gradient to reduce and no master or Adam state. (At stages 0-2 every rank
  // holds them whole: ShardedModel::frozen_.)
  std::vector<optim::FlatParameters::Entry> frozen_entries;
  ShardedWeights frozen;  // undefined tensors when there are none
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;  // entry -> its bucket
  uint64_t written_by_us = 0;     // compute_version() after our last write (ZeRO-3: while summoned)
};

// ZeRO-3: one place where the forward uses a unit -- a block, or the modules of
// UnitPlan::root_before / root_after -- in forward order.
struct ShardedModel::Use {
  Unit* unit = nullptr;
  std::vector<nn::Module*> modules;
  bool backward_reads = true;  // some module's backward reads the unit's weights
  // The unit's first use: when its backward is done, so is the unit's, and the unit's
  // gradient is reduced then (the same moment on every rank, whichever of its
  // parameters got a gradient there).
  bool reduces = false;
  size_t ran = 0;             // modules of this use whose forward has run in this pass
  size_t backwards_waiting = 0;  // if it reduces: its calls in this forward whose backward is not done
};

// What ZeRO-3 gathers of a unit around its uses: its trained and its frozen compute
// weights, each where it has elements.
std::vector<ShardedModel::ShardedWeights*> gathered_parts(ShardedModel::Unit& unit);

// The version of a unit's full compute weights, trained and frozen: any write bumps it.
uint64_t compute_version(ShardedModel::Unit& unit);

// How ShardedModel::replicated() and checkpoints name a frozen parameter and a buffer:
// the prefix, then its name.
inline constexpr std::string_view kFrozenKey = "frozen/", kBufferKey = "buffer/";

// Where ShardedModel's small agreements between ranks run: on the model's device (meta,
// which has no values: the CPU), or on the CPU for a group that takes host tensors only (mpi).
Device agreement_device(const ProcessGroup& group, Device model_device);

// Runs fn on this rank, then every rank learns whether it threw on any: where it did,
// its error is rethrown (with " (<consequence>)" unless that is empty); elsewhere
// "<who>: k other rank(s) failed (their errors say why); <consequence>". So no rank waits in a collective that another,
// having thrown, will never issue.
void all_or_none(ProcessGroup& group, Device device, const std::string& who, const std::string& consequence,
                 const std::function<void()>& fn);

// Values every rank must give alike: different ones would make the replicas drift apart
// unnoticed. A max-reduction of [x, -x] gives every rank the largest and the smallest of
// each -- the same figures on all, so all refuse together, before anything changes.
class Agreement {
 public:
  // Issues the reduction (asynchronous: other work may overlap it).
  Agreement(ProcessGroup& group, Device on, const std::vector<std::pair<std::string, double>>& values);
  // Waits, and throws "<who> a different <name> on some ranks (from <least> to <most>);
  // every rank must pass the same" for the first value that differs.
  void check(const std::string& who);

 private:
  std::vector<std::string> names_;
  Tensor bounds_;
  WorkHandle work_;
};

}  // namespace zg::dist
