// Two steps whose updates run beside the backward on a host thread (UpdateWorker).
//
// step_in_backward: each
// unit's AdamW is queued on a host thread as the gradient reducer finishes the unit's
// reduction, so the CPU updates unit k while the device (or, on a CPU run, this thread)
// computes the backward of the units before it. What the update reads -- the gradient
// shard, master, m, v -- no later part of the backward touches, and what it writes is read
// again only by the next forward, after step() has waited for the thread.
//
// The delayed parameter update (ZeRO-Offload's DPU, ZeroConfig::delayed_update_after):
// step() snapshots the gradient shards, queues the whole update and returns; the next
// forward and backward run on the weights as they were, and the next step() lands the
// update (the 16-bit weights copied up, gathered at ZeRO-1, 2) before it queues its own.
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "autograd/functions.h"
#include "dist/comm/agreement.h"
#include "dist/zero/buffers.h"
#include "dist/zero/gradient_reducer.h"
#include "dist/zero/sharded_model.h"
#include "dist/zero/unit.h"
#include "dist/zero/update_worker.h"
#include "tensor/trace.h"

namespace zg::dist {

void ShardedModel::step_in_backward(double lr) {
  const char* who = "ShardedModel::step_in_backward";
  ZG_CHECK(!early_, who, ": already set for this backward; call step() after it");
  ZG_CHECK(std::isfinite(lr) && lr >= 0, who, ": lr must be >= 0 and finite, got ", lr);
  ZG_CHECK(config_.max_grad_norm == 0, who, ": clipping (max_grad_norm ", config_.max_grad_norm,
           ") needs the global gradient norm before any unit's update; set ZeroConfig::max_grad_norm to 0, or call "
           "step() after the backward");
  ZG_CHECK(placement().optimizer_sharded(), who, ": DDP (stage 0) reduces in buckets that cut across units; use "
           "stage 1, 2 or 3");
  ZG_CHECK(!pp_, who, ": a pipeline's step sums its tied ends' gradients first; call step() after the schedule");
  ZG_CHECK(!placement().pages_to_file(), who, ": offload nvme pages the state in a unit at a time on this "
           "thread; call step() after the backward");
  ZG_CHECK(config_.delayed_update_after < 0, who, ": the delayed parameter update already runs the update beside "
           "the next step's backward");
  ZG_CHECK(reducer_->sync(), who, ": gradient sync is off, so this backward reduces nothing; arm it before the "
           "last micro-batch's backward, with sync on");
  const bool written = compute_written_by_others();
  Agreement agree(*group_, agreement_device(*group_, context_->device),
                  {{"lr", lr}, {"count of written parameters (1: one was written in place since the last step)",
                                written}});
  agree.check("ShardedModel::step_in_backward was given");
  ZG_CHECK(!written, who, ": a parameter was written in place since the last step; the update would overwrite it "
           "from the master weights. Change weights through a checkpoint");
  early_ = std::make_shared<UpdateWorker>(Context::current());
  early_lr_ = lr;
  early_updates_ = 0;
  reducer_->set_on_reduced([this](Unit& unit) { update_early(unit); });
}

// On this thread, as the unit's reduction ends: its spans (a staging buffer for the 16-bit
// weights allocated here), then the AdamW queued.
void ShardedModel::update_early(Unit& unit) {
  std::vector<optim::AdamWSpan> spans = unit.optimizer_spans();
  ++early_updates_;
  early_->submit([this, spans = std::move(spans), name = unit.name(), step = step_ + 1,
                  scale = gradient_multiplier(nullptr)] {
    TraceRange range("adamw " + name);
    optim::adamw_update(spans, config_.adamw, early_lr_, step, scale, {});
  });
}

void ShardedModel::update_delayed(double lr, double grad_scale, const Tensor& device_scale) {
  ZG_CHECK(!device_scale.defined(), "ShardedModel: step_on_device with the delayed parameter update: its clipping "
           "coefficient stays on the device, which the host's delayed update does not wait for; use step()");
  land_delayed_update();
  if (!delayed_worker_) delayed_worker_ = std::make_shared<UpdateWorker>(Context::current());
  std::vector<optim::AdamWSpan> spans;
  for (auto& unit : units_)
    for (optim::AdamWSpan& span : unit->optimizer_spans()) {
      // The next backward writes the gradient shard while this update reads it: a copy.
      const Tensor held = allocate(span.grad.numel(), span.grad.dtype(), span.grad.device(), MemoryCategory::gradient,
                                   false, true);
      cast_into(span.grad, held);
      span.grad = held;
      spans.push_back(std::move(span));
    }
  delayed_worker_->submit([this, spans = std::move(spans), lr, step = step_ + 1, grad_scale] {
    TraceRange range("adamw (delayed)");
    optim::adamw_update(spans, config_.adamw, lr, step, grad_scale, {});
  });
  delayed_pending_ = true;
  ++step_;
  gradients_used_ = gradient_mark();
}

void ShardedModel::land_delayed_update() {
  if (!delayed_pending_) return;
  delayed_pending_ = false;
  delayed_worker_->drain();
  std::vector<WorkHandle> gathers;
  for (auto& unit : units_)
    if (WorkHandle work = unit->after_step()) gathers.push_back(std::move(work));
  for (const WorkHandle& work : gathers) work->wait();
  mark_compute_current();
}

StepResult ShardedModel::finish_early_step(double lr, const optim::GradScaler* scaler) {
  const std::shared_ptr<UpdateWorker> worker = std::exchange(early_, nullptr);  // (joined at the end of scope)
  reducer_->set_on_reduced(nullptr);
  reducer_->reduce_the_rest();  // of a backward that threw before its end
  reducer_->finish();
  worker->drain();
  ZG_CHECK(scaler == nullptr, "ShardedModel: step() after step_in_backward took a loss scaler; the updates ran "
           "unscaled without its overflow check. Leave the scaler out of step_in_backward's steps");
  ZG_CHECK(lr == early_lr_, "ShardedModel: step(", lr, ") after step_in_backward(", early_lr_,
           "): the updates ran with the latter");
  ZG_CHECK(early_updates_ == units_.size(), "ShardedModel: step() after step_in_backward: ", early_updates_, " of ",
           units_.size(), " units were updated (no backward since step_in_backward?)",
           early_updates_ == 0 ? "" : "; the model is part-way through a step: load a checkpoint");
  // The norm it reports, from the gradient shards the updates read.
  const StepResult result{std::sqrt(global_squared_norm().item<double>()) * gradient_multiplier(nullptr), true};
  ++step_;
  gradients_used_ = gradient_mark();
  std::vector<WorkHandle> gathers;
  for (auto& unit : units_)
    if (WorkHandle work = unit->after_step()) gathers.push_back(std::move(work));
  for (const WorkHandle& work : gathers) work->wait();
  mark_compute_current();
  return result;
}

}  // namespace zg::dist
