#include "dist/tensor/parallel_linear.h"

#include "autograd/functions.h"
#include "autograd/graph.h"
#include "dist/comm/differentiable.h"
#include "dist/tensor/parallelize.h"
#include "nn/layers.h"

namespace zg::dist {

namespace {

struct Slice {
  Tensor weight, bias;
};

// This rank's slice of the weight nn::Linear(in, out) draws from the current generator,
// cut along `dim` (0: its rows, the output features; 1: its columns, the input
// features), and the bias cut along with the rows or kept whole. The full layer is
// built, then narrowed and cloned: exactly the one-rank draws, at the price of the
// full weight's memory while the constructor runs.
Slice slice_of_linear(const char* layer, int64_t in, int64_t out, const ProcessGroup& group, bool bias, int64_t dim,
                      std::optional<double> init_std, TensorOptions options) {
  const int64_t features = dim == 0 ? out : in, world = group.size();
  ZG_CHECK(features % world == 0, layer, ": ", dim == 0 ? "out_features " : "in_features ", features,
           " does not divide by the group size T = ", world);
  NoGradGuard no_grad;
  nn::Linear full(in, out, bias, init_std, options);
  const nn::TensorSplit split{dim, 1, group.size(), group.rank()};
  Slice slice{slice_of(full.weight, split), Tensor()};
  if (bias) slice.bias = dim == 0 ? slice_of(full.bias, split) : full.bias.clone();
  return slice;
}

void check_features(const char* layer, const Tensor& x, const Tensor& weight) {
  ZG_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == weight.size(1), layer, ": input ", describe(x),
           " does not end in ", weight.size(1), " features (this rank's weight ", describe(weight), ")");
}

}  // namespace

ColumnParallelLinear::ColumnParallelLinear(int64_t in_features, int64_t out_features, ProcessGroup& group,
                                           bool has_bias, bool gather_output_, std::optional<double> init_std,
                                           TensorOptions options)
    : gather_output(gather_output_),
      group_(group, "ColumnParallelLinear: its process group was destroyed; keep the group as long as the layer") {
  Slice slice = slice_of_linear("ColumnParallelLinear", in_features, out_features, group, has_bias, 0, init_std,
                                options);
  weight = register_parameter("weight", slice.weight);
  if (has_bias) bias = register_parameter("bias", slice.bias);
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  check_features("ColumnParallelLinear", x, weight);
  const Tensor y = linear(copy_to_group(x, *group_), weight, bias);  // Y_r = X W_r^T + b_r
  return gather_output ? gather_last_dim(y, *group_) : y;
}

RowParallelLinear::RowParallelLinear(int64_t in_features, int64_t out_features, ProcessGroup& group, bool has_bias,
                                     bool input_is_parallel_, std::optional<double> init_std,
                                     TensorOptions options)
    : input_is_parallel(input_is_parallel_),
      group_(group, "RowParallelLinear: its process group was destroyed; keep the group as long as the layer") {
  Slice slice = slice_of_linear("RowParallelLinear", in_features, out_features, group, has_bias, 1, init_std,
                                options);
  weight = register_parameter("weight", slice.weight);
  if (has_bias) bias = register_parameter("bias", slice.bias);
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  const Tensor input = input_is_parallel ? x : split_last_dim(x, *group_);
  check_features("RowParallelLinear", input, weight);
  const Tensor y = reduce_from_group(linear(input, weight, Tensor()), *group_);  // sum over ranks of X_r W_r^T
  return bias.defined() ? y + bias : y;
}

}  // namespace zg::dist
