#include "dist/zero/gradient_reducer.h"

#include <algorithm>
#include <map>

#include "autograd/graph.h"

namespace zg::dist {

namespace {

// DDP's buckets, cut at parameter boundaries from the end of the buffer. A unit packs its
// matrices first and its 1-D parameters after (one contiguous weight-decay span), so
// arrival order follows buffer order only loosely: the last bucket holds every bias and
// norm of the unit and completes when the unit's first layer norm gets its gradient. A
// unit smaller than the cap (a 124M-parameter transformer's block: 14 MB in bf16) is one bucket.
std::vector<Bucket> ddp_buckets(const Unit& unit, int64_t cap) {
  std::vector<Bucket> reversed;
  int64_t end = unit.padded;  // the last bucket carries the padding
  for (size_t i = unit.entries.size(); i-- > 0;) {
    if (reversed.empty() || (reversed.back().end - unit.entries[i].offset > cap && reversed.back().members > 0)) {
      if (!reversed.empty()) end = reversed.back().begin;
      reversed.push_back({end, end, 0, 0});
    }
    reversed.back().begin = unit.entries[i].offset;
    ++reversed.back().members;
  }
  return {reversed.rbegin(), reversed.rend()};
}

}  // namespace

GradientReducer::GradientReducer(const Placement& placement, std::vector<Unit*> units,
                                 const nn::NamedTensors& parameters, int64_t bucket_bytes, DType reduce_dtype)
    : placement_(placement), units_(std::move(units)) {
  // Collective tags: a ZeRO unit's one bucket has its unit's; DDP's buckets numbers of their
  // own after the units' (two buckets of one size would pair silently between ranks that
  // reduce them in different orders).
  int64_t next_tag = static_cast<int64_t>(units_.size()) + 1;
  for (Unit* unit : units_) {
    unit->bucket_of.assign(unit->entries.size(), 0);
    if (unit->entries.empty()) continue;  // a ZeRO-3 unit of frozen parameters only: nothing to reduce
    if (placement_.all_reduces_gradients()) {
      unit->buckets = ddp_buckets(*unit, std::max<int64_t>(1, bucket_bytes / element_size(reduce_dtype)));
      for (Bucket& bucket : unit->buckets) bucket.tag = next_tag++;
    } else {
      unit->buckets = {{0, unit->padded, unit->entries.size(), 0, false, unit->tag}};
    }
    for (size_t b = 0; b < unit->buckets.size(); ++b)
      for (size_t i = 0; i < unit->entries.size(); ++i)
        if (unit->entries[i].offset >= unit->buckets[b].begin && unit->entries[i].offset < unit->buckets[b].end)
          unit->bucket_of[i] = b;
  }
  // The order is the expected filling order. Gradients arrive roughly in reverse
  // registration order, and a bucket fills when the first-registered of its parameters
  // lands, so buckets go by that parameter's position, latest first: for a transformer the last
  // block's first, the root unit's (which holds the embeddings) last. A model whose
  // backward runs otherwise is reduced in the same order, with less overlap.
  std::map<const TensorImpl*, size_t> position;
  for (size_t i = 0; i < parameters.size(); ++i) position.emplace(&parameters[i].second.impl(), i);
  std::vector<std::pair<size_t, std::pair<Unit*, Bucket*>>> by_first;
  for (Unit* unit : units_)
    for (size_t b = 0; b < unit->buckets.size(); ++b) {
      size_t first = parameters.size();
      for (size_t i = 0; i < unit->entries.size(); ++i)
        if (unit->bucket_of[i] == b) first = std::min(first, position.at(&unit->entries[i].param.impl()));
      by_first.push_back({first, {unit, &unit->buckets[b]}});
    }
  std::sort(by_first.begin(), by_first.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  for (const auto& [first, bucket] : by_first) order_.push_back(bucket);
}

std::vector<int64_t> GradientReducer::order_tags() const {
  std::vector<int64_t> tags;
  for (const auto& [unit, bucket] : order_) tags.push_back(bucket->tag);
  return tags;
}

void GradientReducer::hook(std::weak_ptr<ParameterOwner> alive, std::function<void()> on_backward_end) {
  alive_ = alive;
  on_backward_end_ = std::move(on_backward_end);
  for (Unit* u : units_) {
    for (size_t i = 0; i < u->entries.size(); ++i) {
      if (placement_.frees_full_gradients())
        u->entries[i].param.register_hook([u, i, alive](const Tensor&) {
          if (alive.expired()) return Tensor();
          // Its bucket's full gradient is gone (reduced and freed) in this backward: this one would be lost.
          ZG_CHECK(!u->buckets[u->bucket_of[i]].reduced, "ShardedModel: the gradient of '", u->entries[i].name,
                   "' arrived after the gradient of its unit '", u->name,
                   "' was reduced in this backward: a parameter's gradient must come from the uses of its unit "
                   "that the UnitPlan names, once per backward");
          u->ensure_full_gradient();
          return Tensor();
        });
      u->entries[i].param.register_post_accumulate_grad_hook([this, u, i, alive](const Tensor&) {
        if (!alive.expired()) on_grad_arrival(*u, i);
      });
    }
  }
}

// The first gradient (or, at ZeRO-3, the first unit's backward done) of a backward pass
// queues the pass's end. The token lives in the queued callback: expired once it ran, or
// was dropped by a pass that threw.
void GradientReducer::note_backward() {
  if (end_queued_.expired()) {
    const auto token = std::make_shared<char>();
    end_queued_ = token;
    queue_backward_callback([this, token, alive = alive_] {
      if (alive.expired()) return;
      reduce_the_rest();
      finish();
      if (on_backward_end_) on_backward_end_();
    });
  }
  in_backward_ = true;
}

// DDP, ZeRO-1, 2: a bucket is reduced once all its gradients have landed and every bucket
// before it in the fixed order has been. (ZeRO-3 waits for the unit's backward to end,
// reduce_unit: its gathers go on during the backward, and a reduction must come at the
// same place among them on every rank.)
void GradientReducer::on_grad_arrival(Unit& unit, size_t entry) {
  note_backward();
  if (placement_.gathers_parameters()) return;
  ++unit.buckets[unit.bucket_of[entry]].arrived;
  while (reduced_ < order_.size()) {
    const auto [next_unit, next] = order_[reduced_];
    if (next->arrived < next->members) return;  // it, and the ones after it, wait
    ++reduced_;
    reduce(*next_unit, *next);
  }
}

// ZeRO-3, when the backward of the unit's first use is done: every gradient the unit gets
// on this rank has landed, and one that never came is a zero.
void GradientReducer::reduce_unit(Unit& unit) {
  note_backward();
  for (Bucket& bucket : unit.buckets)
    if (!bucket.reduced) reduce(unit, bucket);
}

void GradientReducer::reduce_the_rest() {
  if (!in_backward_) return;
  for (const auto& [unit, bucket] : order_) {
    if (!bucket->reduced) reduce(*unit, *bucket);
    bucket->reduced = false;  // for the next backward
  }
  reduced_ = 0;
  in_backward_ = false;
}

void GradientReducer::reduce(Unit& unit, Bucket& bucket) {
  if (!placement_.frees_full_gradients()) unsynced_ = !sync_;
  InFlight job = unit.reduce_gradients(bucket, sync_ || placement_.frees_full_gradients());
  if (!job.work) return;
  in_flight_.push_back(std::move(job));
  finish(2);
}

// A reduction's next collective (hybrid sharding's all-reduce across shard groups) joins
// the back of the queue, overlapping what follows; it counts against `keep_in_flight`
// only from the next call, so one call waits for as many as were over the bound.
void GradientReducer::finish(size_t keep_in_flight) {
  NoGradGuard no_grad;
  size_t over = in_flight_.size() > keep_in_flight ? in_flight_.size() - keep_in_flight : 0;
  while (keep_in_flight == 0 ? !in_flight_.empty() : over-- > 0) {
    InFlight job = std::move(in_flight_.front());
    in_flight_.pop_front();
    job.work->wait();
    if (!job.then) continue;
    if (InFlight next = job.then(); next.work) in_flight_.push_back(std::move(next));
  }
}

void GradientReducer::zero_grad() {
  finish();
  reduced_ = 0;
  in_backward_ = false;
  unsynced_ = false;
}

}  // namespace zg::dist
