// A unit: a group of parameters stored as one flat buffer per role, padded to a
// multiple of the world size N, rank r owning slice [r S, (r+1) S) -- FSDP2's
// FSDPParamGroup. It owns its lifecycle:
//
//   materialize        allocate this rank's buffers (the placement says which are
//                      full and which sharded) and fill them with the initial values
//   gather / release   ZeRO-3: all-gather the full compute weights before a use,
//                      free them after (prefetch issues the gather without waiting)
//   reduce_gradients   average one bucket of the gradient across ranks (all-reduce
//                      or reduce-scatter, as placed), returned as work in flight
//   optimizer_spans    the master / grad / m / v ranges this rank updates
//   after_step         ZeRO-1, 2: all-gather the updated slices into the full weights
//
// Schedulers (the gradient reducer's bucket order, ZeRO-3's gather order) decide
// when; the unit only knows how. It never reaches back into the ShardedModel.
#pragma once

#include <optional>

#include <functional>
#include <string>
#include <vector>

#include "dist/comm/process_group.h"
#include "dist/zero/placement.h"
#include "nn/module.h"
#include "optim/adamw.h"

namespace zg::dist {

// Where one parameter sits in its unit's flat buffers.
struct ParamSlot {
  std::string name;
  Tensor param;    // the module's parameter, a view into the unit's full buffer
  int64_t offset;  // in elements, into every buffer of the unit
  Shape shape;
};
// The slice of a flat buffer that belongs to one parameter, shaped like it.
Tensor view_of(const Tensor& flat, const ParamSlot& slot);

// A range [begin, end) of a unit's flat gradient, full once the gradients of its
// `members` parameters have all landed. DDP cuts a unit into buckets of about
// ZeroConfig::bucket_bytes; the ZeRO stages use one bucket per unit.
struct Bucket {
  int64_t begin = 0, end = 0;
  size_t members = 0;
  size_t arrived = 0;    // members whose gradient landed in this backward
  bool reduced = false;  // in this backward
  int64_t tag = 0;       // its reduction's CollectiveTag: the unit's, or (DDP) one of its own
};

// Compute weights in one flat buffer, padded to a multiple of N. Full placement: `full`
// is the buffer and `shard` a view of slice r. Sharded (ZeRO-3): `shard` has its own
// storage, and `full` (`communication`) exists only while gathered. With parameter
// offload and 16-bit compute, `shard` is the f32 master shard in host memory, cast to
// the compute dtype as it is gathered (its rounding is what the update would write).
struct ShardedWeights {
  Tensor full, shard;
  WorkHandle gathering;        // an all-gather of `full` in flight (a prefetch)
  uint64_t gathered_from = 0;  // shard's storage version at the last gather
  bool current() const;        // whole, gathered from the shard as it is now
  bool has_full() const { return full.defined() && full.numel() > 0; }  // a part ZeRO-3 gathers
};

// A reduction in flight; `then` finishes it (rounds a reduce-dtype result back, adds a
// shard into the gradient shard), or starts its next collective (hybrid sharding's
// all-reduce across shard groups), returned as the reduction still in flight.
struct InFlight {
  WorkHandle work;
  std::function<InFlight()> then;
};

// What every unit of one ShardedModel shares.
struct UnitContext {
  ProcessGroup& group;  // the units shard over it: the whole group, or a hybrid shard group
  ProcessGroup* replicas = nullptr;  // hybrid sharding: the same shard on the other groups
  Placement placement;
  DType compute_dtype, reduce_dtype, accumulate_dtype;  // accumulate: the gradient shard's
  Device device;  // the compute device (the parameters')
  // Where host-placed roles live: the host pool on the cpu (meta for a dry run).
  Device host() const { return device.type == DeviceType::meta ? kMeta : kCPU; }
  Device where(const RolePlacement& role) const { return role.where == Location::host ? host() : device; }
};

class Unit {
 public:
  Unit(const UnitContext& context, std::string name, nn::Module* module)
      : name(std::move(name)), module(module), ctx_(context) {}

  // Packs `trained` by parameter group (group_of: an index into `groups`, or -1), each
  // group's matrices first (so each (group, decay) is one range the optimizer updates with
  // one call), and `frozen` (ZeRO-3 shards frozen parameters too, in a buffer of their own).
  // Without groups: matrices, then the rest.
  void plan(const nn::NamedTensors& trained, const nn::NamedTensors& frozen, const std::vector<optim::ParamGroup>& groups,
            const std::function<int(const Tensor&)>& group_of);
  // Allocates this rank's buffers on `device` and fills them: the trained parameters'
  // master weights (f32; f64 for f64 compute) and compute copy, zeroed Adam state and
  // gradient. `initial(slot, begin, out)` writes elements [begin, begin + out.numel())
  // of a parameter's initial values into `out`, which is all a unit asks of a model.
  using InitialValues = std::function<void(const ParamSlot& slot, int64_t begin, const Tensor& out)>;
  void materialize(const InitialValues& initial);

  void prefetch();          // ZeRO-3: issues the all-gathers of what is not current
  void finish_gathers();    // waits for them
  void gather() { prefetch(); finish_gathers(); }
  void release();           // frees the full compute weights (after any gather in flight)
  bool is_current() const;  // every gathered part whole and current
  std::string release_note() const;  // when its full weights exist, for errors
  uint64_t compute_version() const;  // of the full compute weights: any write bumps it
  std::vector<ShardedWeights*> gathered_parts();

  // Gradients: before the first lands (ZeRO-2, 3) a zeroed full buffer, .grad views into it.
  void ensure_full_gradient();
  // Starts the bucket's reduction; `sync` false (DDP, ZeRO-1) keeps the gradients local.
  InFlight reduce_gradients(Bucket& bucket, bool sync);
  void zero_grad();
  // The update ranges of what this rank updates, each with its group's lr and decay; grads
  // scaled by the caller.
  std::vector<optim::AdamWSpan> optimizer_spans();
  // ZeRO-1, 2 after the update: every rank's new slice, into its full compute weights.
  WorkHandle after_step();
  // After master weights were loaded: the compute copy from them (every rank's, gathered).
  void refresh_compute();
  // The optimizer's slice of the compute weights: the shard itself, or (offload, with the
  // shard on the device) a host buffer the update writes, copied up by after_step.
  Tensor compute_for_update();
  // The compute weights the optimizer updates: this rank's slice, or the whole buffer (DDP).
  const Tensor& updated_weights() const { return ctx_.placement.optimizer_sharded() ? weights.shard : weights.full; }

  // Identity and layout.
  std::string name;
  int64_t tag = 0;               // its gathers' CollectiveTag: its place in the units, from 1
  nn::Module* module = nullptr;  // null for the root unit
  std::vector<ParamSlot> entries, frozen_entries;
  int64_t numel = 0, padded = 0, shard = 0;
  // [begin, end) of the trained buffer a parameter group's matrices or vectors fill, with
  // what that group changes (none: the defaults).
  struct UpdateRange {
    int64_t begin, end;
    bool decay;
    double lr_scale;
    std::optional<double> weight_decay;
  };
  std::vector<UpdateRange> update_ranges;
  // Buffers per role.
  ShardedWeights weights;  // the trained parameters' compute weights: [padded], [shard]
  ShardedWeights frozen;   // ZeRO-3's frozen parameters (undefined when none)
  Tensor grad_full;        // [padded]: always (full gradients), or during the unit's backward
  Tensor grad_shard;       // [shard]: slice r of grad_full, or its own storage
  Tensor master, m, v;     // [padded] (full optimizer state) or [shard]
  Tensor compute_staging;  // offload: the update's 16-bit weights on the host, until after_step
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;  // entry -> its bucket
  uint64_t written_by_us = 0;     // compute_version() after our last write
  bool keep_after_forward = false;  // ZeRO-3: gathered from its forward to its backward
  int64_t gathered_bytes() const;   // of its full compute weights (ZeRO-3), gathered or not

 private:
  void issue_gather(ShardedWeights& weights);
  void place(ShardedWeights& weights, const std::vector<ParamSlot>& slots, int64_t padded, const InitialValues& initial,
             bool shard_from_master);
  const UnitContext& ctx_;
};

// How checkpoints and the replicated state name a frozen parameter and a buffer.
inline constexpr std::string_view kFrozenKey = "frozen/", kBufferKey = "buffer/";

}  // namespace zg::dist
