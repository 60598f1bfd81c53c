// A backward split in two, for zero-bubble pipeline schedules (Qi et al. 2023, "Zero
// Bubble Pipeline Parallelism"; torch.distributed.pipelining's stage_backward_input and
// stage_backward_weight): I, the gradient of a stage's input, which the previous stage
// waits for, now; W, the gradients of its weights, later, in what would be a bubble.
//
//   zg::DeferredWeightGradients w = zg::backward_input(y, dy, {x});  // I: x.grad, to send upstream
//   ...                                                             // other micro-batches' work
//   w.run();                                                        // W: the weights' .grad
//
// I runs the nodes on the paths from the output to `inputs`, each asked (needs_input_grad)
// for the gradients of those paths only: matmul, linear and mlp skip their weight GEMMs.
// What a node owes its other edges waits for W, which runs from there on to the weights:
// its incoming gradient and saved tensors, to run its formula again for those edges -- or,
// where its formula returned every gradient anyway (layer_norm's one kernel), just those
// gradients. The fused mlp's weight gradients need dh = g W2, which W computes again.
// I then W puts into every .grad what one backward() would, bit for bit on the CPU: the
// same formulas, and each node and leaf sums what reaches it in the same order.
//
// Hooks: a node's tensor hooks and retained grad run when its whole gradient has arrived
// (in I for the nodes on the paths to the inputs); a leaf's post-accumulate-grad hooks
// when its gradient lands (I for the inputs, W for the weights). I and W are each a
// backward pass for queue_backward_callback, so a data-parallel reducer reduces the
// weights' gradients at the end of W. The graph is not retained: W frees it.
//
// Activation checkpointing: a node whose formula runs a backward of its own
// (Node::reenters_graph, nn::checkpoint) may reach any part of the graph through what
// its function captured, so it runs whole in I, as do the paths from the output to it:
// the parameters inside a checkpointed segment get their gradients in I.
//
// Threads: as backward(), everything is per thread; W runs on the thread that ran I.
#pragma once

#include <memory>
#include <vector>

#include "autograd/graph.h"

namespace zg {

// The weight part of a split backward, to run later (W). Move-only.
class DeferredWeightGradients {
 public:
  DeferredWeightGradients(DeferredWeightGradients&&) noexcept;
  DeferredWeightGradients& operator=(DeferredWeightGradients&&) noexcept;
  // Not run: the weights get nothing from it, and the graph's saved tensors are freed.
  ~DeferredWeightGradients();

  // W: the gradients of every leaf requiring grad that backward_input did not reach (the
  // weights), accumulated into their .grad exactly as one backward() would have; their
  // post-accumulate-grad hooks run here. Then the graph's saved tensors are freed. Once
  // only (again, or after a move, is a zg::Error), on the thread that ran backward_input,
  // outside any backward pass.
  void run();
  // True when W has nothing to compute (no leaf but the inputs needs a gradient), or ran.
  bool empty() const;

 private:
  struct State;
  explicit DeferredWeightGradients(std::unique_ptr<State> state);
  void discard();
  friend DeferredWeightGradients backward_input(const Tensor& output, const Tensor& grad,
                                                const std::vector<Tensor>& inputs);
  std::unique_ptr<State> state_;
};

// I: the backward of `output` (from `grad`, as Tensor::backward(grad): undefined for a
// one-element output) restricted to the paths that reach `inputs` -- leaves requiring grad,
// each reachable from output; their .grad is accumulated as backward() does. What the
// nodes on those paths owe the other leaves (the weights) is kept for the returned W.
// Refused (zg::Error) inside a backward pass (a hook, formula or callback).
DeferredWeightGradients backward_input(const Tensor& output, const Tensor& grad, const std::vector<Tensor>& inputs);

}  // namespace zg
