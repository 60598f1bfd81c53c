// Tensor parallelism applied to a model built whole: parallelize_module cuts the modules a
// plan names (nn/parallel_plan.h) across a group of T ranks -- PyTorch's parallelize_module
// with ColwiseParallel / RowwiseParallel, over zerograd's plain tensors.
//
// Every rank builds the same whole model (same seed), then calls this with its rank of
// the group: each named Linear or Embedding keeps its slice of the weights (so the T
// slices together are the one-rank model), and forward hooks put Megatron's conjugate
// collectives (dist/comm/differentiable.h) around it:
//
//   colwise          x -> copy_to_group(x) -> x W_r^T + b_r          [.., out/T]
//   rowwise          x_r -> reduce_from_group(x_r W_r^T) + b          [.., out]
//   vocab_embedding  ids -> reduce_from_group(this rank's rows, zeros for other ids)
//   copy_output      y -> copy_to_group(y)
//
// The model's forward reads its local sizes from the weights (heads from a projection's
// rows), so its code is the same at any T. Each cut parameter's split is recorded on its
// module (Module::named_splits): a ShardedModel then shards each rank's slices over the
// data-parallel ranks and sums the gradient norm over the whole model.
#pragma once

#include "dist/comm/process_group.h"
#include "nn/module.h"

namespace zg::dist {

// Cuts `model` as `plan` says (by default the model's own, Module::parallel_plan). Checked
// before anything changes: every rule names a module of the model (glob patterns: one at
// least), of the kind its style cuts (a Linear, an Embedding), no module under two rules,
// every cut size and every count in plan.must_divide divisible by T -- a zg::Error names
// the module, the size and T. The model must not yet be in a ShardedModel, nor deferred.
// The group must outlive the model's forwards and backwards.
void parallelize_module(nn::Module& model, ProcessGroup& group, const nn::ParallelPlan& plan);
void parallelize_module(nn::Module& model, ProcessGroup& group);

// This rank's piece of `whole` as `split` cuts it, a new contiguous tensor (in the current
// memory category); gather_split puts the pieces back together.
Tensor slice_of(const Tensor& whole, const nn::TensorSplit& split);

// The whole tensor from every rank's `slice`, cut as `split` says (Module::named_splits):
// the ranks' slices all-gathered and laid side by side within each chunk (a collective on
// the group the split was made over). A new tensor, on every rank.
Tensor gather_split(const Tensor& slice, const nn::TensorSplit& split, ProcessGroup& group);

}  // namespace zg::dist
