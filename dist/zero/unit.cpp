#include "dist/zero/unit.h"

#include <algorithm>
#include <utility>

#include "autograd/graph.h"
#include "dist/zero/buffers.h"
#include "dist/zero/quantized_gather.h"
#include "dist/zero/quantized_reduce.h"
#include "tensor/backend.h"
#include "tensor/trace.h"

namespace zg::dist {

namespace {

// The buffer a collective works on: `grad` itself, or a copy in the reduce dtype.
Tensor in_reduce_dtype(const Tensor& grad, DType dtype) {
  if (grad.dtype() == dtype) return grad;
  const Tensor wide = allocate(grad.numel(), dtype, grad.device(), MemoryCategory::communication, false);
  cast_into(grad, wide);
  return wide;
}

// Fills `buffer`, which holds elements [lo, lo + numel) of a unit's flat layout, with the
// slots' initial values, and the padding past the last slot with zeros.
void fill_range(const Tensor& buffer, int64_t lo, const std::vector<ParamSlot>& slots,
                const Unit::InitialValues& initial) {
  const int64_t hi = lo + buffer.numel();
  int64_t end_of_slots = 0;
  for (const ParamSlot& slot : slots) {
    const int64_t begin = std::max(lo, slot.offset), end = std::min(hi, slot.offset + numel(slot.shape));
    end_of_slots = slot.offset + numel(slot.shape);
    if (begin < end) initial(slot, begin - slot.offset, buffer.narrow(0, begin - lo, end - begin));
  }
  if (const int64_t from = std::max(lo, end_of_slots); from < hi) buffer.narrow(0, from - lo, hi - from).zero_();
}

}  // namespace

Tensor view_of(const Tensor& flat, const ParamSlot& slot) {
  return flat.narrow(0, slot.offset, numel(slot.shape)).view(slot.shape);
}

bool Unit::Weights::current() const {
  return !full.storage()->is_released() && shard.storage()->version() == gathered_from;
}

Unit::Unit(const UnitContext& context, UnitSpec spec)
    : ctx_(context), spec_(std::move(spec)),
      state_(context.placement.gathers_parameters() ? State::sharded : State::gathered) {}

// Compute weights of `slots` in the compute dtype: the whole buffer (full placement) or
// slice r, with the full buffer allocated and released until gathered (ZeRO-3).
void Unit::place(Weights& w, const std::vector<ParamSlot>& slots, int64_t padded_numel,
                 const InitialValues& initial, bool shard_from_master) {
  const int r = ctx_.group->rank();
  const int64_t shard_numel = padded_numel / ctx_.group->size();
  const Device device = ctx_.device;
  if (ctx_.placement.gathers_parameters()) {
    if (!shard_from_master) {  // else materialize() points it at the master
      const bool host = ctx_.placement.offloads_parameters();
      w.shard = allocate(shard_numel, ctx_.compute_dtype, ctx_.where(ctx_.placement.compute), MemoryCategory::parameter,
                         false, host);
      fill_range(w.shard, r * shard_numel, slots, initial);
    }
    {
      MemoryScope scope(MemoryCategory::communication);
      w.full = Tensor::empty_released({padded_numel}, TensorOptions(ctx_.compute_dtype).device(device));
    }
    w.full.storage()->set_release_note(release_note());  // released, so not current: the first use gathers
    if (ctx_.secondary_weights)
      w.secondary = allocate(padded_numel / (*ctx_.node)->size(), ctx_.compute_dtype, device, MemoryCategory::parameter,
                             false);
  } else {
    w.full = allocate(padded_numel, ctx_.compute_dtype, device, MemoryCategory::parameter, false);
    fill_range(w.full, 0, slots, initial);
    w.shard = w.full.narrow(0, r * shard_numel, shard_numel);
  }
}

void Unit::materialize(const InitialValues& initial, ParameterViews views) {
  NoGradGuard no_grad;
  views_ = std::move(views);
  const int r = ctx_.group->rank();
  const DType master_dtype = optim::master_dtype_for(ctx_.compute_dtype);
  const Placement& placement = ctx_.placement;
  const Device device = ctx_.device;
  const int64_t padded = spec_.padded, shard = spec_.shard;
  // Parameter offload with 16-bit compute: the f32 master shard is the parameter shard.
  const bool shard_from_master = placement.offloads_parameters() && master_dtype != ctx_.compute_dtype;
  place(weights_, spec_.entries, padded, initial, shard_from_master);
  if (!spec_.frozen_entries.empty()) place(frozen_, spec_.frozen_entries, spec_.frozen_padded, initial, false);

  const bool opt_sharded = placement.optimizer_sharded();
  const bool host = placement.offloads_optimizer();
  const Device state_device = ctx_.where(placement.optimizer_state);
  // The master weights have a buffer of their own unless they are the compute weights:
  // f32 compute, with the shard where the optimizer state is.
  if (master_dtype != ctx_.compute_dtype || (host && !placement.offloads_parameters())) {
    master_ = allocate(opt_sharded ? shard : padded, master_dtype, state_device, MemoryCategory::optimizer_state, false,
                       host);
    fill_range(master_, opt_sharded ? r * shard : 0, spec_.entries, initial);
    if (shard_from_master) weights_.shard = master_;
  } else {
    master_ = opt_sharded ? weights_.shard : weights_.full;
  }
  m_ = allocate(master_.numel(), master_dtype, state_device, MemoryCategory::optimizer_state, true, host);
  v_ = allocate(master_.numel(), master_dtype, state_device, MemoryCategory::optimizer_state, true, host);

  if (placement.frees_full_gradients() || host) {  // a shard of its own (offload: on the host)
    grad_shard_ = allocate(shard, ctx_.accumulate_dtype, ctx_.where(placement.gradients), MemoryCategory::gradient,
                           true, host);
    if (!placement.frees_full_gradients())
      grad_full_ = allocate(padded, ctx_.compute_dtype, device, MemoryCategory::gradient, true);
  } else {
    grad_full_ = allocate(padded, ctx_.compute_dtype, device, MemoryCategory::gradient, true);
    grad_shard_ = grad_full_.narrow(0, r * shard, shard);
  }
  // The model's parameters become views of the full buffers (released ones at ZeRO-3).
  for (const ParamSlot& slot : spec_.entries) views_.point_data(slot.param, view_of(weights_.full, slot));
  for (const ParamSlot& slot : spec_.frozen_entries) views_.point_data(slot.param, view_of(frozen_.full, slot));
  point_grads(grad_full_);
  mark_compute_ours();
  page_out_state();
}

void Unit::point_grads(const Tensor& grad_full) {
  for (const ParamSlot& slot : spec_.entries)
    views_.point_grad(slot.param, grad_full.defined() ? view_of(grad_full, slot) : Tensor());
}

std::vector<Unit::Weights*> Unit::gathered_parts() {
  std::vector<Weights*> parts;
  for (Weights* w : {&weights_, &frozen_})
    if (w->has_full()) parts.push_back(w);
  return parts;
}

std::vector<const Unit::Weights*> Unit::gathered_parts() const {
  std::vector<const Weights*> parts;
  for (const Weights* w : {&weights_, &frozen_})
    if (w->has_full()) parts.push_back(w);
  return parts;
}

int64_t Unit::gathered_bytes() const {
  int64_t bytes = 0;
  for (const Weights* w : gathered_parts()) bytes += w->full.nbytes();
  return bytes;
}

uint64_t Unit::compute_version() const {
  uint64_t version = 0;  // a sum of counters that only grow
  for (const Weights* w : gathered_parts()) version += w->full.storage()->version();
  return version;
}

bool Unit::is_current() const {
  if (state_ != State::gathered) return false;
  for (const Weights* w : gathered_parts())
    if (!w->current()) return false;
  return true;
}

std::string Unit::release_note() const {
  return "the full weights of ZeRO-3 unit '" + spec_.name +
         "', gathered only around the uses its UnitPlan names: a forward through them and the backward that "
         "follows (a root unit whose plan names no module: around the model's own forward, called through "
         "operator()); not for a module missing from the plan, a unit module whose own forward never runs (a "
         "ModuleList: name its items), a second backward through a retained graph, or after the ShardedModel is "
         "gone";
}

// sharded -> gathering, or gathered -> gathering when a step or a load made a part stale;
// a part in flight or current is left as it is.
void Unit::prefetch(bool exact) {
  if (!ctx_.placement.gathers_parameters()) return;
  TraceRange range("gather " + spec_.name);
  CollectiveTag scope(spec_.tag);
  for (Weights* w : gathered_parts()) {
    if (exact && w->quantized) finish_gathers();  // (a quantized gather in flight is let finish first)
    if (!w->gathering && (!w->current() || (exact && w->quantized))) {
      issue_gather(*w, exact);
      state_ = State::gathering;
    }
  }
}

void Unit::issue_gather(Weights& w, bool exact) {
  Storage& full = *w.full.storage();
  full.materialize();
  // Gathering the same weights as last time keeps the version the forward's saved tensors
  // recorded, so they stay valid. Once a step or a load has written the shard, it does not:
  // a backward through a graph the old weights made fails, as at the other stages, instead
  // of computing gradients with weights the forward never used.
  const uint64_t shard_version = w.shard.storage()->version();
  const uint64_t version = full.version();
  if (w.secondary_current() && !(exact && w.secondary_quantized)) {  // hpZ: within the node
    w.quantized = w.secondary_quantized;
    w.gathering = (*ctx_.node)->all_gather_async(w.secondary, w.full);
  } else {
    // An offloaded shard goes up to the device first (the f32 master cast to the compute dtype).
    const Tensor shard = shard_to_gather(w);
    w.quantized = ctx_.quantize_weights && !exact;
    w.gathering = w.quantized ? quantized_all_gather_async(*ctx_.group, shard, w.full)
                              : ctx_.group->all_gather_async(shard, w.full);
    w.fills_secondary = w.secondary.defined() && w.quantized == ctx_.quantize_weights;  // (not an exact regather)
  }
  if (shard_version == w.gathered_from) full.restore_version(version);
  w.gathered_from = shard_version;
}

// gathering -> gathered.
void Unit::finish_gathers() {
  if (state_ != State::gathering) return;
  for (Weights* w : gathered_parts()) {
    if (w->gathering) std::exchange(w->gathering, nullptr)->wait();
    if (std::exchange(w->fills_secondary, false)) fill_secondary(*w);
  }
  state_ = State::gathered;
}

// hpZ: slice j of what the gather over all N brought, kept for the step's later gathers.
void Unit::fill_secondary(Weights& w) {
  const int64_t part = w.secondary.numel();
  cast_into(w.full.narrow(0, (*ctx_.node)->rank() * part, part), w.secondary);
  w.secondary_from = w.gathered_from;
  w.secondary_holds = true;
  w.secondary_quantized = w.quantized;
}

// gathered (or gathering: the gather is let finish, as it writes into the buffer) -> sharded.
void Unit::release() {
  if (!ctx_.placement.gathers_parameters() || state_ == State::sharded) return;
  finish_gathers();
  for (Weights* w : gathered_parts()) w->full.storage()->release();
  state_ = State::sharded;
}

void Unit::ensure_full_gradient() {
  if (grad_full_.defined()) return;
  grad_full_ = allocate(spec_.padded, ctx_.compute_dtype, ctx_.device, MemoryCategory::gradient, true);
  point_grads(grad_full_);
}

// How each placement averages the gradient across ranks:
//   DDP            a bucket [begin, end) of the full gradient is all-reduced in place
//   ZeRO-1         the full gradient is reduce-scattered (summed) into slice r and the
//                  other slices zeroed, so a later synced micro-batch adds only new
//                  gradients; step() divides by N once
//   ZeRO-2, 3      the full gradient (alive only during the unit's backward) is
//                  reduce-scattered into a `communication` buffer (hybrid sharding:
//                  within the shard group, then all-reduced across the groups), added
//                  into the persistent gradient shard, and freed
// With `sync` false every stage keeps the full gradient for the next micro-batch to add
// into (ZeRO-2, 3: FSDP2's set_requires_gradient_sync(False)) and sends nothing.
// Offloaded, the gradient shard is in host memory: slice r goes down to it once reduced.
InFlight Unit::reduce_gradients(int64_t begin, int64_t end, int64_t tag, bool sync) {
  TraceRange range("reduce_gradients " + spec_.name);
  NoGradGuard no_grad;
  CollectiveTag scope(tag);
  if (ctx_.placement.all_reduces_gradients()) return all_reduce_bucket(begin, end, sync);
  if (ctx_.placement.sums_into_full_gradient()) return reduce_scatter_into_full(sync);
  return reduce_scatter_and_free(sync);
}

InFlight Unit::all_reduce_bucket(int64_t begin, int64_t end, bool sync) {
  InFlight job;
  if (!sync) return job;
  const Tensor grads = grad_full_.narrow(0, begin, end - begin);
  const Tensor buffer = in_reduce_dtype(grads, ctx_.reduce_dtype);
  job.work = ctx_.group->all_reduce_async(buffer, ReduceKind::average);
  if (!buffer.is_same(grads)) job.then = [buffer, grads] {
    cast_into(buffer, grads);
    return InFlight{};
  };
  return job;
}

// Summed, not averaged: slice r keeps the sum of every rank's gradients so far, and the
// others are zeroed once reduced, so the next synced micro-batch's reduction adds only
// what came since. (An in-place average would average slice r's earlier average.)
InFlight Unit::reduce_scatter_into_full(bool sync) {
  InFlight job;
  if (!sync) return job;
  ProcessGroup& group = *ctx_.group;
  const int64_t shard = spec_.shard;
  const Tensor buffer = in_reduce_dtype(grad_full_, ctx_.reduce_dtype);
  const Tensor slice = ctx_.placement.offloads_optimizer() ? grad_full_.narrow(0, group.rank() * shard, shard) : grad_shard_;
  const Tensor mine = buffer.is_same(grad_full_)
                          ? slice
                          : allocate(shard, ctx_.reduce_dtype, buffer.device(), MemoryCategory::communication, false);
  job.work = group.reduce_scatter_async(buffer, mine, ReduceKind::sum);
  job.then = [this, mine, slice, full = grad_full_, r = group.rank(), s = shard] {
    if (!mine.is_same(slice)) cast_into(mine, slice);
    if (!slice.is_same(grad_shard_)) into_gradient_shard(slice, false);  // offload: the running sum, down to the host
    backend(full.device()).fill(full.narrow(0, 0, r * s), 0.0);
    backend(full.device()).fill(full.narrow(0, (r + 1) * s, full.numel() - (r + 1) * s), 0.0);
    return InFlight{};
  };
  return job;
}

// ZeRO-2, 3 between synced micro-batches: autograd adds into the kept full gradient, in
// the compute dtype; a wider accumulate dtype sums the micro-batches in `grad_unsynced_`
// instead, as the shard would have, and frees each micro-batch's full gradient.
void Unit::keep_unsynced(bool synced) {
  if (ctx_.accumulate_dtype == ctx_.compute_dtype || (synced && !grad_unsynced_.defined())) return;
  if (!grad_unsynced_.defined())
    grad_unsynced_ = allocate(spec_.padded, ctx_.accumulate_dtype, ctx_.device, MemoryCategory::gradient, true);
  backend(ctx_.device).binary(BinaryOp::add, grad_unsynced_, moved(grad_full_, ctx_.device, ctx_.accumulate_dtype),
                              grad_unsynced_);
  point_grads(Tensor());
  grad_full_ = Tensor();
}

// A unit none of whose parameters got a gradient here still takes part, with zeros: on
// other ranks they may have. The full gradient is freed here as far as this rank's code
// goes: a host group's queued collective holds the buffer until it has run; on NCCL,
// record_stream keeps the allocator from reusing the block until the reduce-scatter is done.
InFlight Unit::reduce_scatter_and_free(bool sync) {
  ensure_full_gradient();
  keep_unsynced(sync);
  if (!sync) return {};
  const Tensor summed = grad_unsynced_.defined() ? std::exchange(grad_unsynced_, Tensor()) : grad_full_;
  point_grads(Tensor());
  grad_full_ = Tensor();
  const bool quantized = ctx_.gradient_bits != 0;  // qgZ: sums in f32
  const Tensor buffer = quantized ? summed : in_reduce_dtype(summed, ctx_.reduce_dtype);
  const Tensor mine = allocate(spec_.shard, quantized ? DType::f32 : ctx_.reduce_dtype, buffer.device(),
                               MemoryCategory::communication, false);
  const auto accumulate = [this, mine] {  // across micro-batches: grad_shard += mine
    into_gradient_shard(mine, true);
    return InFlight{};
  };
  if (quantized)
    return quantized_reduce_scatter(**ctx_.node, **ctx_.across, buffer, mine, ctx_.gradient_bits, ctx_.gradient_block,
                                    accumulate);
  InFlight job{ctx_.group->reduce_scatter_async(buffer, mine, ReduceKind::average), accumulate};
  // Hybrid sharding: the group's average, averaged across the groups holding the same shard.
  if (ctx_.replicas)
    job.then = [mine, accumulate, replicas = *ctx_.replicas, tag = CollectiveTag::current()] {
      CollectiveTag scope(tag);
      return InFlight{replicas->all_reduce_async(mine, ReduceKind::average), accumulate};
    };
  return job;
}

void Unit::zero_grad() {
  if (ctx_.placement.frees_full_gradients()) {
    zero_gradient_shard();
    point_grads(Tensor());
    grad_full_ = grad_unsynced_ = Tensor();  // unsynced micro-batches', or a backward that never completed
  } else {
    grad_full_.zero_();
    if (ctx_.placement.offloads_optimizer()) zero_gradient_shard();  // its own buffer, on the host
  }
}

// The shard is what a gather in flight reads: nothing may write it until the gather is done.
void Unit::expect_no_gather(const char* writer) const {
  ZG_CHECK(state_ != State::gathering, "ShardedModel: ", writer, " would write the shard of unit '", spec_.name,
           "' while an all-gather in flight reads it; finish_gathers() first");
}

const Tensor& Unit::optimizer_gradient() const {
  return ctx_.placement.optimizer_sharded() ? grad_shard_ : grad_full_;
}

std::vector<optim::AdamWSpan> Unit::optimizer_spans() {
  expect_no_gather("the optimizer");
  const int64_t base = ctx_.placement.optimizer_sharded() ? ctx_.group->rank() * spec_.shard : 0;
  const Tensor& grad = optimizer_gradient();
  const Tensor compute = compute_for_update();
  std::vector<optim::AdamWSpan> spans;
  // Each update range, cut to this rank's part.
  for (const UpdateRange& range : spec_.update_ranges) {
    const int64_t begin = std::max(range.begin, base), end = std::min(range.end, base + master_.numel());
    if (end <= begin) continue;
    auto part = [&](const Tensor& t) { return t.narrow(0, begin - base, end - begin); };
    spans.push_back({part(master_), part(grad), part(m_), part(v_), compute.defined() ? part(compute) : Tensor(),
                     range.decay, range.lr_scale, range.weight_decay});
  }
  return spans;
}

// The optimizer's slice of the compute weights: the shard itself, or (offload, with the
// shard on the device) a host buffer the update writes, copied up by after_step.
Tensor Unit::compute_for_update() {
  const Tensor& mine = updated_weights();
  if (mine.is_same(master_)) return {};  // the master is the compute weights
  if (mine.device() == master_.device() && !ctx_.delayed_update) return mine;  // (DPU: the next forward reads mine)
  // From the host pool: page-locked with a GPU (the copy up runs at the link's speed), and
  // cached, so the same buffer serves every step (tensor/block_cache.h).
  compute_staging_ =
      allocate(master_.numel(), ctx_.compute_dtype, master_.device(), MemoryCategory::communication, false, true);
  return compute_staging_;
}

WorkHandle Unit::after_step() {
  TraceRange range("after_step " + spec_.name);
  if (compute_staging_.defined()) {  // offload: the updated compute weights up to the device
    const Tensor& mine = updated_weights();
    cast_into(std::exchange(compute_staging_, Tensor()), mine);
    mine.storage()->bump_version();
  }
  if (!ctx_.placement.gathers_after_step()) return nullptr;
  CollectiveTag scope(spec_.tag);
  return ctx_.group->all_gather_async(weights_.shard, weights_.full);
}

void Unit::refresh_compute() {
  expect_no_gather("a load");
  NoGradGuard no_grad;
  if (!updated_weights().is_same(master_)) Tensor(updated_weights()).copy_(master_);
  if (!ctx_.placement.optimizer_sharded()) return;
  CollectiveTag scope(spec_.tag);
  if (!ctx_.placement.gathers_parameters()) ctx_.group->all_gather(weights_.shard, weights_.full);
}

}  // namespace zg::dist
