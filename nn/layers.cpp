#include "nn/layers.h"

#include <cmath>

#include "autograd/graph.h"
#include "tensor/checks.h"

namespace zg::nn {

Linear::Linear(int64_t in_features, int64_t out_features, bool has_bias, std::optional<double> init_std,
               TensorOptions options, Activation act)
    : activation(act) {
  ZG_CHECK(in_features >= 0 && out_features >= 0, "Linear: in_features and out_features must be >= 0, got ",
           in_features, " and ", out_features);
  const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
  const Shape shape{out_features, in_features};
  weight = register_parameter(
      "weight", init_std ? normal(shape, 0.0, *init_std, options) : uniform(shape, -bound, bound, options));
  if (has_bias)
    bias = register_parameter("bias", init_std ? zeros({out_features}, options)
                                               : uniform({out_features}, -bound, bound, options));
}

Tensor Linear::forward(const Tensor& x) {
  ZG_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "Linear: input ", describe(x), " does not end in ",
           weight.size(1), " features (weight ", describe(weight), ")");
  return linear(x, weight, bias, activation);  // the leading dims fold into the rows of one GEMM
}

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, double init_std, TensorOptions options) {
  weight = register_parameter("weight", normal({num_embeddings, embedding_dim}, 0.0, init_std, options));
}

Tensor Embedding::forward(const Tensor& indices) {
  return first_id ? embedding_rows(weight, indices, *first_id) : embedding(weight, indices);
}

RowIds ids_in_rows(const Tensor& ids, int64_t first, int64_t count) {
  NoGradGuard no_grad;
  const Tensor outside = logical_or(lt(ids, double(first)), ge(ids, double(first + count)));
  return {outside, masked_fill(ids - double(first), outside, 0.0)};
}

Tensor embedding_rows(const Tensor& weight, const Tensor& ids, int64_t first) {
  detail::check_index_dtype("embedding_rows", ids);
  const RowIds rows = ids_in_rows(ids, first, weight.size(0));
  return masked_fill(embedding(weight, rows.local), rows.outside.unsqueeze(-1), 0.0);
}

LayerNorm::LayerNorm(int64_t dim, double eps_, bool has_bias, TensorOptions options) : eps(eps_) {
  weight = register_parameter("weight", ones({dim}, options));
  if (has_bias) bias = register_parameter("bias", zeros({dim}, options));
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, weight, bias, eps); }

Dropout::Dropout(double p_) : p(p_) {
  ZG_CHECK(p >= 0 && p <= 1, "Dropout: p must be in [0, 1], got ", p);
}

Tensor Dropout::forward(const Tensor& x) {
  if (parts == 1 && sequence.whole()) return dropout(x, p, is_training());
  const SequencePieces mine = sequence.refine(parts, part);
  return dropout_pieces(x, p, is_training(), part_dim, mine.held, mine.parts, "Dropout");
}

RMSNorm::RMSNorm(int64_t dim, double eps_, TensorOptions options) : eps(eps_) {
  weight = register_parameter("weight", ones({dim}, options));
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, weight, eps); }

SwiGLU::SwiGLU(int64_t dim, int64_t hidden, bool bias, double init_std, TensorOptions options) {
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(dim, hidden, bias, init_std, options));
  up_proj = register_module("up_proj", std::make_shared<Linear>(dim, hidden, bias, init_std, options));
  down_proj = register_module("down_proj", std::make_shared<Linear>(hidden, dim, bias, init_std, options));
}

Tensor SwiGLU::forward(const Tensor& x) { return (*down_proj)(silu((*gate_proj)(x)) * (*up_proj)(x)); }

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) {
  for (const std::shared_ptr<Module>& m : modules) push_back(m);
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (size_t i = 0; i < size(); ++i) y = (*this)[i](y);
  return y;
}

}  // namespace zg::nn
