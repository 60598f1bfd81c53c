// Megatron's conjugate collectives (Shoeybi et al. 2019; Megatron-LM's
// tensor_parallel/mappings.py) as differentiable functions over any ProcessGroup of T
// ranks. Each op's backward is its conjugate's forward: identity <-> all-reduce,
// all-gather <-> reduce-scatter (or split). A layer cut across the group with them
// computes the one-rank layer's output and gradients (dist/tensor/parallel_linear.h).
// They run the group's own collectives, so their bytes count in group.bytes_sent().
//
// The group must outlive the backward pass; a destroyed one is a zg::Error there.
#pragma once

#include "dist/comm/process_group.h"

namespace zg::dist {

// "f": y = x (every rank holds the same x);  dL/dx = sum over ranks of dL/dy (all-reduce).
// Where a replicated input enters each rank's slice of a layer (ColumnParallelLinear).
Tensor copy_to_group(const Tensor& x, ProcessGroup& group);

// "g": y = sum over ranks of x (all-reduce);  dL/dx = dL/dy (identity).
// Where the ranks' partial sums leave a layer (RowParallelLinear).
Tensor reduce_from_group(const Tensor& x, ProcessGroup& group);

// Sequence parallelism, x [.., S/T, ..] -> y [.., S, ..]: y = the ranks' x concatenated
// along `dim` in rank order (all-gather);  dL/dx = this rank's slice of the sum over
// ranks of dL/dy (reduce-scatter).
Tensor all_gather_sequence(const Tensor& x, ProcessGroup& group, int64_t dim = 0);

// The reverse, x [.., S, ..] -> y [.., S/T, ..]: y = this rank's slice along `dim` of the
// sum over ranks of x (reduce-scatter);  dL/dx = the ranks' dL/dy concatenated (all-gather).
Tensor reduce_scatter_sequence(const Tensor& x, ProcessGroup& group, int64_t dim = 0);

// [.., n/T] -> [.., n]: y = the ranks' x concatenated along the last dim (all-gather);
// dL/dx = this rank's slice of dL/dy, which every rank holds whole (what follows y is
// replicated), so no sum is needed. ColumnParallelLinear's gather_output.
Tensor gather_last_dim(const Tensor& x, ProcessGroup& group);

// [.., n] -> [.., n/T]: y = this rank's slice of the last dim of a replicated x (no
// communication);  dL/dx = the ranks' dL/dy concatenated (all-gather). RowParallelLinear's
// input when it is not already parallel.
Tensor split_last_dim(const Tensor& x, ProcessGroup& group);

// Sequence parallelism's entry from a replicated x [.., S, ..] -> [.., S/T, ..]: this
// rank's slice along `dim` (no communication);  dL/dx = the ranks' dL/dy concatenated
// (all-gather). Megatron's scatter_to_sequence_parallel_region.
Tensor scatter_to_sequence(const Tensor& x, ProcessGroup& group, int64_t dim = 0);

// Its conjugate, [.., S/T, ..] -> [.., S, ..] replicated: y = the ranks' x concatenated
// along `dim` (all-gather);  dL/dx = this rank's slice of dL/dy, which every rank holds
// whole. (all_gather_sequence instead sums the ranks' dL/dy: for a y each rank uses apart.)
Tensor gather_from_sequence(const Tensor& x, ProcessGroup& group, int64_t dim = 0);

}  // namespace zg::dist
