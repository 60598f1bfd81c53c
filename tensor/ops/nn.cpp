// Front-ends of the neural-network primitives. Each kernel works on rows of a
// contiguous [M, C] matrix; these functions bring any input to that form.
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/ops/checks.h"

namespace zg {

using detail::options_of;

namespace {

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log, const char* name) {
  detail::check_floating(name, x);
  if (x.dim() == 0) return softmax_impl(x.view({1}), 0, log, name).view({});
  dim = wrap_dim(dim, x.dim(), name);
  const Tensor moved = x.transpose(dim, -1).contiguous();
  const int64_t classes = moved.size(-1);
  const Tensor rows = moved.view({-1, classes});
  Tensor out = empty_like(rows);
  backend(x.device()).softmax(rows, log, out);
  return out.view(moved.shape()).transpose(dim, -1).contiguous();
}

// Leading dims of `x` flattened: [..., C] -> rows of C.
Tensor as_rows(const Tensor& x) { return x.contiguous().view({-1, x.size(-1)}); }

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false, "softmax"); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true, "log_softmax"); }

LayerNormOutput layer_norm_with_stats(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  detail::check_floating("layer_norm", x);
  ZG_CHECK(x.dim() >= 1, "layer_norm: expected a tensor of rank >= 1, got ", describe(x));
  ZG_CHECK(eps >= 0, "layer_norm: eps must be non-negative, got ", eps);
  const int64_t channels = x.size(-1);
  for (const Tensor* p : {&weight, &bias}) {
    if (!p->defined()) continue;
    detail::check_compatible("layer_norm", x, *p);
    ZG_CHECK(p->shape() == Shape{channels}, "layer_norm: expected weight and bias of shape [", channels,
             "], got ", describe(*p), " for input ", describe(x));
  }
  const Tensor rows = as_rows(x);
  const Shape stat_shape(x.shape().begin(), x.shape().end() - 1);
  const TensorOptions stat_options = TensorOptions(x.dtype() == DType::f64 ? DType::f64 : DType::f32)
                                         .device(x.device());
  LayerNormOutput result{empty_like(rows), empty({rows.size(0)}, stat_options), empty({rows.size(0)}, stat_options)};
  backend(x.device()).layer_norm(rows, weight.defined() ? weight.contiguous() : weight,
                                 bias.defined() ? bias.contiguous() : bias, eps, result.out, result.mean,
                                 result.rstd);
  result.out = result.out.view(x.shape());
  result.mean = result.mean.view(stat_shape);
  result.rstd = result.rstd.view(stat_shape);
  return result;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  return layer_norm_with_stats(x, weight, bias, eps).out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  detail::check_floating("embedding", weight);
  detail::check_index_dtype("embedding", indices);
  ZG_CHECK(weight.dim() == 2, "embedding: expected a 2-D weight, got ", describe(weight));
  ZG_CHECK(weight.device() == indices.device(), "embedding: device mismatch: ", describe(weight), " and ",
           describe(indices));
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.size(1));
  Tensor out = empty({indices.numel(), weight.size(1)}, options_of(weight));
  backend(weight.device()).embedding(weight.contiguous(), indices.contiguous().view({-1}), out);
  return out.view(out_shape);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  detail::check_floating("cross_entropy", logits);
  detail::check_index_dtype("cross_entropy", target);
  ZG_CHECK(logits.device() == target.device(), "cross_entropy: device mismatch: ", describe(logits), " and ",
           describe(target));
  const Shape lead(logits.shape().begin(), logits.shape().end() - (logits.dim() > 0 ? 1 : 0));
  ZG_CHECK(logits.dim() >= 1 && target.shape() == lead, "cross_entropy: logits ", describe(logits),
           " need targets of shape ", shape_str(lead), ", got ", describe(target));
  const Tensor rows = as_rows(logits);
  // Per-row losses and their mean stay in f32 (f64 for f64) so that bf16/f16 logits
  // lose precision once, in the final cast, not in the count or the sum.
  const DType accumulate = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor losses = empty({rows.size(0)}, TensorOptions(accumulate).device(logits.device()));
  backend(logits.device()).cross_entropy(rows, target.contiguous().view({-1}), ignore_index, losses);
  // Mean over the targets that count: sum(losses) / #(target != ignore_index).
  const Tensor counted = sum(ne(target, static_cast<double>(ignore_index))).to(accumulate);
  return div(sum(losses), counted).to(logits.dtype());
}

}  // namespace zg
