// One training step of a ShardedModel, top to bottom: zero_grad, then (after the user's
// forward and backward, whose reductions the gradient reducer started) step(): finish
// the reductions, sum a pipeline's tied gradients between its ends, agree on what every
// rank must agree on, the global gradient norm across ranks (and stages), the loss scaler's skip, clipping, AdamW on each unit's spans of this
// rank's slice, and (ZeRO-1, 2) the all-gather of the updated slices.
#include <algorithm>
#include <cmath>
#include <optional>

#include "autograd/functions.h"
#include "dist/comm/agreement.h"
#include "dist/zero/gather_scheduler.h"
#include "dist/zero/gradient_reducer.h"
#include "dist/zero/paged_state.h"
#include "dist/zero/sharded_model.h"
#include "dist/zero/unit.h"
#include "optim/schedule.h"
#include "tensor/trace.h"

namespace zg::dist {

void ShardedModel::zero_grad() {
  NoGradGuard no_grad;
  reducer_->zero_grad();
  for (auto& unit : units_) unit->zero_grad();
  gradients_used_ = gradient_mark();
}

uint64_t ShardedModel::gradient_mark() const {
  uint64_t mark = static_cast<uint64_t>(reducer_->backwards());
  for (const auto& unit : units_) mark += unit->full_gradient_version();
  return mark;
}

// What every step does before the update: finish the backward's reductions, check what
// every rank must agree on, and sum the global squared gradient norm (f64, not read back).
Tensor ShardedModel::begin_step(double lr, const optim::GradScaler* scaler) {
  // Refused here, before the collectives, not by the update after them.
  ZG_CHECK(std::isfinite(lr) && lr >= 0, "ShardedModel: step lr must be >= 0 and finite, got ", lr);
  reducer_->reduce_the_rest();  // of a backward that threw before its end
  ZG_CHECK(!reducer_->unsynced(), "ShardedModel: step() after a backward with gradient sync off: its gradients were "
           "never reduced across ranks; turn sync on (set_gradient_sync(true)) for the last micro-batch");
  reducer_->finish();
  sum_tied_gradients();
  // Every rank must pass the same lr and loss scale (a rank-dependent schedule would make
  // the replicas drift apart unnoticed), agreed while the norm is computed.
  const bool written = compute_written_by_others();
  const bool no_gradients = gradient_mark() == gradients_used_;
  std::string unfrozen;  // a parameter frozen at construction that requires grad now
  for (const auto& [name, p] : frozen_)
    if (p.requires_grad()) unfrozen = name;
  for (const auto& unit : units_)
    for (const auto& e : unit->frozen_entries())
      if (e.param.requires_grad()) unfrozen = e.name;
  Agreement agree(*group_, agreement_device(*group_, context_->device),
                  {{"lr", lr},
                   {"loss scale", scaler ? scaler->scale_factor() : 1.0},
                   {"count of written parameters (1: one was written in place since the last step)", written},
                   {"count of unfrozen parameters (1: one frozen at construction requires grad now)",
                    !unfrozen.empty()},
                   {"count of missing backwards (1: no gradient since the last step or zero_grad())", no_gradients}});
  std::optional<Agreement> stages;  // and every pipeline stage
  if (pp_)
    stages.emplace(**pp_, agreement_device(**pp_, context_->device),
                   std::vector<AgreedValue>{{"lr", lr}, {"loss scale", scaler ? scaler->scale_factor() : 1.0}});
  const Tensor norm_sq = global_squared_norm();
  agree.check("ShardedModel: step() was given");
  if (stages) stages->check("ShardedModel: step() was given, across the pipeline's stages,");
  ZG_CHECK(unfrozen.empty(), "ShardedModel: step(): parameter '", unfrozen, "' was frozen when the "
           "ShardedModel was built and requires grad now; it has no place in the units, so its gradient would be neither "
           "reduced nor applied. Build the ShardedModel after unfreezing it");
  ZG_CHECK(!written, "ShardedModel: step(): ",
           placement().gathers_parameters()
               ? std::string("the full weights of summon_full_params() were written (an in-place write "
                             "to a parameter: fill_, copy_, an init); they are copies of the shards, "
                             "released at the scope's end, so that write is lost")
               : "the " + std::string(name(config_.compute_dtype)) +
                     " compute weights were written since the last step (an in-place write to a "
                     "parameter: fill_, copy_, an init), and the step rewrites them from the " +
                     name(optim::master_dtype_for(config_.compute_dtype)) +
                     " master weights, so that write would be lost",
           ". Change weights through a checkpoint (save / load, or nn::save_state before wrapping)");
  ZG_CHECK(!no_gradients, "ShardedModel: step(): no gradient was computed since the last ",
           step_ > 0 ? "step or zero_grad()" : "zero_grad() (or construction)",
           ", so the step would apply only weight decay and momentum; call backward() on a loss before step()");
  return norm_sq;
}

// Each end adds the other's gradient of each tied unit, as the optimizer reads it (the shard,
// or DDP's whole gradient) -- the same slice on both, the unit laid out alike -- so both
// copies take the same step. Tagged -1, -2, ...
void ShardedModel::sum_tied_gradients() {
  if (tied_units_.empty()) return;
  ProcessGroup& pp = **pp_;
  const int other = pp.rank() == 0 ? pp.size() - 1 : 0;
  std::vector<P2POp> ops;
  std::vector<Tensor> theirs;
  for (size_t i = 0; i < tied_units_.size(); ++i) {
    const Tensor& mine = units_[tied_units_[i]]->optimizer_gradient();
    {
      MemoryScope scope(MemoryCategory::communication);
      theirs.push_back(empty(mine.shape(), TensorOptions(mine.dtype()).device(mine.device())));
    }
    const int64_t tag = -1 - static_cast<int64_t>(i);
    ops.push_back({P2POp::send, mine, other, tag});
    ops.push_back({P2POp::recv, theirs.back(), other, tag});
  }
  pp.batch_async(ops)->wait();
  NoGradGuard no_grad;
  for (size_t i = 0; i < tied_units_.size(); ++i) Tensor(units_[tied_units_[i]]->optimizer_gradient()).add_(theirs[i]);
}

// The global squared norm: each rank's share, summed on its device, then across ranks.
// The meta device has no values: a dry run counts bytes only (and pages, for the step log's disk).
Tensor ShardedModel::global_squared_norm() {
  const Device device = units_.front()->grad_shard().device();
  const bool dry_run = device.type == DeviceType::meta;
  Tensor norm_sq = zeros({1}, TensorOptions(DType::f64).device(dry_run ? kCPU : device));
  visit_paged(units(), Unit::StateUse::gradient, false, [&](size_t u) {  // (offload nvme: a unit at a time)
    if (!dry_run && (!pp_ || (*pp_)->rank() == 0 || std::ranges::find(tied_units_, u) == tied_units_.end()))
      norm_sq = norm_sq + squared_norm(u);  // (ties: once)
  });
  norm_sq = norm_sq.to(agreement_device(*group_, context_->device));  // offloaded: summed on the host, reduced where the group is
  shard_group().all_reduce(norm_sq, ReduceKind::sum);  // (hybrid: the other shard groups hold the same shards)
  if (tp_) (*tp_)->all_reduce(norm_sq, ReduceKind::sum);  // the other slices of the cut parameters
  if (pp_) (*pp_)->all_reduce(norm_sq, ReduceKind::sum);  // the other stages
  return norm_sq;
}

// sum(g^2) over this rank's gradient shard; with tensor parallelism, run by run, a
// parameter every tp rank holds weighted 1 / T so the sum over tp counts it once.
Tensor ShardedModel::squared_norm(size_t u) const {
  const Tensor& shard = units_[u]->grad_shard();
  if (!tp_) return sum_of_squares(shard).to(DType::f64);
  Tensor total = zeros({}, TensorOptions(DType::f64).device(shard.device()));
  for (const NormRun& run : norm_runs_[u])
    total = total + sum_of_squares(shard.narrow(0, run.begin, run.count)).to(DType::f64) * run.weight;
  return total;
}

// What the gradients are multiplied by before use: 1 / loss scale, and for a reduction
// that summed (ZeRO-1) the 1 / N it left to the step -- folded into the norm and the
// update, so no pass over the gradients takes the average.
double ShardedModel::gradient_multiplier(const optim::GradScaler* scaler) const {
  return (scaler ? scaler->inv_scale() : 1.0) / (placement().sums_into_full_gradient() ? shard_group().size() : 1);
}

// AdamW on every span this rank updates, then (ZeRO-1, 2) every rank's new slices into
// everyone's full compute weights.
void ShardedModel::update(double lr, double grad_scale, const Tensor& device_scale) {
  for (auto& unit : units_) unit->finish_gathers();  // a prefetch a forward left in flight reads the shards
  if (config_.delayed_update_after >= 0 && step_ >= config_.delayed_update_after)
    return update_delayed(lr, grad_scale, device_scale);  // (early_step.cpp)
  std::vector<WorkHandle> gathers;
  if (placement().pages_to_file()) {  // ZeRO-Infinity: a unit at a time, as the file tier pages it in
    visit_paged(units(), Unit::StateUse::update, true, [&](size_t u) {
      optim::adamw_update(units_[u]->optimizer_spans(), config_.adamw, lr, step_ + 1, grad_scale, device_scale);
      if (WorkHandle work = units_[u]->after_step()) gathers.push_back(std::move(work));
    });
  } else {
    std::vector<optim::AdamWSpan> spans;
    for (auto& unit : units_)
      for (optim::AdamWSpan& span : unit->optimizer_spans()) spans.push_back(std::move(span));
    optim::adamw_update(spans, config_.adamw, lr, step_ + 1, grad_scale, device_scale);
    for (auto& unit : units_)
      if (WorkHandle work = unit->after_step()) gathers.push_back(std::move(work));
  }
  ++step_;
  gradients_used_ = gradient_mark();
  for (const WorkHandle& work : gathers) work->wait();
  mark_compute_current();
}

StepResult ShardedModel::step(double lr, optim::GradScaler* scaler) {
  TraceRange range("optimizer");  // clipping, the update and (ZeRO-1, 2) the gathers after it
  NoGradGuard no_grad;
  if (early_) return finish_early_step(lr, scaler);  // the updates ran during the backward
  const Tensor norm_sq = begin_step(lr, scaler);
  const double multiplier = gradient_multiplier(scaler);
  // The step's one host wait: the scaler and StepResult need the norm.
  StepResult result{std::sqrt(norm_sq.item<double>()) * multiplier, true};
  const bool finite = std::isfinite(result.grad_norm);
  result.stepped = scaler ? scaler->update(!finite) : finite;
  if (result.stepped) update(lr, multiplier * optim::clip_coefficient(result.grad_norm, config_.max_grad_norm), {});
  return result;
}

Tensor ShardedModel::step_on_device(double lr) {
  NoGradGuard no_grad;
  const Tensor norm_sq = begin_step(lr, nullptr);
  const double multiplier = gradient_multiplier(nullptr);
  const Device device = units_.front()->grad_shard().device();
  // In the master's dtype: f64 training clips by an f64 coefficient, as step() does.
  const Tensor norm = mul(sqrt(norm_sq.to(optim::master_dtype_for(config_.compute_dtype))), multiplier).view({1});
  const bool dry_run = device.type == DeviceType::meta;
  update(lr, multiplier, dry_run ? Tensor() : optim::clip_coefficient_on_device(norm, config_.max_grad_norm).to(device));
  return norm;
}

// With 16-bit compute, step() rewrites the compute weights from the master, so a write to
// a parameter since our last write (fill_, copy_, an init) would be lost: step() refuses it.
bool ShardedModel::compute_written_by_others() const {
  // Full compute weights: with separate compute and master weights (as in step()), a
  // write that was not ours. Gathered per use: any write to summoned weights, copies.
  const bool copies = placement().gathers_parameters();
  const bool summoned = gatherer_ && gatherer_->summoned();
  for (const auto& unit : units_)
    if ((copies ? summoned : config_.compute_dtype != unit->master().dtype()) && unit->compute_written_by_others())
      return true;
  return copies && written_while_summoned_;
}

void ShardedModel::mark_compute_current() {
  written_while_summoned_ = false;
  if (gatherer_) {
    gatherer_->after_step();
    return;
  }
  for (auto& unit : units_) unit->mark_compute_ours();
}

}  // namespace zg::dist
