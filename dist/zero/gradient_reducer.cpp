#include "dist/zero/gradient_reducer.h"

#include <algorithm>
#include <map>

#include "autograd/graph.h"

namespace zg::dist {

// DDP's buckets, cut at parameter boundaries from the end of the buffer. A unit packs its
// matrices first and its 1-D parameters after (one contiguous weight-decay span), so
// arrival order follows buffer order only loosely: the last bucket holds every bias and
// norm of the unit and completes when the unit's first layer norm gets its gradient. A
// unit smaller than the cap (a 124M-parameter transformer's block: 14 MB in bf16) is one
// bucket. The ZeRO stages reduce a unit whole, tagged as the unit; DDP's buckets take tags
// of their own after the units' (two buckets of one size would pair silently between
// ranks that reduce them in different orders).
void GradientReducer::plan_buckets(Unit& unit, int64_t cap, int64_t& next_tag) {
  const std::vector<ParamSlot>& entries = unit.entries();
  std::vector<Bucket> reversed;
  if (!placement_.all_reduces_gradients()) {
    reversed.push_back({&unit, 0, unit.padded(), entries.size(), 0, false, unit.tag()});
  } else {
    int64_t end = unit.padded();  // the last bucket carries the padding
    for (size_t i = entries.size(); i-- > 0;) {
      if (reversed.empty() || (reversed.back().end - entries[i].offset > cap && reversed.back().members > 0)) {
        if (!reversed.empty()) end = reversed.back().begin;
        reversed.push_back({&unit, end, end, 0, 0, false, 0});
      }
      reversed.back().begin = entries[i].offset;
      ++reversed.back().members;
    }
  }
  std::vector<size_t>& bucket_of = bucket_of_.emplace_back(entries.size(), 0);
  for (auto b = reversed.rbegin(); b != reversed.rend(); ++b) {
    if (placement_.all_reduces_gradients()) b->tag = next_tag++;
    for (size_t i = 0; i < entries.size(); ++i)
      if (entries[i].offset >= b->begin && entries[i].offset < b->end) bucket_of[i] = buckets_.size();
    buckets_.push_back(*b);
  }
}

GradientReducer::GradientReducer(const Placement& placement, std::vector<Unit*> units,
                                 const nn::NamedTensors& parameters, int64_t bucket_bytes, DType reduce_dtype)
    : placement_(placement), units_(std::move(units)) {
  int64_t next_tag = static_cast<int64_t>(units_.size()) + 1;
  const int64_t cap = std::max<int64_t>(1, bucket_bytes / element_size(reduce_dtype));
  for (Unit* unit : units_) {
    if (unit->entries().empty()) {  // a ZeRO-3 unit of frozen parameters only: nothing to reduce
      bucket_of_.emplace_back();
      continue;
    }
    plan_buckets(*unit, cap, next_tag);
  }
  // The order is the expected filling order. Gradients arrive roughly in reverse
  // registration order, and a bucket fills when the first-registered of its parameters
  // lands, so buckets go by that parameter's position, latest first: for a transformer the last
  // block's first, the root unit's (which holds the embeddings) last. A model whose
  // backward runs otherwise is reduced in the same order, with less overlap.
  std::map<const TensorImpl*, size_t> position;
  for (size_t i = 0; i < parameters.size(); ++i) position.emplace(&parameters[i].second.impl(), i);
  std::vector<size_t> first(buckets_.size(), parameters.size());
  for (size_t u = 0; u < units_.size(); ++u)
    for (size_t i = 0; i < bucket_of_[u].size(); ++i) {
      size_t& f = first[bucket_of_[u][i]];
      f = std::min(f, position.at(&units_[u]->entries()[i].param.impl()));
    }
  for (size_t b = 0; b < buckets_.size(); ++b) order_.push_back(b);
  std::stable_sort(order_.begin(), order_.end(), [&](size_t x, size_t y) { return first[x] > first[y]; });
}

std::vector<int64_t> GradientReducer::order_tags() const {
  std::vector<int64_t> tags;
  for (size_t b : order_) tags.push_back(buckets_[b].tag);
  return tags;
}

void GradientReducer::hook(std::weak_ptr<ParameterOwner> alive, std::function<void()> on_backward_end) {
  alive_ = alive;
  on_backward_end_ = std::move(on_backward_end);
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit* unit = units_[u];
    for (size_t i = 0; i < unit->entries().size(); ++i) {
      const size_t b = bucket_of_[u][i];
      const Tensor& param = unit->entries()[i].param;
      if (placement_.frees_full_gradients())
        param.register_hook([this, unit, i, b, alive](const Tensor&) {
          if (alive.expired()) return Tensor();
          // Its bucket's full gradient is gone (reduced and freed) in this backward: this one would be lost.
          ZG_CHECK(!buckets_[b].reduced, "ShardedModel: the gradient of '", unit->entries()[i].name,
                   "' arrived after the gradient of its unit '", unit->name(),
                   "' was reduced in this backward: a parameter's gradient must come from the uses of its unit "
                   "that the UnitPlan names, once per backward");
          unit->ensure_full_gradient();
          return Tensor();
        });
      param.register_post_accumulate_grad_hook([this, b, alive](const Tensor&) {
        if (!alive.expired()) on_grad_arrival(b);
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
    ++backwards_;
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
void GradientReducer::on_grad_arrival(size_t bucket) {
  note_backward();
  if (placement_.gathers_parameters()) return;
  ++buckets_[bucket].arrived;
  while (reduced_ < order_.size()) {
    Bucket& next = buckets_[order_[reduced_]];
    if (next.arrived < next.members) return;  // it, and the ones after it, wait
    ++reduced_;
    reduce(next);
  }
}

// ZeRO-3, when the backward of the unit's last use is done: every gradient the unit gets
// on this rank has landed, and one that never came is a zero.
void GradientReducer::reduce_unit(Unit& unit) {
  note_backward();
  for (Bucket& bucket : buckets_)
    if (bucket.unit == &unit && !bucket.reduced) reduce(bucket);
}

void GradientReducer::reduce_the_rest() {
  if (!in_backward_) return;
  for (size_t b : order_) {
    if (!buckets_[b].reduced) reduce(buckets_[b]);
    buckets_[b].reduced = false;  // for the next backward
  }
  reduced_ = 0;
  in_backward_ = false;
}

void GradientReducer::reduce(Bucket& bucket) {
  unsynced_ = !sync_;
  bucket.arrived = 0;
  bucket.reduced = true;
  InFlight job = bucket.unit->reduce_gradients(bucket.begin, bucket.end, bucket.tag, sync_);
  if (!job.work) return;
  job.unit = bucket.unit;
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
    InFlight next = job.then ? job.then() : InFlight{};
    if (next.work) {
      next.unit = job.unit;
      in_flight_.push_back(std::move(next));
    } else if (on_reduced_) {
      on_reduced_(*job.unit);
    }
  }
}

void GradientReducer::zero_grad() {
  finish();
  for (Bucket& bucket : buckets_) {
    bucket.arrived = 0;
    bucket.reduced = false;
  }
  reduced_ = 0;
  in_backward_ = false;
  unsynced_ = false;
}

}  // namespace zg::dist
