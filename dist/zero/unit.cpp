#include "dist/zero/unit.h"

#include <algorithm>
#include <utility>

#include "autograd/graph.h"
#include "tensor/backend.h"
#include "tensor/trace.h"

namespace zg::dist {

namespace {

// ParameterOwner's repointing, for the units of the owner (a ShardedModel) that holds them.
struct Repoint : ParameterOwner {
  using ParameterOwner::point_data;
  using ParameterOwner::point_grad;
};

// On the host (cpu or meta) a buffer comes from the rank's host pool (TensorOptions::pinned).
Tensor allocate(int64_t numel, DType dtype, Device device, MemoryCategory category, bool zeroed, bool host = false) {
  MemoryScope scope(category);
  Tensor t = empty({numel}, TensorOptions(dtype).device(device).pinned(host));
  if (zeroed) t.zero_();
  return t;
}

// dst = src rounded to dst's dtype, through the backend (grads are not autograd state);
// across devices (offload) through the device's backend.
void cast_into(const Tensor& src, const Tensor& dst) {
  backend(dst.device().type == DeviceType::cpu ? src.device() : dst.device()).copy(src, dst);
}

// `t` on `device` in `dtype`: itself, or a `communication` copy (offload's transfers).
Tensor moved(const Tensor& t, Device device, DType dtype) {
  if (t.device() == device && t.dtype() == dtype) return t;
  const Tensor out = allocate(t.numel(), dtype, device, MemoryCategory::communication, false);
  cast_into(t, out);
  return out;
}

// The buffer a collective works on: `grad` itself, or a copy in the reduce dtype.
Tensor in_reduce_dtype(const Tensor& grad, DType dtype) {
  if (grad.dtype() == dtype) return grad;
  const Tensor wide = allocate(grad.numel(), dtype, grad.device(), MemoryCategory::communication, false);
  cast_into(grad, wide);
  return wide;
}

int64_t padded_to(int64_t numel, int ranks) { return (numel + ranks - 1) / ranks * ranks; }

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

bool ShardedWeights::current() const {
  return !full.storage()->is_released() && shard.storage()->version() == gathered_from;
}

void Unit::plan(const nn::NamedTensors& trained, const nn::NamedTensors& frozen,
                const std::vector<optim::ParamGroup>& parameter_groups,
                const std::function<int(const Tensor&)>& group_of) {
  std::vector<int> group(trained.size());
  for (size_t i = 0; i < trained.size(); ++i) group[i] = group_of(trained[i].second);
  for (int g = -1; g < static_cast<int>(parameter_groups.size()); ++g)
    for (bool decay : {true, false}) {  // matrices first: each (group, decay) is one contiguous range
      const int64_t begin = numel;
      for (size_t i = 0; i < trained.size(); ++i) {
        const auto& [name, p] = trained[i];
        if (group[i] != g || (p.dim() >= 2) != decay) continue;
        entries.push_back({name, p, numel, p.shape()});
        numel += p.numel();
      }
      if (numel > begin)
        update_ranges.push_back({begin, numel, decay, g < 0 ? 1.0 : parameter_groups[g].lr_scale,
                                 g < 0 ? std::nullopt : parameter_groups[g].weight_decay});
    }
  int64_t frozen_numel = 0;
  for (const auto& [name, p] : frozen) {
    frozen_entries.push_back({name, p, frozen_numel, p.shape()});
    frozen_numel += p.numel();
  }
  padded = padded_to(numel, ctx_.group.size());
  shard = padded / ctx_.group.size();
}

// Compute weights of `slots` in the compute dtype: the whole buffer (full placement) or
// slice r, with the full buffer allocated and released until gathered (ZeRO-3).
void Unit::place(ShardedWeights& w, const std::vector<ParamSlot>& slots, int64_t padded_numel,
                 const InitialValues& initial, bool shard_from_master) {
  const int r = ctx_.group.rank();
  const int64_t shard_numel = padded_numel / ctx_.group.size();
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
  } else {
    w.full = allocate(padded_numel, ctx_.compute_dtype, device, MemoryCategory::parameter, false);
    fill_range(w.full, 0, slots, initial);
    w.shard = w.full.narrow(0, r * shard_numel, shard_numel);
  }
}

void Unit::materialize(const InitialValues& initial) {
  NoGradGuard no_grad;
  const int r = ctx_.group.rank();
  const DType master_dtype = optim::master_dtype_for(ctx_.compute_dtype);
  const Placement& placement = ctx_.placement;
  const Device device = ctx_.device;
  // Parameter offload with 16-bit compute: the f32 master shard is the parameter shard.
  const bool shard_from_master = placement.offloads_parameters() && master_dtype != ctx_.compute_dtype;
  place(weights, entries, padded, initial, shard_from_master);
  if (!frozen_entries.empty())
    place(frozen, frozen_entries, padded_to(frozen_entries.back().offset + zg::numel(frozen_entries.back().shape),
                                            ctx_.group.size()),
          initial, false);

  const bool opt_sharded = placement.optimizer_sharded();
  const bool host = placement.offloads_optimizer();
  const Device state_device = ctx_.where(placement.optimizer_state);
  // The master weights have a buffer of their own unless they are the compute weights:
  // f32 compute, with the shard where the optimizer state is.
  if (master_dtype != ctx_.compute_dtype || (host && !placement.offloads_parameters())) {
    master = allocate(opt_sharded ? shard : padded, master_dtype, state_device, MemoryCategory::optimizer_state, false,
                      host);
    fill_range(master, opt_sharded ? r * shard : 0, entries, initial);
    if (shard_from_master) weights.shard = master;
  } else {
    master = opt_sharded ? weights.shard : weights.full;
  }
  m = allocate(master.numel(), master_dtype, state_device, MemoryCategory::optimizer_state, true, host);
  v = allocate(master.numel(), master_dtype, state_device, MemoryCategory::optimizer_state, true, host);

  if (placement.frees_full_gradients() || host) {  // a shard of its own (offload: on the host)
    grad_shard = allocate(shard, ctx_.accumulate_dtype, ctx_.where(placement.gradients), MemoryCategory::gradient,
                          true, host);
    if (!placement.frees_full_gradients())
      grad_full = allocate(padded, ctx_.compute_dtype, device, MemoryCategory::gradient, true);
  } else {
    grad_full = allocate(padded, ctx_.compute_dtype, device, MemoryCategory::gradient, true);
    grad_shard = grad_full.narrow(0, r * shard, shard);
  }
  // The model's parameters become views of the full buffers (released ones at ZeRO-3).
  for (const auto* slots : {&entries, &frozen_entries})
    for (const ParamSlot& slot : *slots) {
      Repoint::point_data(slot.param, view_of(slots == &entries ? weights.full : frozen.full, slot));
      Repoint::point_grad(slot.param, grad_full.defined() ? view_of(grad_full, slot) : Tensor());
    }
  written_by_us = compute_version();
}

std::vector<ShardedWeights*> Unit::gathered_parts() {
  std::vector<ShardedWeights*> parts;
  for (ShardedWeights* w : {&weights, &frozen})
    if (w->has_full()) parts.push_back(w);
  return parts;
}

int64_t Unit::gathered_bytes() const {
  int64_t bytes = 0;
  for (const ShardedWeights* w : {&weights, &frozen})
    if (w->has_full()) bytes += w->full.nbytes();
  return bytes;
}

uint64_t Unit::compute_version() const {
  uint64_t version = 0;  // a sum of counters that only grow
  for (const ShardedWeights* w : {&weights, &frozen})
    if (w->has_full()) version += w->full.storage()->version();
  return version;
}

bool Unit::is_current() const {
  for (const ShardedWeights* w : {&weights, &frozen})
    if (w->has_full() && !w->current()) return false;
  return true;
}

std::string Unit::release_note() const {
  return "the full weights of ZeRO-3 unit '" + name +
         "', gathered only around the uses its UnitPlan names: a forward through them and the backward that "
         "follows (a root unit whose plan names no module: around the model's own forward, called through "
         "operator()); not for a module missing from the plan, a unit module whose own forward never runs (a "
         "ModuleList: name its items), a second backward through a retained graph, the backward of an earlier "
         "forward when two forwards ran first (run each forward's backward before the next forward), or after "
         "the ShardedModel is gone";
}

void Unit::prefetch() {
  TraceRange range("gather " + name);
  CollectiveTag scope(tag);
  for (ShardedWeights* w : gathered_parts()) issue_gather(*w);
}

void Unit::issue_gather(ShardedWeights& w) {
  // Weights left whole across a step or a load are the old ones: gathered again.
  if (w.gathering || w.current()) return;
  Storage& full = *w.full.storage();
  full.materialize();
  // Gathering the same weights as last time keeps the version the forward's saved tensors
  // recorded, so they stay valid. Once a step or a load has written the shard, it does not:
  // a backward through a graph the old weights made fails, as at the other stages, instead
  // of computing gradients with weights the forward never used.
  const uint64_t shard_version = w.shard.storage()->version();
  const uint64_t version = full.version();
  // An offloaded shard goes up to the device first (the f32 master cast to the compute dtype).
  w.gathering = ctx_.group.all_gather_async(moved(w.shard, ctx_.device, ctx_.compute_dtype), w.full);
  if (shard_version == w.gathered_from) full.restore_version(version);
  w.gathered_from = shard_version;
}

void Unit::finish_gathers() {
  for (ShardedWeights* w : gathered_parts())
    if (w->gathering) std::exchange(w->gathering, nullptr)->wait();
}

void Unit::release() {
  if (!ctx_.placement.gathers_parameters()) return;
  finish_gathers();  // a gather in flight writes into the buffers: let it finish
  for (ShardedWeights* w : gathered_parts()) w->full.storage()->release();
}

void Unit::ensure_full_gradient() {
  if (grad_full.defined()) return;
  grad_full = allocate(padded, ctx_.compute_dtype, ctx_.device, MemoryCategory::gradient, true);
  for (const ParamSlot& slot : entries) Repoint::point_grad(slot.param, view_of(grad_full, slot));
}

// How each placement averages a bucket across ranks:
//   DDP            the bucket of the full gradient is all-reduced in place
//   ZeRO-1         the full gradient is reduce-scattered (summed) into slice r and the
//                  other slices zeroed, so a later synced micro-batch adds only new
//                  gradients; step() divides by N once
//   ZeRO-2, 3      the full gradient (alive only during the unit's backward) is
//                  reduce-scattered into a `communication` buffer (hybrid sharding:
//                  within the shard group, then all-reduced across the groups), added
//                  into the persistent gradient shard, and freed
// Offloaded, the gradient shard is in host memory: slice r goes down to it once reduced.
InFlight Unit::reduce_gradients(Bucket& bucket, bool sync) {
  TraceRange range("reduce_gradients " + name);
  NoGradGuard no_grad;
  CollectiveTag scope(bucket.tag);
  bucket.arrived = 0;
  bucket.reduced = true;
  const DType dtype = ctx_.reduce_dtype;
  ProcessGroup& group = ctx_.group;
  InFlight job;
  if (ctx_.placement.all_reduces_gradients()) {
    if (!sync) return job;
    const Tensor grads = grad_full.narrow(0, bucket.begin, bucket.end - bucket.begin);
    const Tensor buffer = in_reduce_dtype(grads, dtype);
    job.work = group.all_reduce_async(buffer, ReduceKind::average);
    if (!buffer.is_same(grads)) job.then = [buffer, grads] {
      cast_into(buffer, grads);
      return InFlight{};
    };
  } else if (ctx_.placement.sums_into_full_gradient()) {
    if (!sync) return job;
    // Summed, not averaged: slice r keeps the sum of every rank's gradients so far, and
    // the others are zeroed once reduced, so the next synced micro-batch's reduction adds
    // only what came since. (An in-place average would average slice r's earlier average.)
    const Tensor buffer = in_reduce_dtype(grad_full, dtype);
    const Tensor slice = ctx_.placement.offloads_optimizer() ? grad_full.narrow(0, group.rank() * shard, shard) : grad_shard;
    const Tensor mine = buffer.is_same(grad_full)
                            ? slice
                            : allocate(shard, dtype, buffer.device(), MemoryCategory::communication, false);
    job.work = group.reduce_scatter_async(buffer, mine, ReduceKind::sum);
    job.then = [mine, slice, full = grad_full, to = grad_shard, r = group.rank(), s = shard] {
      if (!mine.is_same(slice)) cast_into(mine, slice);
      if (!slice.is_same(to)) cast_into(slice, to);  // offload: the running sum, down to the host
      backend(full.device()).fill(full.narrow(0, 0, r * s), 0.0);
      backend(full.device()).fill(full.narrow(0, (r + 1) * s, full.numel() - (r + 1) * s), 0.0);
      return InFlight{};
    };
  } else {
    // A unit none of whose parameters got a gradient here still takes part, with zeros:
    // on other ranks they may have.
    ensure_full_gradient();
    // Freed here as far as this rank's code goes: a host group's queued collective holds
    // the buffer until it has run; on NCCL, record_stream keeps the allocator from reusing
    // the block until the reduce-scatter is done.
    const Tensor buffer = in_reduce_dtype(grad_full, dtype);
    for (const ParamSlot& slot : entries) Repoint::point_grad(slot.param, Tensor());
    grad_full = Tensor();
    const Tensor mine = allocate(shard, dtype, buffer.device(), MemoryCategory::communication, false);
    job.work = group.reduce_scatter_async(buffer, mine, ReduceKind::average);
    const auto accumulate = [mine, to = grad_shard] {  // across micro-batches: grad_shard += mine
      backend(to.device()).binary(BinaryOp::add, to, moved(mine, to.device(), to.dtype()), to);
      return InFlight{};
    };
    job.then = accumulate;
    // Hybrid sharding: the group's average, averaged across the groups holding the same shard.
    if (ctx_.replicas != nullptr)
      job.then = [mine, accumulate, replicas = ctx_.replicas, tag = bucket.tag] {
        CollectiveTag scope(tag);
        return InFlight{replicas->all_reduce_async(mine, ReduceKind::average), accumulate};
      };
  }
  return job;
}

void Unit::zero_grad() {
  if (ctx_.placement.frees_full_gradients()) {
    grad_shard.zero_();
    for (const ParamSlot& slot : entries) Repoint::point_grad(slot.param, Tensor());
    grad_full = Tensor();  // a backward that never completed
  } else {
    grad_full.zero_();
    if (ctx_.placement.offloads_optimizer()) grad_shard.zero_();  // its own buffer, on the host
  }
  for (Bucket& bucket : buckets) {
    bucket.arrived = 0;
    bucket.reduced = false;
  }
}

std::vector<optim::AdamWSpan> Unit::optimizer_spans() {
  const bool sharded = ctx_.placement.optimizer_sharded();
  const int64_t base = sharded ? ctx_.group.rank() * shard : 0;
  const Tensor& grad = sharded ? grad_shard : grad_full;
  const Tensor compute = compute_for_update();
  std::vector<optim::AdamWSpan> spans;
  // Each update range, cut to this rank's part.
  for (const UpdateRange& range : update_ranges) {
    const int64_t begin = std::max(range.begin, base), end = std::min(range.end, base + master.numel());
    if (end <= begin) continue;
    auto part = [&](const Tensor& t) { return t.narrow(0, begin - base, end - begin); };
    spans.push_back({part(master), part(grad), part(m), part(v), compute.defined() ? part(compute) : Tensor(),
                     range.decay, range.lr_scale, range.weight_decay});
  }
  return spans;
}

Tensor Unit::compute_for_update() {
  const Tensor& mine = updated_weights();
  if (mine.is_same(master)) return {};  // the master is the compute weights
  if (mine.device() == master.device()) return mine;
  // Ordinary host memory: page-locking a fresh buffer every step (cudaHostAlloc) costs more than it saves.
  compute_staging = allocate(master.numel(), ctx_.compute_dtype, master.device(), MemoryCategory::communication, false);
  return compute_staging;
}

WorkHandle Unit::after_step() {
  TraceRange range("after_step " + name);
  if (compute_staging.defined()) {  // offload: the updated compute weights up to the device
    const Tensor& mine = updated_weights();
    cast_into(std::exchange(compute_staging, Tensor()), mine);
    mine.storage()->bump_version();
  }
  if (!ctx_.placement.gathers_after_step()) return nullptr;
  CollectiveTag scope(tag);
  return ctx_.group.all_gather_async(weights.shard, weights.full);
}

void Unit::refresh_compute() {
  NoGradGuard no_grad;
  if (!updated_weights().is_same(master)) Tensor(updated_weights()).copy_(master);
  if (!ctx_.placement.optimizer_sharded()) return;
  CollectiveTag scope(tag);
  if (!ctx_.placement.gathers_parameters()) ctx_.group.all_gather(weights.shard, weights.full);
}

}  // namespace zg::dist
