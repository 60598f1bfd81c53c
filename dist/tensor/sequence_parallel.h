// Sequence parallelism (Korthikanti et al. 2022, "Reducing activation recomputation in
// large transformer models", section 4.2.2): between the tensor-parallel blocks, the
// norms and dropouts would be the same work on the whole sequence on every rank. Cut
// the sequence instead: each of the T ranks holds x_r, positions [r S/T, (r+1) S/T)
// along the sequence dim of x [.., S, ..], and those ops' activations shrink by T. The
// blocks then enter through all_gather_sequence and leave through
// reduce_scatter_sequence (dist/comm/differentiable.h): the same bytes as the
// all-reduces they replace.
//
// Each op here gives rank r exactly its rows of the one-rank op's output, and the
// one-rank gradients.
#pragma once

#include "dist/comm/process_group.h"
#include "nn/layers.h"

namespace zg::dist {

// dropout(x, p, training) of the full x, on this rank's shard x_r of it (`dim`: the
// sequence dim): the same elements kept, scaled by 1/(1-p), from the same generator
// state, which moves on as the one-rank call moves it (ceil(numel(x) / 4) Philox
// blocks), so every later random op matches a one-rank run. Each rank must start from
// the one-rank run's generator state.
Tensor sequence_parallel_dropout(const Tensor& x_shard, double p, bool training, const ProcessGroup& group,
                                 int64_t dim = 0);

// layer_norm / rms_norm over the last dim of a shard. The weight and bias are whole on
// every rank and enter through copy_to_group: their gradient is the sum over the ranks'
// shards, the one-rank gradient, on every rank.
Tensor sequence_parallel_layer_norm(const Tensor& x_shard, const Tensor& weight, const Tensor& bias,
                                    ProcessGroup& group, double eps = 1e-5);
Tensor sequence_parallel_rms_norm(const Tensor& x_shard, const Tensor& weight, ProcessGroup& group,
                                  double eps = 1e-6);

// nn::Dropout, nn::LayerNorm and nn::RMSNorm on sequence shards: the same parameters
// ("weight", "bias") with the same initial values, so a model swaps them in.
// (The dropout: an nn::Dropout told its part, group.rank() of group.size() along `dim`.)
class SequenceParallelDropout : public nn::Dropout {
 public:
  SequenceParallelDropout(double p, const ProcessGroup& group, int64_t dim = 0);
};

class SequenceParallelLayerNorm : public nn::LayerNorm {
 public:
  SequenceParallelLayerNorm(int64_t dim, ProcessGroup& group, double eps = 1e-5, bool bias = true,
                            TensorOptions options = {});
  Tensor forward(const Tensor& x_shard) override;

 private:
  GroupRef group_;
};

class SequenceParallelRMSNorm : public nn::RMSNorm {
 public:
  SequenceParallelRMSNorm(int64_t dim, ProcessGroup& group, double eps = 1e-6, TensorOptions options = {});
  Tensor forward(const Tensor& x_shard) override;

 private:
  GroupRef group_;
};

}  // namespace zg::dist
