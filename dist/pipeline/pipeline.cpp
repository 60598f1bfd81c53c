#include "dist/pipeline/pipeline.h"

#include <algorithm>
#include <cmath>

#include "autograd/functions.h"
#include "autograd/graph.h"
#include "dist/comm/agreement.h"
#include "dist/zero/sharded_model.h"
#include "tensor/step_log.h"
#include "tensor/trace.h"

namespace zg::dist {

namespace {
constexpr int kMaxDims = 8;

// The owners' gradient sync as the caller left it, put back however the step ends; the
// step syncs only where the caller did.
class GradientSyncGuard {
 public:
  explicit GradientSyncGuard(const std::vector<ShardedModel*>& owners) {
    for (ShardedModel* owner : owners) wanted_.emplace_back(owner, owner->gradient_sync());
  }
  ~GradientSyncGuard() {
    for (auto [owner, sync] : wanted_) owner->set_gradient_sync(sync);
  }
  // Before a backward: on where the caller wants it, and once a step (the rank's last
  // backward) where the owner reduces once.
  void before_backward(bool last) const {
    for (auto [owner, sync] : wanted_) owner->set_gradient_sync(sync && (last || !owner->reduces_once()));
  }

 private:
  std::vector<std::pair<ShardedModel*, bool>> wanted_;
};
}  // namespace

Pipeline::Pipeline(ProcessGroup& pp, Schedule schedule, std::vector<std::shared_ptr<nn::Module>> chunks,
                   PipelineLoss loss, std::vector<Tensor> tied)
    : pp_(pp, "pipeline: its process group was destroyed; keep the group as long as the Pipeline"),
      schedule_(std::move(schedule)), chunks_(std::move(chunks)), loss_(std::move(loss)), tied_(std::move(tied)),
      device_(device_of(chunks_)) {
  ZG_CHECK(pp.size() == schedule_.ranks, "pipeline: the ", name(schedule_.kind), " schedule is for ", schedule_.ranks,
           " ranks, the group has ", pp.size());
  ZG_CHECK(static_cast<int>(chunks_.size()) == schedule_.chunks, "pipeline: the schedule runs ", schedule_.chunks,
           " chunk(s) a rank, rank ", pp.rank(), " was given ", chunks_.size(), " module(s)");
  // A malformed or deadlocking order is refused here, not met as a hang.
  plan_ = message_plan(schedule_)[static_cast<size_t>(pp.rank())];
  // Gradients are reduced once, in the rank's last backward (B or W), where the owner says so.
  for (size_t i = 0; i < plan_.size(); ++i)
    if (const auto* a = std::get_if<Action>(&plan_[i]); a && (a->kind == Action::backward || a->kind == Action::backward_weight))
      last_gradients_ = i;
  for (const auto& chunk : chunks_) ZG_CHECK(chunk != nullptr, "pipeline: a chunk of rank ", pp.rank(), " is null");
  ZG_CHECK(loss_ != nullptr, "pipeline: no loss function");
  // Ranks that run different schedules would wait for messages never sent: refused together.
  Agreement(pp, agreement_device(pp, device_), {{"schedule", schedule_.kind}, {"number of chunks", schedule_.chunks},
                                                 {"number of micro-batches", schedule_.micro_batches}})
      .check("pipeline:");
}

Device Pipeline::device_of(const std::vector<std::shared_ptr<nn::Module>>& chunks) {
  for (const auto& chunk : chunks)
    if (const std::vector<Tensor> p = chunk ? chunk->parameters() : std::vector<Tensor>(); !p.empty())
      return p.front().device();
  return kCPU;
}

Tensor Pipeline::take(const Message& m) {
  const auto it = mailbox_.find(m.tag(schedule_.stages()));
  ZG_CHECK(it != mailbox_.end(), "pipeline: rank ", pp_->rank(), " has not got ", m.str());
  Tensor t = it->second;
  mailbox_.erase(it);
  return t;
}

// Posts the exchange's messages as one batch and waits for it. Micro-batch 0's activation
// at a boundary brings a header (dtype, shape), received alone first; the others come in
// its shape, and a gradient in its activation's.
void Pipeline::exchange(const Exchange& e) {
  const int stages = schedule_.stages();
  std::vector<P2POp> ops;
  for (const Message& m : e.sends) {
    const Tensor t = take(m).contiguous();
    const int peer = schedule_.rank_of(m.to());
    if (m.carries_header() && !fixed_activation_) {
      ZG_CHECK(t.dim() <= kMaxDims, "pipeline: an activation of ", t.dim(), " dims, over the ", kMaxDims,
               " a header holds");
      std::vector<int64_t> header(2 + kMaxDims, 0);
      header[0] = static_cast<int64_t>(t.dtype()), header[1] = t.dim();
      for (int64_t d = 0; d < t.dim(); ++d) header[2 + d] = t.shape()[d];
      ops.push_back({P2POp::send, tensor(header).to(agreement_device(*pp_, device_)), peer, m.tag(stages)});  // (NCCL: its GPU)
      activations_[m.stage] = {t.shape(), t.dtype()};
    } else if (!m.gradient) {
      const auto& [shape, dtype] = activation_of(m);
      ZG_CHECK(t.shape() == shape && t.dtype() == dtype, "pipeline: stage ", m.stage, "'s output for micro-batch ",
               m.micro_batch, " is ", describe(t), ", ", fixed_activation_ ? "set_activation said " : "micro-batch 0's was ",
               name(dtype), shape_str(shape), "; every micro-batch must give a stage's output one shape and dtype");
    }
    ops.push_back({P2POp::send, t, peer, m.tag(stages)});
  }
  if (e.receive && e.receive->carries_header() && !fixed_activation_) {  // alone first: the shape to receive into
    const Message& m = *e.receive;
    const int peer = schedule_.rank_of(m.from());
    const Tensor header = zeros({2 + kMaxDims}, TensorOptions(DType::i64).device(agreement_device(*pp_, device_)));
    pp_->recv(header, peer, m.tag(stages));
    const std::vector<int64_t> h = header.to_vector<int64_t>();
    ZG_CHECK(h[1] >= 0 && h[1] <= kMaxDims, "pipeline: a header from rank ", peer, " gives ", h[1], " dims");
    activations_[m.stage] = {Shape(h.begin() + 2, h.begin() + 2 + h[1]), static_cast<DType>(h[0])};
  }
  if (e.receive) {  // an activation in micro-batch 0's shape; a gradient in its activation's
    const Message& m = *e.receive;
    const Tensor& like = m.gradient ? held_.at({schedule_.chunk_of(m.to()), m.micro_batch}).output : Tensor();
    const auto [shape, dtype] = m.gradient ? std::pair{like.shape(), like.dtype()} : activation_of(m);
    ops.push_back({P2POp::recv, empty(shape, TensorOptions(dtype).device(m.gradient ? like.device() : device_)),
                   schedule_.rank_of(m.from()), m.tag(stages)});
  }
  pp_->batch_async(ops)->wait();
  if (e.receive) mailbox_[e.receive->tag(stages)] = ops.back().buffer;
}

const std::pair<Shape, DType>& Pipeline::activation_of(const Message& m) const {
  if (fixed_activation_) return *fixed_activation_;
  const auto it = activations_.find(m.stage);
  ZG_CHECK(it != activations_.end(), "pipeline: rank ", pp_->rank(), " has ", m.str(), " before micro-batch 0's, "
           "which brings its shape; run each stage's micro-batch 0 first");
  return it->second;
}

void Pipeline::forward(const Action& a, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets) {
  const int stage = schedule_.stage(pp_->rank(), a.chunk), last = schedule_.stages() - 1;
  Held& held = held_[{a.chunk, a.micro_batch}];
  Tensor x = inputs.empty() ? Tensor() : inputs[a.micro_batch];
  if (stage > 0) {
    held.input = take({a.micro_batch, stage - 1, false}).detach();
    if (is_floating(held.input.dtype())) held.input.set_requires_grad();
    x = held.input;
  }
  const Tensor y = (*chunks_[a.chunk])(x);
  if (stage < last) {
    held.output = y;
    mailbox_[Message{a.micro_batch, stage, false}.tag(schedule_.stages())] = y.detach();
    return;
  }
  const Tensor loss = loss_(y, targets[a.micro_batch]);
  ZG_CHECK(loss.numel() == 1, "pipeline: the loss must be a scalar, got ", describe(loss));
  loss_sum_ += loss.device().type == DeviceType::meta ? NAN : loss.item<double>();  // a dry run has no values
  held.output = loss * (loss_scale_ / static_cast<double>(schedule_.micro_batches));
}

// B, or its first half I: from the loss or the output's gradient, received; the input's
// gradient sent back. I keeps the micro-batch's W for later.
void Pipeline::backward(const Action& a) {
  const int stage = schedule_.stage(pp_->rank(), a.chunk), last = schedule_.stages() - 1;
  const auto it = held_.find({a.chunk, a.micro_batch});
  if (a.kind == Action::backward_weight) {
    ZG_CHECK(it != held_.end() && it->second.weights, "pipeline: ", a.str(), " on rank ", pp_->rank(),
             " comes before its I");
    it->second.weights->run();
    held_.erase(it);
    return;
  }
  Held held = std::move(it->second);
  held_.erase(it);
  const Tensor grad = stage == last ? Tensor() : take({a.micro_batch, stage, true});
  if (a.kind == Action::backward) {
    held.output.backward(grad);
  } else {  // I: the input's gradient now, the weights' at W
    const bool has_input = held.input.defined() && held.input.requires_grad();
    held.weights = backward_input(held.output, grad, has_input ? std::vector<Tensor>{held.input} : std::vector<Tensor>{});
    held_.emplace(std::pair{a.chunk, a.micro_batch}, Held{held.input, Tensor(), std::move(held.weights)});
  }
  if (stage == 0) return;
  ZG_CHECK(held.input.grad().defined(), "pipeline: stage ", stage, "'s input got no gradient: its output does not "
           "depend on it");
  mailbox_[Message{a.micro_batch, stage - 1, true}.tag(schedule_.stages())] = held.input.grad();
}

// Tagged -1, -2, ...: apart from the step's messages, which are tagged from 0.
void Pipeline::sum_tied() {
  const int first = schedule_.rank_of(0), last = schedule_.rank_of(schedule_.stages() - 1), rank = pp_->rank();
  if (first == last || (rank != first && rank != last)) return;
  const int other = rank == first ? last : first;
  std::vector<P2POp> ops;
  std::vector<Tensor> theirs;
  for (size_t i = 0; i < tied_.size(); ++i) {
    const ParameterOwner* owner = ParameterOwner::of(tied_[i]);
    ZG_CHECK(owner == nullptr, "pipeline: tied parameter #", i, " lives in ", owner ? owner->describe() : "",
             ", which sums it between the stages itself (the stages' unit plans tie it); build the Pipeline without it");
    const Tensor grad = tied_[i].grad();
    ZG_CHECK(grad.defined(), "pipeline: tied parameter #", i, " ", describe(tied_[i]), " got no gradient on rank ", rank);
    theirs.push_back(empty(grad.shape(), TensorOptions(grad.dtype()).device(grad.device())));
    const int64_t tag = -1 - static_cast<int64_t>(i);
    ops.push_back({P2POp::send, grad, other, tag});
    ops.push_back({P2POp::recv, theirs.back(), other, tag});
  }
  if (ops.empty()) return;
  pp_->batch_async(ops)->wait();
  NoGradGuard no_grad;
  for (size_t i = 0; i < tied_.size(); ++i) tied_[i].grad().add_(theirs[i]);  // a + b == b + a: both ends alike
}

// The ShardedModels holding the chunks' parameters (none when they are plain modules).
std::vector<ShardedModel*> Pipeline::owners() const {
  std::vector<ShardedModel*> out;
  for (const auto& chunk : chunks_)
    for (const Tensor& p : chunk->parameters())
      if (auto* owner = dynamic_cast<ShardedModel*>(ParameterOwner::of(p)); owner && std::ranges::find(out, owner) == out.end())
        out.push_back(owner);
  return out;
}

// ZeRO-3 frees a unit's gathered weights once its backward pass ends; a W after that pass
// may read them again (the fused MLP's weight gradients need dh = g W2).
void Pipeline::check_weights_outlive_i(const std::vector<ShardedModel*>& owners) const {
  if (!schedule_.splits_backward()) return;
  for (const ShardedModel* owner : owners)
    ZG_CHECK(!owner->placement().gathers_parameters(), "pipeline: ", name(schedule_.kind), " runs each micro-batch's "
             "W after its I, and ", owner->describe(), " frees a unit's gathered weights at the end of I, which W "
             "may read; use ZeRO stage 0, 1 or 2 with the zero-bubble schedules, or 1f1b");
}

double Pipeline::run(const Tensor& inputs, const Tensor& targets, double loss_scale) {
  ZG_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "pipeline: the loss scale must be positive and finite, got ",
           loss_scale);
  const std::vector<ShardedModel*> sharded = owners();
  check_weights_outlive_i(sharded);
  loss_scale_ = loss_scale;
  const int m = schedule_.micro_batches, rank = pp_->rank(), last = schedule_.stages() - 1;
  const bool first_here = schedule_.rank_of(0) == rank, last_here = schedule_.rank_of(last) == rank;
  const auto split = [&](const Tensor& t, const char* what) {
    std::vector<Tensor> parts;
    ZG_CHECK(t.defined() && t.dim() >= 1 && t.shape()[0] % m == 0, "pipeline: the ", what, " ",
             t.defined() ? describe(t) : std::string("(undefined)"), " do not split into ", m,
             " micro-batches along dim 0");
    for (int i = 0; i < m; ++i) parts.push_back(t.narrow(0, i * (t.shape()[0] / m), t.shape()[0] / m));
    return parts;
  };
  const std::vector<Tensor> micro_inputs = first_here ? split(inputs, "inputs") : std::vector<Tensor>();
  const std::vector<Tensor> micro_targets = last_here ? split(targets, "targets") : std::vector<Tensor>();
  loss_sum_ = 0;
  held_.clear(), mailbox_.clear(), activations_.clear();  // what a step that threw left; this step's shapes
  const GradientSyncGuard sync(sharded);
  for (const PlanStep& step : plan_) {
    if (const auto* e = std::get_if<Exchange>(&step)) {
      exchange(*e);
      continue;
    }
    const Action& a = std::get<Action>(step);
    TraceRange range(a.str());
    if (StepLog* log = StepLog::current()) log->mark(a.str());  // a dry run's: where each action begins (step_time.h)
    if (a.kind == Action::forward) {
      forward(a, micro_inputs, micro_targets);
      continue;
    }
    sync.before_backward(&step == &plan_[last_gradients_]);
    backward(a);  // B, I or W
  }
  sum_tied();
  const Tensor mean = full({1}, last_here ? loss_sum_ / m : 0.0,
                           TensorOptions(DType::f64).device(agreement_device(*pp_, device_)));
  pp_->broadcast(mean, schedule_.rank_of(last));
  return mean.item<double>();
}

}  // namespace zg::dist
