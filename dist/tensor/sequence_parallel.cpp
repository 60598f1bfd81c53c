#include "dist/tensor/sequence_parallel.h"

#include "autograd/functions.h"
#include "dist/comm/differentiable.h"

namespace zg::dist {

Tensor sequence_parallel_dropout(const Tensor& x_shard, double p, bool training, const ProcessGroup& group,
                                 int64_t dim) {
  return dropout_part(x_shard, p, training, dim, group.rank(), group.size(), "sequence_parallel_dropout");
}

Tensor sequence_parallel_layer_norm(const Tensor& x_shard, const Tensor& weight, const Tensor& bias,
                                    ProcessGroup& group, double eps) {
  return layer_norm(x_shard, copy_to_group(weight, group), bias.defined() ? copy_to_group(bias, group) : bias, eps);
}

Tensor sequence_parallel_rms_norm(const Tensor& x_shard, const Tensor& weight, ProcessGroup& group, double eps) {
  return rms_norm(x_shard, copy_to_group(weight, group), eps);
}

SequenceParallelDropout::SequenceParallelDropout(double p_, const ProcessGroup& group, int64_t dim) : nn::Dropout(p_) {
  part_dim = dim, part = group.rank(), parts = group.size();
}

SequenceParallelLayerNorm::SequenceParallelLayerNorm(int64_t dim, ProcessGroup& group, double eps_, bool has_bias,
                                                     TensorOptions options)
    : nn::LayerNorm(dim, eps_, has_bias, options),
      group_(group, "SequenceParallelLayerNorm: its process group was destroyed; keep the group as long as the layer") {
}

Tensor SequenceParallelLayerNorm::forward(const Tensor& x_shard) {
  return sequence_parallel_layer_norm(x_shard, weight, bias, *group_, eps);
}

SequenceParallelRMSNorm::SequenceParallelRMSNorm(int64_t dim, ProcessGroup& group, double eps_, TensorOptions options)
    : nn::RMSNorm(dim, eps_, options),
      group_(group, "SequenceParallelRMSNorm: its process group was destroyed; keep the group as long as the layer") {}

Tensor SequenceParallelRMSNorm::forward(const Tensor& x_shard) {
  return sequence_parallel_rms_norm(x_shard, weight, *group_, eps);
}

}  // namespace zg::dist
