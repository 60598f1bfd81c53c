// Gradient reduction: how each stage averages gradients across ranks, started
// from post-accumulate-grad hooks while the backward goes on.
//
//   stage 0 (DDP)  each bucket of the unit's full gradient is all-reduced in place
//   stage 1        the unit's full gradient is reduce-scattered (summed) into its
//                  slice r and the other slices are zeroed, so a later synced
//                  micro-batch adds only new gradients; step() divides by N once
//   stage 2, 3     the unit's full gradient (alive only during its backward) is
//                  reduce-scattered into a `communication` buffer, added into the
//                  persistent gradient shard, and freed
//
// Reductions are asynchronous (ProcessGroup::*_async): at most two are in flight,
// so a unit's collective overlaps the next unit's backward while at most two unit
// gradients wait; all have finished when the backward ends (end_of_backward).
#include "dist/zero/unit.h"

#include <algorithm>
#include <map>

#include "autograd/graph.h"
#include "tensor/backend.h"

namespace zg::dist {

namespace {

Tensor communication_buffer(int64_t numel, DType dtype, Device device) {
  MemoryScope scope(MemoryCategory::communication);
  return empty({numel}, TensorOptions(dtype).device(device));
}

// dst = src rounded to dst's dtype, through the backend (grads are not autograd state).
void cast_into(const Tensor& src, const Tensor& dst) { backend(dst.device()).copy(src, dst); }

// The buffer a collective works on: `grad` itself, or a copy in the reduce dtype.
Tensor in_reduce_dtype(const Tensor& grad, DType dtype) {
  if (grad.dtype() == dtype) return grad;
  const Tensor wide = communication_buffer(grad.numel(), dtype, grad.device());
  cast_into(grad, wide);
  return wide;
}

}  // namespace

// Buckets cut at parameter boundaries, from the end of the buffer. A unit packs its
// matrices first and its 1-D parameters after (one contiguous weight-decay span), so
// arrival order follows buffer order only loosely: the last bucket holds every bias and
// norm of the unit and completes when the unit's first layer norm gets its gradient. A
// unit smaller than bucket_bytes (a GPT-2 124M block: 14 MB in bf16) is one bucket.
void ShardedModel::plan_buckets(Unit& unit) {
  const auto& entries = unit.entries;
  unit.bucket_of.assign(entries.size(), 0);
  if (entries.empty()) return;  // a stage-3 unit of frozen parameters only: nothing to reduce
  if (config_.stage > 0) {
    unit.buckets = {{0, unit.padded, entries.size(), 0}};
    return;
  }
  const int64_t cap = std::max<int64_t>(1, config_.bucket_bytes / element_size(reduce_dtype()));
  std::vector<Bucket> reversed;
  int64_t end = unit.padded;  // the last bucket carries the padding
  for (size_t i = entries.size(); i-- > 0;) {
    if (reversed.empty() || (reversed.back().end - entries[i].offset > cap && reversed.back().members > 0)) {
      if (!reversed.empty()) end = reversed.back().begin;
      reversed.push_back({end, end, 0, 0});
    }
    Bucket& bucket = reversed.back();
    bucket.begin = entries[i].offset;
    ++bucket.members;
  }
  unit.buckets.assign(reversed.rbegin(), reversed.rend());
  for (size_t b = 0; b < unit.buckets.size(); ++b)
    for (size_t i = 0; i < entries.size(); ++i)
      if (entries[i].offset >= unit.buckets[b].begin && entries[i].offset < unit.buckets[b].end) unit.bucket_of[i] = b;
}

// The order every rank reduces its buckets in. Ranks must issue their collectives in
// one order, but buckets can fill in different orders on different ranks: a parameter
// that only some ranks' forward used fills its bucket there during the backward, and
// elsewhere never. So, as in PyTorch DDP, a full bucket waits for the buckets before it
// in a fixed order, and the backward's end reduces every bucket still waiting, in that
// order -- with zeros for gradients that never came, and with what earlier micro-batches
// accumulated (a bucket filled only while sync was off is still reduced when it is on).
//   The order is the expected filling order. Gradients arrive roughly in reverse
// registration order, and a bucket fills when the first-registered of its parameters
// lands, so buckets go by that parameter's position, latest first: for a GPT the last
// block's first, the root unit's (which holds the embeddings) last. A model whose
// backward runs otherwise is reduced in the same order, with less overlap.
void ShardedModel::plan_reduce_order(const nn::NamedTensors& parameters) {
  std::map<const TensorImpl*, size_t> position;
  for (size_t i = 0; i < parameters.size(); ++i) position.emplace(&parameters[i].second.impl(), i);
  std::vector<std::pair<size_t, std::pair<Unit*, Bucket*>>> by_first;
  for (auto& unit : units_)
    for (size_t b = 0; b < unit->buckets.size(); ++b) {
      size_t first = parameters.size();
      for (size_t i = 0; i < unit->entries.size(); ++i)
        if (unit->bucket_of[i] == b) first = std::min(first, position.at(&unit->entries[i].param.impl()));
      by_first.push_back({first, {unit.get(), &unit->buckets[b]}});
    }
  std::sort(by_first.begin(), by_first.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  reduce_order_.clear();
  for (const auto& [first, bucket] : by_first) reduce_order_.push_back(bucket);
}

// The first gradient (or, at ZeRO-3, the first unit's backward done) of a backward pass
// queues the pass's end. The token lives in the queued callback: expired once it ran, or
// was dropped by a pass that threw.
void ShardedModel::note_backward() {
  if (end_of_backward_queued_.expired()) {
    const auto token = std::make_shared<char>();
    end_of_backward_queued_ = token;
    queue_backward_callback([this, token, alive = alive()] {
      if (!alive.expired()) end_of_backward();
    });
  }
  in_backward_ = true;
}

// Stages 0-2: a bucket is reduced once all its gradients have landed and every bucket
// before it in the fixed order has been. (ZeRO-3 waits for the unit's backward to end,
// reduce_after_backward: its gathers go on during the backward, and a reduction must
// come at the same place among them on every rank.)
void ShardedModel::on_grad_arrival(Unit& unit, size_t entry) {
  note_backward();
  if (config_.stage == 3) return;
  ++unit.buckets[unit.bucket_of[entry]].arrived;
  while (reduced_ < reduce_order_.size()) {
    const auto [next_unit, next] = reduce_order_[reduced_];
    if (next->arrived < next->members) return;  // it, and the ones after it, wait
    ++reduced_;
    reduce_bucket(*next_unit, *next);
  }
}

// ZeRO-3, when the backward of the unit's first use is done (its input's gradient has
// arrived): every gradient the unit gets on this rank has landed, and one that never
// came is a zero -- a parameter that only some ranks' forward used. Units whose first
// use has no input gradient (a root unit's embeddings) are reduced at the backward's end.
void ShardedModel::reduce_after_backward(Unit& unit) {
  note_backward();
  for (Bucket& bucket : unit.buckets)
    if (!bucket.reduced) reduce_bucket(unit, bucket);
}

// After the backward's last node: every bucket not reduced yet is, in the fixed order.
// Then every reduction finishes, and ZeRO-3 frees every unit still gathered (one
// prefetched in backward for a use whose backward had already run would stay whole,
// and stale).
void ShardedModel::end_of_backward() {
  reduce_the_rest();
  finish_reductions();
  if (config_.stage == 3)
    for (auto& unit : units_) release_unit(*unit);
}

void ShardedModel::reduce_the_rest() {
  if (!in_backward_) return;
  for (const auto& [unit, bucket] : reduce_order_) {
    if (!bucket->reduced) reduce_bucket(*unit, *bucket);
    bucket->reduced = false;  // for the next backward
  }
  reduced_ = 0;
  in_backward_ = false;
}

void ShardedModel::reduce_bucket(Unit& unit, Bucket& bucket) {
  NoGradGuard no_grad;
  CollectiveTag tag(bucket.tag);
  bucket.arrived = 0;
  bucket.reduced = true;
  const DType dtype = reduce_dtype();
  const int64_t shard = unit.shard;
  InFlight job;
  switch (config_.stage) {
    case 0: {
      unsynced_ = !sync_;
      if (!sync_) return;
      const Tensor grads = unit.grad_full.narrow(0, bucket.begin, bucket.end - bucket.begin);
      const Tensor buffer = in_reduce_dtype(grads, dtype);
      job.work = group_.all_reduce_async(buffer, ReduceKind::average);
      if (!buffer.is_same(grads)) job.then = [buffer, grads] { cast_into(buffer, grads); };
      break;
    }
    case 1: {
      unsynced_ = !sync_;
      if (!sync_) return;
      // Summed, not averaged: slice r keeps the sum of every rank's gradients so far, and
      // the others are zeroed once reduced, so the next synced micro-batch's reduction
      // adds only what came since. (An in-place average would average slice r's earlier
      // average again.) step() divides by N.
      const Tensor buffer = in_reduce_dtype(unit.grad_full, dtype);
      const Tensor mine = buffer.is_same(unit.grad_full) ? unit.grad_shard : communication_buffer(shard, dtype, buffer.device());
      job.work = group_.reduce_scatter_async(buffer, mine, ReduceKind::sum);
      job.then = [mine, full = unit.grad_full, to = unit.grad_shard, r = group_.rank(), shard] {
        if (!mine.is_same(to)) cast_into(mine, to);
        backend(full.device()).fill(full.narrow(0, 0, r * shard), 0.0);
        backend(full.device()).fill(full.narrow(0, (r + 1) * shard, full.numel() - (r + 1) * shard), 0.0);
      };
      break;
    }
    default: {
      // A unit none of whose parameters got a gradient here still takes part, with zeros:
      // on other ranks they may have.
      if (!unit.grad_full.defined()) allocate_grad_full(unit);
      // Freed here as far as this rank's code goes: a host group's queued collective holds
      // the buffer until it has run; on NCCL, record_stream keeps the allocator from
      // reusing the block until the reduce-scatter is done.
      const Tensor buffer = in_reduce_dtype(unit.grad_full, dtype);
      for (const auto& e : unit.entries) point_grad(e.param, Tensor());
      unit.grad_full = Tensor();
      const Tensor mine = communication_buffer(shard, dtype, buffer.device());
      job.work = group_.reduce_scatter_async(buffer, mine, ReduceKind::average);
      // Accumulates across micro-batches: grad_shard += mine.
      job.then = [mine, to = unit.grad_shard] {
        backend(to.device()).binary(BinaryOp::add, to, mine.dtype() == to.dtype() ? mine : mine.to(to.dtype()), to);
      };
      if (config_.stage == 3) release_unit(unit);
    }
  }
  in_flight_.push_back(std::move(job));
  finish_reductions(2);
}

// Waits for the oldest reductions until at most `keep_in_flight` remain.
void ShardedModel::finish_reductions(size_t keep_in_flight) {
  NoGradGuard no_grad;
  while (in_flight_.size() > keep_in_flight) {
    InFlight job = std::move(in_flight_.front());
    in_flight_.pop_front();
    job.work->wait();
    if (job.then) job.then();
  }
}

}  // namespace zg::dist
