// A unit: a group of parameters stored as one flat buffer per role, padded to a
// multiple of the S ranks it shards over, rank r owning slice [r P/S, (r+1) P/S) --
// FSDP2's FSDPParamGroup. It owns its buffers and its lifecycle:
//
//   materialize        allocate this rank's buffers (the placement says which are
//                      full and which sharded) and fill them with the initial values
//   gather / release   ZeRO-3: all-gather the full compute weights before a use,
//                      free them after (prefetch issues the gather without waiting)
//   reduce_gradients   average one range of the gradient across ranks (all-reduce or
//                      reduce-scatter, as placed), returned as work in flight
//   optimizer_spans    the master / grad / m / v ranges this rank updates
//   after_step         ZeRO-1, 2: all-gather the updated slices into the full weights
//
// Its compute weights are in one of three states, changed only by these methods:
//
//   sharded ──prefetch──> gathering ──finish_gathers──> gathered ──release──> sharded
//      └──────────────────────gather─────────────────────┘
//
// (stages 0-2 hold them whole: always gathered). Schedulers (the gradient reducer's
// bucket order, ZeRO-3's gather order) decide when; the unit only knows how. Others read
// its layout and roles through const accessors; it never reaches back into the model.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dist/comm/process_group.h"
#include "dist/zero/planner.h"
#include "optim/adamw.h"
#include "tensor/file_tier.h"

namespace zg::dist {

class Unit;

// The slice of a flat buffer that belongs to one parameter, shaped like it.
Tensor view_of(const Tensor& flat, const ParamSlot& slot);

// A reduction in flight; `then` finishes it (rounds a reduce-dtype result back, adds a
// shard into the gradient shard), or starts its next collective (hybrid sharding's
// all-reduce across shard groups), returned as the reduction still in flight.
struct InFlight {
  WorkHandle work;
  std::function<InFlight()> then;
  Unit* unit = nullptr;  // whose gradient (set by the gradient reducer)
};

// How a unit points its parameters' data and .grad at views of its buffers: ParameterOwner's
// protected rights, lent by the ShardedModel that owns the parameters.
struct ParameterViews {
  std::function<void(const Tensor& param, const Tensor& data)> point_data;
  std::function<void(const Tensor& param, const Tensor& grad)> point_grad;
};

// What every unit of one ShardedModel shares.
struct UnitContext {
  GroupRef group;  // the units shard over it: the mesh's dp_shard dimension
  std::optional<GroupRef> replicas;  // hybrid sharding: the same shard on the other groups (dp_replicate)
  Placement placement;
  DType compute_dtype, reduce_dtype, accumulate_dtype;  // accumulate: the gradient shard's
  Device device;  // the compute device (the parameters')
  bool quantize_weights = false;  // qwZ: ZeRO-3's gathers in blockwise int8 (quantized_gather.h)
  bool secondary_weights = false;  // hpZ: a secondary partition of the gathered weights over `node`
  int gradient_bits = 0;           // qgZ: reduce-scatters as quantized all-to-alls (quantized_reduce.h)
  int64_t gradient_block = 64;     // qgZ: elements a scale
  // hpZ, qgZ: the shard group's ranks on this rank's node (S), and those of its node rank on every node (N / S).
  std::optional<GroupRef> node, across;
  std::shared_ptr<FileTier> file_tier;  // offload nvme: where the state pages to (else null)
  bool delayed_update = false;  // DPU: the update never writes the compute weights in place (a staging buffer)
  // Where host-placed roles live: the host pool on the cpu (meta for a dry run).
  Device host() const { return device.type == DeviceType::meta ? kMeta : kCPU; }
  Device where(const RolePlacement& role) const { return role.where == Location::device ? device : host(); }
};

class Unit {
 public:
  enum class State : uint8_t { sharded, gathering, gathered };

  Unit(const UnitContext& context, UnitSpec spec);

  // Allocates this rank's buffers on the device and fills them: the trained parameters'
  // master weights (f32; f64 for f64 compute) and compute copy, zeroed Adam state and
  // gradient; the parameters become views of the full buffers. `initial(slot, begin, out)`
  // writes elements [begin, begin + out.numel()) of a parameter's initial values into `out`.
  using InitialValues = std::function<void(const ParamSlot& slot, int64_t begin, const Tensor& out)>;
  void materialize(const InitialValues& initial, ParameterViews views);

  // ZeRO-3's weights. prefetch issues the all-gathers of what is not current; gather waits.
  // `exact`: also what qwZ gathered quantized, gathered again as it is (summon_full_params).
  State state() const { return state_; }
  void prefetch(bool exact = false);
  void finish_gathers();
  void gather() { prefetch(); finish_gathers(); }
  void release();           // frees the full compute weights (after any gather in flight)
  bool is_current() const;  // every gathered part whole and gathered from the shard as it is now
  std::string release_note() const;   // when its full weights exist, for errors
  int64_t gathered_bytes() const;     // of its full compute weights (ZeRO-3), gathered or not
  // Whether someone else wrote the full compute weights since mark_compute_ours().
  bool compute_written_by_others() const { return compute_version() != written_by_us_; }
  void mark_compute_ours() { written_by_us_ = compute_version(); }

  // Gradients: before the first lands (ZeRO-2, 3) a zeroed full buffer, .grad views into it.
  void ensure_full_gradient();
  // Starts reducing [begin, end) of the gradient (the whole unit unless DDP cut it into
  // buckets), tagged `tag`; `sync` false keeps the full gradient, unreduced, for the next
  // micro-batch to add into (at ZeRO-2, 3 it then outlives the backward).
  InFlight reduce_gradients(int64_t begin, int64_t end, int64_t tag, bool sync);
  void zero_grad();
  // Changes with every write to the full gradient buffer that outlives a backward
  // (stages 0, 1: backward's and a user's in-place writes to .grad); 0 when there is none.
  uint64_t full_gradient_version() const { return grad_full_.defined() ? grad_full_.storage()->version() : 0; }
  // The update ranges of what this rank updates, each with its group's lr and decay.
  std::vector<optim::AdamWSpan> optimizer_spans();
  // ZeRO-1, 2 after the update: every rank's new slice, into its full compute weights.
  WorkHandle after_step();
  // After master weights were loaded: the compute copy from them (every rank's, gathered).
  void refresh_compute();

  // ZeRO-Infinity (offload nvme): the state in the file tier -- the master weights (at stage 3
  // the parameter shard too), Adam m and v, the gradient shard -- is in host memory only
  // between fetch_state and store_state (paged_state.h visits the units in order).
  enum class StateUse : uint8_t { gradient, update };  // the norm reads the gradient shard; AdamW all four
  bool pages_state() const { return paged_ != nullptr; }
  void fetch_state(StateUse use);                // starts the reads
  void await_state();                            // waits for them
  void store_state(StateUse use, bool updated);  // writes back what `use` changed (if updated); frees the rest
  void settle_state();                           // waits for its writes, frees their buffers

  // Layout, as planned.
  const std::string& name() const { return spec_.name; }
  int64_t tag() const { return spec_.tag; }
  nn::Module* module() const { return spec_.module; }
  const std::vector<ParamSlot>& entries() const { return spec_.entries; }
  const std::vector<ParamSlot>& frozen_entries() const { return spec_.frozen_entries; }
  int64_t numel() const { return spec_.numel; }
  int64_t padded() const { return spec_.padded; }
  int64_t shard() const { return spec_.shard; }
  bool keep_after_forward() const { return spec_.keep_after_forward; }
  // Roles, for reading (a checkpoint writes their values, never their storage).
  const Tensor& master() const { return master_; }  // [padded] (full optimizer state) or [shard]
  const Tensor& exp_avg() const { return m_; }
  const Tensor& exp_avg_sq() const { return v_; }
  const Tensor& grad_shard() const { return grad_shard_; }
  const Tensor& optimizer_gradient() const;  // what the optimizer reads: the full gradient (DDP) or the shard
  const Tensor& frozen_shard() const { return frozen_.shard; }  // undefined without frozen parameters

 private:
  // Compute weights in one flat buffer. Full placement: `full` is the buffer and `shard` a
  // view of slice r. Sharded (ZeRO-3): `shard` has its own storage, and `full`
  // (`communication`) exists only while gathered. With parameter offload and 16-bit
  // compute, `shard` is the f32 master shard on the host, cast as it is gathered.
  struct Weights {
    Tensor full, shard;
    WorkHandle gathering;        // an all-gather of `full` in flight (a prefetch)
    uint64_t gathered_from = 0;  // shard's storage version at the last gather
    bool quantized = false;      // the last gather was qwZ's: `full` holds dequantized values
    // hpZ: slice j (this rank's in its node) of the full weights as a gather brought them,
    // [padded / S]; current while the shard's version is `secondary_from`.
    Tensor secondary;
    uint64_t secondary_from = 0;
    bool secondary_holds = false, secondary_quantized = false;
    bool fills_secondary = false;  // the gather in flight is over all N: its result refreshes `secondary`
    bool current() const;
    bool secondary_current() const { return secondary_holds && shard.storage()->version() == secondary_from; }
    bool has_full() const { return full.defined() && full.numel() > 0; }  // a part ZeRO-3 gathers
  };
  struct PagedState {
    PagedTensor master, m, v, grad;
  };
  std::vector<PagedTensor*> paged(StateUse use) const;
  void page_out_state();                      // after materialize: the initial state to the file
  Tensor shard_to_gather(const Weights& w);   // on the device in the compute dtype (paged in for it)
  void into_gradient_shard(const Tensor& reduced, bool add);  // = or +=, paged in around it
  void zero_gradient_shard();
  std::vector<Weights*> gathered_parts();
  std::vector<const Weights*> gathered_parts() const;
  uint64_t compute_version() const;  // of the full compute weights: any write bumps it
  void issue_gather(Weights& weights, bool exact);
  void fill_secondary(Weights& weights);
  void place(Weights& weights, const std::vector<ParamSlot>& slots, int64_t padded, const InitialValues& initial,
             bool shard_from_master);
  void point_grads(const Tensor& grad_full);  // every trained parameter's .grad: a view, or none
  void expect_no_gather(const char* writer) const;  // a transition that writes the shard
  // The compute weights the optimizer updates: this rank's slice, or the whole buffer (DDP).
  const Tensor& updated_weights() const {
    return ctx_.placement.optimizer_sharded() ? weights_.shard : weights_.full;
  }
  Tensor compute_for_update();
  InFlight all_reduce_bucket(int64_t begin, int64_t end, bool sync);
  InFlight reduce_scatter_into_full(bool sync);
  InFlight reduce_scatter_and_free(bool sync);
  void keep_unsynced(bool synced);  // before a reduction (synced) or instead of one

  const UnitContext& ctx_;
  UnitSpec spec_;
  State state_ = State::gathered;
  ParameterViews views_;
  Weights weights_;          // the trained parameters' compute weights: [padded], [shard]
  Weights frozen_;           // ZeRO-3's frozen parameters (undefined when none)
  Tensor grad_full_;         // [padded]: always (full gradients), or from the unit's backward to its reduction
  Tensor grad_shard_;        // [shard]: slice r of grad_full, or its own storage
  Tensor grad_unsynced_;     // ZeRO-2, 3, sync off, accumulate dtype wider: [padded] micro-batches' sum
  Tensor master_, m_, v_;    // [padded] (full optimizer state) or [shard]
  Tensor compute_staging_;   // offload: the update's 16-bit weights on the host, until after_step
  std::unique_ptr<PagedState> paged_;  // offload nvme: the state's pages (paged_state.cpp)
  uint64_t written_by_us_ = 0;  // compute_version() after our last write
};

// How checkpoints and the replicated state name a frozen parameter and a buffer.
inline constexpr std::string_view kFrozenKey = "frozen/", kBufferKey = "buffer/";

}  // namespace zg::dist
