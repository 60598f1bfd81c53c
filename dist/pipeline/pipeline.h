// The pipeline executor: one rank's part of a pipeline, run in a Schedule's order
// (dist/pipeline/schedule.h) -- one executor for every schedule.
//
// The rank holds v chunks, modules in a stage's order: chunk c is stage c p + r. run()
// splits the batch into m micro-batches along dim 0 and runs the rank's actions:
//   F(i, c)  input: micro-batch i (stage 0), or the previous stage's output, received;
//            output: sent on to the next stage -- or, on the last stage, the loss of
//            micro-batch i against its targets, divided by m
//   B(i, c)  backward from that loss, or from the output's gradient, received; the
//            input's gradient sent back
//   I(i, c)  B's first half (zero-bubble schedules): the input's gradient alone, sent back
//            (zg::backward_input, autograd/split_backward.h)
//   W(i, c)  B's second half, later: the weights' gradients
// so the gradients that accumulate over the micro-batches are those of the batch's mean
// loss, as one rank computing the whole batch would have them. Between the actions the
// rank posts and waits for the exchanges of message_plan() (messages.h): pending sends
// with the next receive, as one batch -- the order NCCL needs. Each message is tagged
// with its micro-batch, stage and direction, so a rank that runs another schedule than
// its peers fails naming both messages (ProcessGroup::send_async), never hangs.
//
// Between I and W a micro-batch keeps what W needs: the saved tensors of the nodes that
// owe the weights' gradients (ZB-H1 holds p micro-batches so on every rank, as 1F1B's
// first rank). ZeRO-3 frees a unit's gathered weights after its backward, which W may
// still read (the fused MLP's weight gradients), so chunks in a ZeRO-3 ShardedModel are
// refused for these schedules; stages 0-2 reduce each weight's gradient in W.
//   Chunks in a ShardedModel accumulate the micro-batches' gradients unreduced and have
// them reduced once, in the rank's last backward, where the owner reduces once
// (ShardedModel::reduces_once: stages 0, 1, and 2, 3 with ZeroConfig::reduce_once);
// otherwise each backward reduce-scatters its micro-batch into the shard.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "autograd/split_backward.h"
#include "dist/comm/process_group.h"
#include "dist/pipeline/messages.h"
#include "dist/pipeline/schedule.h"
#include "nn/module.h"

namespace zg::dist {

class ShardedModel;

// The last stage's loss of one micro-batch: a scalar, its mean over the micro-batch.
using PipelineLoss = std::function<Tensor(const Tensor& output, const Tensor& target)>;

class Pipeline {
 public:
  // `pp`: the pipeline's group (a mesh's "pp" dimension), schedule.ranks ranks; `chunks`:
  // this rank's schedule.chunks modules, chunk c for stage c p + pp.rank(); `loss` runs
  // on the rank of the last stage. `tied`: parameters the first and the last stage share
  // (Stages::tied, stages.h), each rank's copy of them; after each step's backward the
  // ranks of the two ends send each other their gradients and add them, so both copies
  // take the same step.
  Pipeline(ProcessGroup& pp, Schedule schedule, std::vector<std::shared_ptr<nn::Module>> chunks, PipelineLoss loss,
           std::vector<Tensor> tied = {});

  // One step's forward and backward over the batch: `inputs` (needed on the rank of stage
  // 0) and `targets` (on the rank of the last stage), of as many rows, a multiple of m.
  // Gradients accumulate into the chunks' parameters; returns the batch's mean loss, on
  // every rank (sent from the last stage's), once the tied gradients are summed. On the
  // meta device (a dry run: shapes and bytes, no values) the loss is NaN. `loss_scale`
  // multiplies what backward starts from (a GradScaler's scale_factor(), which the step
  // divides out again); the loss returned is unscaled.
  double run(const Tensor& inputs, const Tensor& targets, double loss_scale = 1.0);

  // Every activation between two stages has this shape and dtype (Megatron's
  // tensor_shape): sent without headers. For a dry run of one rank over a fake group,
  // where no peer sends one; a stage whose output differs is an error naming both.
  void set_activation(Shape shape, DType dtype) { fixed_activation_.emplace(std::move(shape), dtype); }

  const Schedule& schedule() const { return schedule_; }
  int first_stage() const { return schedule_.stage(pp_->rank(), 0); }

 private:
  struct Held {  // a micro-batch's chunk between its F and its B (or its I and W)
    Tensor input;   // the received activation, a leaf requiring grad (undefined on stage 0)
    Tensor output;  // what backward starts from: the sent output, or the last stage's scaled loss
    std::optional<DeferredWeightGradients> weights;  // after I: W's work
  };
  void forward(const Action& action, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets);
  void backward(const Action& action);
  void exchange(const Exchange& e);
  Tensor take(const Message& m);  // out of the mailbox: m, received or handed over by this rank's other chunk
  const std::pair<Shape, DType>& activation_of(const Message& m) const;  // its boundary's, from micro-batch 0
  void sum_tied();  // the two ends add each other's gradients of the tied parameters
  std::vector<ShardedModel*> owners() const;  // the ShardedModels holding the chunks' parameters
  void check_weights_outlive_i(const std::vector<ShardedModel*>& owners) const;  // zero-bubble: no ZeRO-3 chunk
  // Where the chunks' parameters are (the CPU if they have none): received activations land there.
  static Device device_of(const std::vector<std::shared_ptr<nn::Module>>& chunks);

  GroupRef pp_;
  Schedule schedule_;
  std::vector<std::shared_ptr<nn::Module>> chunks_;
  PipelineLoss loss_;
  std::vector<Tensor> tied_;
  Device device_;
  std::map<std::pair<int, int>, Held> held_;  // by (chunk, micro-batch)
  std::vector<PlanStep> plan_;                // this rank's actions and exchanges
  size_t last_gradients_ = 0;                 // in plan_: the last B or W, whose backward reduces
  // By tag: outputs and input gradients waiting to be sent, or taken by this rank's other
  // chunk; messages received, waiting for their action.
  std::map<int64_t, Tensor> mailbox_;
  std::map<int, std::pair<Shape, DType>> activations_;  // this step's, by boundary (the stage sending them)
  std::optional<std::pair<Shape, DType>> fixed_activation_;  // set_activation's
  double loss_sum_ = 0;
  double loss_scale_ = 1;  // this run's
};

}  // namespace zg::dist
