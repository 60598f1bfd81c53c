// Front-ends of the neural-network primitives, each with its gradient. Each
// kernel works on rows of a contiguous [M, C] matrix; these functions bring any
// input to that form (with recorded views, so gradients find their way back).
#include <array>
#include <cmath>

#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/backend.h"
#include "tensor/checks.h"

namespace zg {

using detail::options_of;

namespace {

using Grads = std::vector<Tensor>;

const DifferentiableOp kSoftmax("softmax"), kLogSoftmax("log_softmax"), kLayerNorm("layer_norm"),
    kAddLayerNorm("add_layer_norm"), kEmbedding("embedding"), kCrossEntropy("cross_entropy"),
    kAttention("scaled_dot_product_attention"), kPackedAttention("packed_attention");

// dx = y (g - sum(g y))            for y = softmax(x)
// dx = g - exp(y) sum(g)           for y = log_softmax(x)
Tensor softmax_impl(const Tensor& x, int64_t dim, bool log, const char* name) {
  detail::check_floating(name, x);
  if (x.dim() == 0) {  // one element, over dim 0 or -1 (as in PyTorch)
    ZG_CHECK(dim == 0 || dim == -1, name, ": dim ", dim, " is out of range for a 0-d tensor (", describe(x), ")");
    return softmax_impl(x.view({1}), 0, log, name).view({});
  }
  dim = wrap_dim(dim, x.dim(), name);
  const Tensor moved = x.transpose(dim, -1).contiguous();
  const Tensor rows = detail::as_rows(moved);
  Tensor out = empty_like(rows);
  if (out.numel() > 0) backend(x.device()).softmax(rows, log, out);  // a zero-size dim: nothing to normalise
  out = differentiable(out, log ? kLogSoftmax : kSoftmax, {rows}, [y = SavedTensor(out), log](const Tensor& g) {
    const Tensor v = y.get(log ? "log_softmax" : "softmax");
    if (log) return Grads{g - exp(v) * sum(g, {1}, true)};
    return Grads{v * (g - sum(g * v, {1}, true))};
  });
  return out.view(moved.shape()).transpose(dim, -1).contiguous();
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false, "softmax"); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true, "log_softmax"); }

namespace {

// Validates a layer norm over the last dim of x; returns the weight and bias as the kernels take them.
std::pair<Tensor, Tensor> layer_norm_params(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                                            double eps) {
  detail::check_floating(op, x);
  ZG_CHECK(x.dim() >= 1, op, ": expected a tensor of rank >= 1, got ", describe(x));
  ZG_CHECK(eps >= 0, op, ": eps must be non-negative, got ", eps);
  const int64_t channels = x.size(-1);
  ZG_CHECK(channels > 0, op, ": cannot normalise over a zero-size last dim (", describe(x), ")");
  for (const Tensor* p : {&weight, &bias}) {
    if (!p->defined()) continue;
    detail::check_compatible(op, x, *p);
    ZG_CHECK(p->shape() == Shape{channels}, op, ": expected weight and bias of shape [", channels, "], got ",
             describe(*p), " for input ", describe(x));
  }
  return {weight.defined() ? weight.contiguous() : weight, bias.defined() ? bias.contiguous() : bias};
}

// Output, mean and rstd of a layer norm over rows [M, C], allocated for the kernel.
LayerNormOutput empty_layer_norm(const Tensor& rows) {
  const TensorOptions stat_options = TensorOptions(accumulate_type(rows.dtype())).device(rows.device());
  return {empty_like(rows), empty({rows.size(0)}, stat_options), empty({rows.size(0)}, stat_options)};
}

// y = xhat w + b with xhat = (x - mean) rstd. With gxhat = g w:
//   dx = rstd (gxhat - mean(gxhat) - xhat mean(gxhat xhat)),  dw = sum_rows(g xhat),  db = sum_rows(g)
// (one backend kernel: Backend::layer_norm_backward). Records that gradient on the
// kernel's output `r` for rows [M, C] and returns r shaped as x ([..., C]).
LayerNormOutput record_layer_norm(LayerNormOutput r, const Tensor& rows, const Tensor& w, const Tensor& b,
                                  const Shape& shape) {
  r.out = differentiable(
      r.out, kLayerNorm, {rows, w, b},
      [rows = SavedTensor(rows), w = SavedTensor(w), mu = SavedTensor(r.mean), rstd = SavedTensor(r.rstd),
       has_weight = w.defined(), has_bias = b.defined()](const Tensor& g) {
        const Tensor x = rows.get("layer_norm");
        Grads grads{empty_like(x), has_weight ? empty({x.size(1)}, options_of(x)) : Tensor(),
                    has_bias ? empty({x.size(1)}, options_of(x)) : Tensor()};
        backend(x.device()).layer_norm_backward(g.contiguous(), x, w.get("layer_norm"), mu.get("layer_norm"),
                                                rstd.get("layer_norm"), grads[0], grads[1], grads[2]);
        return grads;
      });
  const Shape stat_shape(shape.begin(), shape.end() - 1);
  return {r.out.view(shape), r.mean.view(stat_shape), r.rstd.view(stat_shape)};
}

}  // namespace

LayerNormOutput layer_norm_with_stats(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const auto [w, b] = layer_norm_params("layer_norm", x, weight, bias, eps);
  const Tensor rows = detail::as_rows(x);
  LayerNormOutput r = empty_layer_norm(rows);
  backend(x.device()).layer_norm(rows, w, b, eps, r.out, r.mean, r.rstd);
  return record_layer_norm(r, rows, w, b, x.shape());
}

// sum = x + residual and layer_norm(sum) from one kernel; the graph is the one the two
// ops would record apart: an add node (both inputs get the gradient as it is) and a
// layer-norm node whose input is the sum.
AddLayerNormOutput add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                                  double eps) {
  const auto [w, b] = layer_norm_params("add_layer_norm", x, weight, bias, eps);
  detail::check_compatible("add_layer_norm", x, residual);
  ZG_CHECK(x.shape() == residual.shape(), "add_layer_norm: x and residual must have one shape, got ", describe(x),
           " and ", describe(residual));
  const Tensor rows = detail::as_rows(x), residual_rows = detail::as_rows(residual);
  Tensor sum = empty_like(rows);
  LayerNormOutput r = empty_layer_norm(rows);
  backend(x.device()).add_layer_norm(rows, residual_rows, w, b, eps, sum, r.out, r.mean, r.rstd);
  sum = differentiable(sum, kAddLayerNorm, {rows, residual_rows}, [](const Tensor& g) { return Grads{g, g}; });
  return {sum.view(x.shape()), record_layer_norm(r, sum, w, b, x.shape()).out};
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  return layer_norm_with_stats(x, weight, bias, eps).out;
}

// out[i] = weight[idx[i]]:  dweight[v] = sum of g[i] over the i with idx[i] = v.
Tensor embedding(const Tensor& weight, const Tensor& indices) {
  detail::check_floating("embedding", weight);
  detail::check_index_dtype("embedding", indices);
  ZG_CHECK(weight.dim() == 2, "embedding: expected a 2-D weight, got ", describe(weight));
  ZG_CHECK(weight.device() == indices.device(), "embedding: device mismatch: ", describe(weight), " and ",
           describe(indices));
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.size(1));
  const Tensor flat = indices.contiguous().view({-1});
  Tensor out = empty({indices.numel(), weight.size(1)}, options_of(weight));
  backend(weight.device()).embedding(weight.contiguous(), flat, out);
  out = differentiable(out, kEmbedding, {weight}, [idx = SavedTensor(flat), shape = weight.shape()](const Tensor& g) {
    Tensor dw = zeros(shape, options_of(g));
    backend(g.device()).embedding_backward(g.contiguous(), idx.get("embedding"), dw);
    return Grads{dw};
  });
  return out.view(out_shape);
}

// loss_i = lse(x_i) - x_i[t_i]:  dx_i = g_i (softmax(x_i) - onehot(t_i)), and 0 for ignored rows
// (Backend::cross_entropy_backward: the probabilities are recomputed per row, never stored).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  detail::check_floating("cross_entropy", logits);
  detail::check_index_dtype("cross_entropy", target);
  ZG_CHECK(logits.device() == target.device(), "cross_entropy: device mismatch: ", describe(logits), " and ",
           describe(target));
  const Shape lead(logits.shape().begin(), logits.shape().end() - (logits.dim() > 0 ? 1 : 0));
  ZG_CHECK(logits.dim() >= 1 && target.shape() == lead, "cross_entropy: logits ", describe(logits),
           " need targets of shape ", shape_str(lead), ", got ", describe(target));
  ZG_CHECK(logits.size(-1) > 0 || target.numel() == 0, "cross_entropy: logits ", describe(logits),
           " have no classes for the targets to name");
  const Tensor rows = detail::as_rows(logits);
  const Tensor flat_target = target.contiguous().view({-1, 1});
  // Per-row losses and their mean stay in f32 (f64 for f64), the loss returned included.
  const DType acc = accumulate_type(logits.dtype());
  Tensor losses = empty({rows.size(0)}, TensorOptions(acc).device(logits.device()));
  backend(logits.device()).cross_entropy(rows, flat_target.view({-1}), ignore_index, losses);
  losses = differentiable(losses, kCrossEntropy, {rows},
                          [rows = SavedTensor(rows), t = SavedTensor(flat_target), l = SavedTensor(losses),
                           ignore_index](const Tensor& g) {
                            // The gradient goes over the logits where nothing else reads them
                            // (the caller dropped its handle): no second [N, C] buffer.
                            const Tensor reusable = rows.get_for_overwrite("cross_entropy");
                            const Tensor x = reusable.defined() ? reusable : rows.get("cross_entropy");
                            Tensor dx = reusable.defined() ? reusable : empty_like(x);
                            backend(x.device()).cross_entropy_backward(x, t.get("cross_entropy").view({-1}),
                                                                       ignore_index, l.get("cross_entropy"),
                                                                       g.contiguous(), dx);
                            return Grads{dx};
                          });
  // Mean over the targets that count: sum(losses) / #(target != ignore_index).
  const Tensor counted = sum(ne(target, static_cast<double>(ignore_index))).to(acc);
  return div(sum(losses), counted);
}

namespace {

// One attention forward, and what its backward reads. Fused (Backend::attention,
// cuDNN's flash attention on CUDA): the output is written [B, T, H, D]-contiguous and
// returned as its [B, H, T, D] view, so the model's transpose back to [B, T, C] is free,
// and `kept` is the rows' logsumexp [B, H, T]. Composed (matmul and softmax, any rank,
// any device): `kept` is the probabilities P [..., T, S].
struct AttentionForward {
  Tensor out, kept;
  bool fused = false;
};

// [B, H, T, D] views of fresh [B, T, H, D] buffers, laid out like t.
Tensor bthd_like(const Tensor& t) {
  return empty({t.size(0), t.size(2), t.size(1), t.size(3)}, options_of(t)).transpose(1, 2);
}

// Where a fused kernel may take attention: 4-d operands (the backend says whether it does).
bool fused_candidate(const Tensor& q) { return q.dim() == 4; }

// S = q k^T * scale (masked above the diagonal when causal), P = softmax(S), out = P v.
// q, k, v need unit stride in D for the fused kernel. Records nothing.
AttentionForward attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                                   bool backward_follows) {
  NoGradGuard no_grad;
  // One query row with no backward to follow (a decode step) is composed: it reads K and V
  // once either way, and a fused graph, built per key length, would be built again each token.
  const bool decode_step = q.size(-2) == 1 && !backward_follows;
  if (fused_candidate(q) && !decode_step) {
    AttentionForward a{bthd_like(q), empty({q.size(0), q.size(1), q.size(2)}, TensorOptions(DType::f32).device(q.device())),
                       true};
    // The backend learns from requires_grad whether a backward will follow (it then
    // checks it can run one): q, k, v may be views of an input that requires grad.
    auto as_input = [&](const Tensor& t) { return t.detach().set_requires_grad(backward_follows); };
    if (backend(q.device()).attention(as_input(q), as_input(k), as_input(v), causal, scale, a.out, a.kept)) return a;
  }
  Tensor scores = matmul(q, k, false, true) * scale;
  if (causal) {
    const TensorOptions idx = TensorOptions(DType::i64).device(q.device());
    const Tensor above = gt(arange(k.size(-2), idx).unsqueeze(0), arange(q.size(-2), idx).unsqueeze(1));
    scores = masked_fill(scores, above, -INFINITY);
  }
  AttentionForward a;
  a.kept = softmax(scores, -1);
  a.out = matmul(a.kept, v);
  return a;
}

// q, k and v of GPT's packed projection [B, T, 3C] as [B, H, T, D] views (no copy).
std::array<Tensor, 3> unpack_qkv(const Tensor& qkv, int64_t heads) {
  const int64_t batch = qkv.size(0), time = qkv.size(1), channels = qkv.size(2) / 3;
  std::array<Tensor, 3> parts;
  for (int64_t i = 0; i < 3; ++i)
    parts[i] = qkv.narrow(2, i * channels, channels).view({batch, time, heads, channels / heads}).transpose(1, 2);
  return parts;
}

// dq, dk, dv, and where they are the thirds of one [B, T, 3C] buffer, that buffer.
struct AttentionGrads {
  std::array<Tensor, 3> dqkv;
  Tensor packed;
};

// Its backward for the output gradient g (fused: [B, H, T, D], a view of a contiguous
// [B, T, H, D] buffer, as the output). Fused, the backend writes dq, dk, dv into fresh
// [B, T, H, D] buffers -- or, where q, k, v are packed (packed_qkv), into the thirds of
// one fresh [B, T, 3C] buffer: the gradient of the projection they came from. Composed,
// with dP = g v^T:
//   dv = P^T g,  dS = P (dP - sum(dP P)) * scale,  dq = dS k,  dk = dS^T q,
// each summed back to its input's shape (k, v may broadcast over q's batch).
AttentionGrads attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionForward& a,
                                  const Tensor& g, bool causal, double scale) {
  if (a.fused) {
    AttentionGrads grads;
    if (packed_qkv(q, k, v)) {
      grads.packed = empty({q.size(0), q.size(2), 3 * q.size(1) * q.size(3)}, options_of(q));
      grads.dqkv = unpack_qkv(grads.packed, q.size(1));
    } else {
      grads.dqkv = {bthd_like(q), bthd_like(k), bthd_like(v)};
    }
    const auto& [dq, dk, dv] = grads.dqkv;
    backend(q.device()).attention_backward(q, k, v, a.out, a.kept, g, causal, scale, dq, dk, dv);
    return grads;
  }
  const Tensor& P = a.kept;
  const Tensor dP = matmul(g, v, false, true);
  const Tensor dS = P * (dP - sum(dP * P, {-1}, true)) * scale;
  return {{sum_to(matmul(dS, k), q.shape()), sum_to(matmul(dS, q, true, false), k.shape()),
           sum_to(matmul(P, g, true, false), v.shape())},
          Tensor()};
}

}  // namespace

Tensor repeat_heads(const Tensor& kv, int64_t heads) {
  ZG_CHECK(kv.dim() >= 3 && kv.size(-3) > 0 && heads % kv.size(-3) == 0, "repeat_heads: ", describe(kv),
           " has no head count dividing ", heads);
  if (kv.size(-3) == heads) return kv.contiguous();
  Shape expanded = kv.shape(), merged = kv.shape();
  expanded.insert(expanded.end() - 2, heads / kv.size(-3));
  merged[merged.size() - 3] = heads;
  return kv.unsqueeze(-3).expand(expanded).reshape(merged).contiguous();  // (from one head, reshape alone gives stride 0)
}

// One op with its own backward; the fused kernel where the device has one, else
// composed from matmul and softmax (attention_forward, attention_backward above).
Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, bool causal) {
  const char* name = "scaled_dot_product_attention";
  detail::check_floating(name, q_in);
  detail::check_compatible(name, q_in, k_in);
  detail::check_compatible(name, q_in, v_in);
  ZG_CHECK(q_in.dim() >= 2 && k_in.dim() == q_in.dim() && v_in.dim() == q_in.dim(), name,
           ": expected q, k, v of one rank >= 2, got ", describe(q_in), ", ", describe(k_in), ", ", describe(v_in));
  ZG_CHECK(q_in.size(-1) == k_in.size(-1) && k_in.size(-2) == v_in.size(-2), name, ": q ", describe(q_in), ", k ",
           describe(k_in), " and v ", describe(v_in), " need q, k of one head size and k, v of one length");
  if (q_in.dim() >= 3 && k_in.size(-3) != q_in.size(-3)) {
    // Grouped-query attention (Ainslie et al. 2023): each of k's and v's heads serves
    // H / H_kv query heads, so they are repeated in place of each head (their gradient sums
    // over the repeats). The fused kernels then see H heads as usual.
    const int64_t heads = q_in.size(-3), kv_heads = k_in.size(-3);
    ZG_CHECK(kv_heads > 0 && v_in.size(-3) == kv_heads && heads % kv_heads == 0, name,
             ": grouped-query attention needs k and v of one head count dividing q's, got q ", describe(q_in),
             ", k ", describe(k_in), ", v ", describe(v_in));
    return scaled_dot_product_attention(q_in, repeat_heads(k_in, heads), repeat_heads(v_in, heads), causal);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(q_in.size(-1)));
  // The fused kernels read D with unit stride (the composed path takes any strides).
  auto unit_inner = [&](const Tensor& t) {
    return !fused_candidate(q_in) || t.strides().back() == 1 ? t : t.contiguous();
  };
  const Tensor q = unit_inner(q_in), k = unit_inner(k_in), v = unit_inner(v_in);
  const AttentionForward a = attention_forward(q, k, v, causal, scale, needs_grad({&q, &k, &v}));
  // Fused, the op records its output's contiguous [B, T, H, D] buffer, kept for the backward.
  const Tensor recorded = a.fused ? a.out.transpose(1, 2) : a.out;
  const Tensor out = differentiable(
      recorded, kAttention, {q, k, v},
      [q = SavedTensor(q), k = SavedTensor(k), v = SavedTensor(v), out = a.fused ? SavedTensor(recorded) : SavedTensor(),
       kept = SavedTensor(a.kept), fused = a.fused, causal, scale](const Tensor& g) {
        const char* op = "scaled_dot_product_attention";
        const AttentionForward a{fused ? out.get(op).transpose(1, 2) : Tensor(), kept.get(op), fused};
        const auto [dq, dk, dv] = attention_backward(q.get(op), k.get(op), v.get(op), a,
                                                     fused ? g.contiguous().transpose(1, 2) : g, causal, scale).dqkv;
        return Grads{dq, dk, dv};
      });
  return a.fused ? out.transpose(1, 2) : out;
}

// The attention of scaled_dot_product_attention on q, k, v viewed in place in the
// packed buffer; the backward's gradient is one [B, T, 3C] buffer (the fused kernel
// writes dq, dk, dv straight into it; composed, they are copied in), where split's
// three views would each have filled a zeroed [B, T, 3C] buffer, then added up.
Tensor packed_attention(const Tensor& qkv_in, int64_t heads, bool causal) {
  const char* name = "packed_attention";
  detail::check_floating(name, qkv_in);
  ZG_CHECK(qkv_in.dim() == 3 && heads > 0 && qkv_in.size(2) % 3 == 0 && qkv_in.size(2) / 3 % heads == 0 &&
               qkv_in.size(2) > 0,
           name, ": expected qkv [B, T, 3 * ", heads, " heads * D] with D > 0, got ", describe(qkv_in));
  const Tensor qkv = qkv_in.contiguous();
  const int64_t batch = qkv.size(0), time = qkv.size(1), channels = qkv.size(2) / 3;
  const double scale = 1.0 / std::sqrt(static_cast<double>(channels / heads));
  AttentionForward a;
  {
    const auto [q, k, v] = unpack_qkv(qkv.detach(), heads);
    a = attention_forward(q, k, v, causal, scale, needs_grad({&qkv}));
  }
  // [B, T, C]: a view of the fused output's [B, T, H, D] buffer; a copy of the composed one.
  const Tensor y = a.out.transpose(1, 2).reshape({batch, time, channels});
  return differentiable(
      y, kPackedAttention, {qkv},
      [qkv = SavedTensor(qkv), out = a.fused ? SavedTensor(y) : SavedTensor(), kept = SavedTensor(a.kept),
       fused = a.fused, heads, causal, scale](const Tensor& g) {
        const char* op = "packed_attention";
        const Tensor packed = qkv.get(op);
        const auto [q, k, v] = unpack_qkv(packed, heads);
        const Shape bthd{q.size(0), q.size(2), q.size(1), q.size(3)};
        const AttentionForward a{fused ? out.get(op).view(bthd).transpose(1, 2) : Tensor(), kept.get(op), fused};
        const AttentionGrads grads =
            attention_backward(q, k, v, a, g.contiguous().view(bthd).transpose(1, 2), causal, scale);
        if (grads.packed.defined()) return Grads{grads.packed};  // fused: written in place
        const Tensor dqkv = empty_like(packed);
        auto into = unpack_qkv(dqkv, heads);
        for (int i = 0; i < 3; ++i) into[i].copy_(grads.dqkv[i]);
        return Grads{dqkv};
      });
}

}  // namespace zg
