#include "dist/tensor/sequence_parallel.h"

#include "autograd/functions.h"
#include "dist/comm/differentiable.h"
#include "tensor/backend.h"
#include "tensor/checks.h"
#include "tensor/context.h"

namespace zg::dist {

namespace {

constexpr const char* kDropout = "sequence_parallel_dropout";

// This rank's slice of the one-rank draws rand(x.shape()) in f32, x [outer, S, inner]
// flattened around the sequence dim. The shard is `outer` runs of S/T * inner elements
// contiguous in x, run o starting at element (o T + r) S/T inner: each run is one fill
// from its own place in the Philox stream (block start / 4, lane start % 4), so no
// [.., S, ..] buffer is made. The generator reserves the whole x's blocks, as rand would.
Tensor shard_of_uniforms(const Tensor& x_shard, const ProcessGroup& group, int64_t dim) {
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x_shard.size(d);
  const int64_t run = outer == 0 ? 0 : x_shard.numel() / outer;
  const Tensor uniforms = empty({outer, run}, TensorOptions(DType::f32).device(x_shard.device()));
  Generator& generator = Generator::current();
  RandomSpec spec;  // U[0, 1)
  spec.seed = generator.seed();
  const uint64_t first_block = generator.reserve(x_shard.numel() * group.size());
  for (int64_t o = 0; o < outer && run > 0; ++o) {
    const auto start = static_cast<uint64_t>((o * group.size() + group.rank()) * run);
    spec.first_block = first_block + start / 4;
    spec.first_lane = static_cast<uint32_t>(start % 4);
    backend(x_shard.device()).fill_random(uniforms.select(0, o), spec);
  }
  return uniforms.reshape(x_shard.shape());
}

}  // namespace

Tensor sequence_parallel_dropout(const Tensor& x_shard, double p, bool training, const ProcessGroup& group,
                                 int64_t dim) {
  detail::check_defined(kDropout, x_shard);
  ZG_CHECK(x_shard.dim() >= 1, kDropout, ": a 0-dim tensor has no sequence dim, got ", describe(x_shard));
  dim = wrap_dim(dim, x_shard.dim(), kDropout);
  return dropout_with_draw(kDropout, x_shard, p, training, [&] { return shard_of_uniforms(x_shard, group, dim); });
}

Tensor sequence_parallel_layer_norm(const Tensor& x_shard, const Tensor& weight, const Tensor& bias,
                                    ProcessGroup& group, double eps) {
  return layer_norm(x_shard, copy_to_group(weight, group), bias.defined() ? copy_to_group(bias, group) : bias, eps);
}

Tensor sequence_parallel_rms_norm(const Tensor& x_shard, const Tensor& weight, ProcessGroup& group, double eps) {
  return rms_norm(x_shard, copy_to_group(weight, group), eps);
}

SequenceParallelDropout::SequenceParallelDropout(double p_, ProcessGroup& group, int64_t dim_)
    : nn::Dropout(p_),
      dim(dim_),
      group_(group, "SequenceParallelDropout: its process group was destroyed; keep the group as long as the layer") {
}

Tensor SequenceParallelDropout::forward(const Tensor& x_shard) {
  return sequence_parallel_dropout(x_shard, p, is_training(), *group_, dim);
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
