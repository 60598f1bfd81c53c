// The collectives move flat, contiguous buffers, rank q's part in slice q: a tensor is
// cut or joined along `dim` by moving that dim to the front first, where rank order is
// storage order.
#include "dist/comm/differentiable.h"

#include "autograd/record.h"
#include "tensor/checks.h"

namespace zg::dist {

namespace {

const DifferentiableOp kCopyToGroup("copy_to_group");
const DifferentiableOp kReduceFromGroup("reduce_from_group");
const DifferentiableOp kAllGatherSequence("all_gather_sequence");
const DifferentiableOp kReduceScatterSequence("reduce_scatter_sequence");
const DifferentiableOp kGatherLastDim("gather_last_dim");
const DifferentiableOp kSplitLastDim("split_last_dim");
const DifferentiableOp kScatterToSequence("scatter_to_sequence");
const DifferentiableOp kGatherFromSequence("gather_from_sequence");

constexpr const char* kDestroyed = "a differentiable collective's backward: its process group was destroyed first";

// x's `dim`, wrapped; where `cut`, its size must divide by the group's size T.
int64_t checked_dim(const char* op, const Tensor& x, int64_t dim, const ProcessGroup& group, bool cut) {
  detail::check_defined(op, x);
  ZG_CHECK(x.dim() >= 1, op, ": cannot cut or join a 0-dim tensor, got ", describe(x));
  dim = wrap_dim(dim, x.dim(), op);
  ZG_CHECK(!cut || x.size(dim) % group.size() == 0, op, ": dim ", dim, " of ", describe(x), " (", x.size(dim),
           ") does not divide by the group size ", group.size());
  return dim;
}

// Every rank's x summed, in a new tensor.
Tensor all_reduced(const Tensor& x, ProcessGroup& group) {
  NoGradGuard no_grad;
  Tensor sum = x.contiguous().clone();
  group.all_reduce(sum);
  return sum;
}

// The ranks' x concatenated along dim: gathered with dim at the front, then moved back.
Tensor gathered(const Tensor& x, ProcessGroup& group, int64_t dim) {
  NoGradGuard no_grad;
  const Tensor front = x.transpose(0, dim).contiguous();
  Shape shape = front.shape();
  shape[0] *= group.size();
  const Tensor out = empty(shape, detail::options_of(x));
  group.all_gather(front.reshape({front.numel()}), out.reshape({out.numel()}));
  return out.transpose(0, dim).contiguous();
}

// This rank's slice along dim of every rank's x summed.
Tensor reduce_scattered(const Tensor& x, ProcessGroup& group, int64_t dim) {
  NoGradGuard no_grad;
  const Tensor front = x.transpose(0, dim).contiguous();
  Shape shape = front.shape();
  shape[0] /= group.size();
  const Tensor out = empty(shape, detail::options_of(x));
  group.reduce_scatter(front.reshape({front.numel()}), out.reshape({out.numel()}));
  return out.transpose(0, dim).contiguous();
}

// This rank's slice along dim, in storage of its own: a view would keep the whole x alive
// wherever the slice is saved for backward (the first block's norm saves its input).
Tensor own_slice(const Tensor& x, const ProcessGroup& group, int64_t dim) {
  NoGradGuard no_grad;
  const int64_t n = x.size(dim) / group.size();
  return x.narrow(dim, group.rank() * n, n).clone();
}

std::vector<Tensor> one(const Tensor& grad) { return {grad}; }

// A split of a replicated x and its conjugate gather of a replicated y, under their names.
struct SplitPair {
  const DifferentiableOp &split, &gather;
};
const SplitPair kLastDim{kSplitLastDim, kGatherLastDim};
const SplitPair kSequence{kScatterToSequence, kGatherFromSequence};

Tensor gather(const SplitPair& pair, const Tensor& x, ProcessGroup& group, int64_t dim);

// y = this rank's slice along dim of the replicated x; dL/dx = cat over ranks of dL/dy.
Tensor split(const SplitPair& pair, const Tensor& x, ProcessGroup& group, int64_t dim) {
  return differentiable(own_slice(x, group, dim), pair.split, {x},
                        [&pair, ref = GroupRef(group, kDestroyed), dim](const Tensor& g) {
                          return one(gather(pair, g, *ref, dim));
                        });
}

// y = cat over ranks of x along dim; dL/dx = this rank's slice of the replicated dL/dy.
Tensor gather(const SplitPair& pair, const Tensor& x, ProcessGroup& group, int64_t dim) {
  return differentiable(gathered(x, group, dim), pair.gather, {x},
                        [&pair, ref = GroupRef(group, kDestroyed), dim](const Tensor& g) {
                          return one(split(pair, g, *ref, dim));
                        });
}

}  // namespace

Tensor copy_to_group(const Tensor& x, ProcessGroup& group) {
  detail::check_defined("copy_to_group", x);
  // y = x; dL/dx = sum over ranks of dL/dy.
  return differentiable(x.detach(), kCopyToGroup, {x}, [ref = GroupRef(group, kDestroyed)](const Tensor& g) {
    return one(reduce_from_group(g, *ref));
  });
}

Tensor reduce_from_group(const Tensor& x, ProcessGroup& group) {
  detail::check_defined("reduce_from_group", x);
  // y = sum over ranks of x; dL/dx = dL/dy.
  return differentiable(all_reduced(x, group), kReduceFromGroup, {x},
                        [ref = GroupRef(group, kDestroyed)](const Tensor& g) { return one(copy_to_group(g, *ref)); });
}

Tensor all_gather_sequence(const Tensor& x, ProcessGroup& group, int64_t dim) {
  dim = checked_dim("all_gather_sequence", x, dim, group, false);
  // y = cat over ranks of x; dL/dx = this rank's slice of sum over ranks of dL/dy.
  return differentiable(
      gathered(x, group, dim), kAllGatherSequence, {x},
      [ref = GroupRef(group, kDestroyed), dim](const Tensor& g) { return one(reduce_scatter_sequence(g, *ref, dim)); });
}

Tensor reduce_scatter_sequence(const Tensor& x, ProcessGroup& group, int64_t dim) {
  dim = checked_dim("reduce_scatter_sequence", x, dim, group, true);
  // y = this rank's slice of sum over ranks of x; dL/dx = cat over ranks of dL/dy.
  return differentiable(
      reduce_scattered(x, group, dim), kReduceScatterSequence, {x},
      [ref = GroupRef(group, kDestroyed), dim](const Tensor& g) { return one(all_gather_sequence(g, *ref, dim)); });
}

Tensor gather_last_dim(const Tensor& x, ProcessGroup& group) {
  return gather(kLastDim, x, group, checked_dim(kLastDim.gather.name(), x, -1, group, false));
}

Tensor split_last_dim(const Tensor& x, ProcessGroup& group) {
  return split(kLastDim, x, group, checked_dim(kLastDim.split.name(), x, -1, group, true));
}

Tensor scatter_to_sequence(const Tensor& x, ProcessGroup& group, int64_t dim) {
  return split(kSequence, x, group, checked_dim(kSequence.split.name(), x, dim, group, true));
}

Tensor gather_from_sequence(const Tensor& x, ProcessGroup& group, int64_t dim) {
  return gather(kSequence, x, group, checked_dim(kSequence.gather.name(), x, dim, group, false));
}

}  // namespace zg::dist
