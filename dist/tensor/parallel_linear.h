// Megatron's tensor-parallel linear layers (Shoeybi et al. 2019, section 3): a Linear
// y = x W^T + b, W [out, in], cut across a group of T ranks, each holding 1/T of W.
//
// An MLP is a ColumnParallelLinear then a RowParallelLinear: the first cuts W's rows
// (the output features), so the activation between them stays cut along its last
// dim and needs no communication; the second cuts W's columns (the input features)
// and sums the ranks' partial products. One all-reduce forward, one backward.
//
// Each rank's slice is the one of the weights nn::Linear(in, out) draws from the same
// generator state, so the T slices together are the one-rank layer. init_std as
// nn::Linear's: N(0, init_std) weights and zero biases (GPT and Llama: 0.02), else
// U(-1/sqrt(in), 1/sqrt(in)).
#pragma once

#include <optional>

#include "dist/comm/process_group.h"
#include "nn/module.h"

namespace zg::dist {

// Y_r = X W_r^T + b_r with W_r = rows [r out/T, (r+1) out/T) of W: this rank's out/T
// output features. The input enters through copy_to_group (its gradient is the sum of
// the ranks'). gather_output: all-gather Y along the last dim (every rank gets [.., out]).
class ColumnParallelLinear : public nn::Module {
 public:
  ColumnParallelLinear(int64_t in_features, int64_t out_features, ProcessGroup& group, bool bias = true,
                       bool gather_output = false, std::optional<double> init_std = std::nullopt,
                       TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight, bias;  // [out/T, in], [out/T]
  bool gather_output;

 private:
  GroupRef group_;
};

// Y = sum over ranks of X_r W_r^T, then + b, with W_r = columns [r in/T, (r+1) in/T) of W
// and X_r the matching slice of the input's last dim. input_is_parallel: x is already
// X_r [.., in/T] (a ColumnParallelLinear's output); else x is [.., in] on every rank and
// this rank keeps its slice. The bias is whole on every rank, added after the sum.
class RowParallelLinear : public nn::Module {
 public:
  RowParallelLinear(int64_t in_features, int64_t out_features, ProcessGroup& group, bool bias = true,
                    bool input_is_parallel = true, std::optional<double> init_std = std::nullopt,
                    TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight, bias;  // [out, in/T], [out]
  bool input_is_parallel;

 private:
  GroupRef group_;
};

}  // namespace zg::dist
