// Ops composed of the primitives, once for every device: their gradients are those of the
// ops they are made of (tinygrad's way). Each checks its own arguments first, so an error
// names it and not the primitive underneath.
#include <cmath>
#include <limits>

#include "autograd/functions.h"
#include "autograd/graph.h"
#include "tensor/backend.h"
#include "tensor/checks.h"
#include "tensor/context.h"

namespace zg {

namespace {

Tensor reduce(const Tensor& losses, Reduction reduction) {
  switch (reduction) {
    case Reduction::mean: return mean(losses);
    case Reduction::sum: return sum(losses);
    case Reduction::none: return losses;
  }
  fail("loss: unknown reduction");
}

void check_same_shape(const char* op, const Tensor& input, const Tensor& target) {
  detail::check_floating(op, input);
  detail::check_compatible(op, input, target);
  ZG_CHECK(input.shape() == target.shape(), op, ": input ", describe(input), " and target ", describe(target),
           " must have one shape");
}

bool is_16_bit(DType dtype) { return dtype == DType::bf16 || dtype == DType::f16; }

}  // namespace

// x Φ(x) = x (1 + erf(x / √2)) / 2. 16-bit x is computed in f32 and rounded once, as
// PyTorch does (five bf16 roundings, one a step, drifted by several ulp).
Tensor gelu_exact(const Tensor& x) {
  detail::check_floating("gelu_exact", x);
  const Tensor wide = is_16_bit(x.dtype()) ? x.to(DType::f32) : x;
  return (wide * 0.5 * (1.0 + erf(wide * 0.7071067811865476))).to(x.dtype());
}

Tensor silu(const Tensor& x) {
  detail::check_floating("silu", x);
  return x * sigmoid(x);
}

Tensor clamp(const Tensor& x, double low, double high) {
  detail::check_floating("clamp", x);
  ZG_CHECK(low <= high, "clamp: low ", low, " is above high ", high);
  const Tensor clamped = minimum(maximum(x, low), high).detach();
  return where(logical_and(ge(x, low), le(x, high)), x, clamped);
}

// log1p(exp(beta x)) / beta with beta x clamped to the threshold: the branch where() leaves
// out never overflows, so its zero gradient stays 0 (not 0 * inf). 16-bit x in f32.
Tensor softplus(const Tensor& x, double beta, double threshold) {
  detail::check_floating("softplus", x);
  ZG_CHECK(beta > 0 && std::isfinite(beta) && !std::isnan(threshold),
           "softplus: expected a finite beta > 0 and a threshold, got beta ", beta, " and threshold ", threshold);
  const Tensor wide = is_16_bit(x.dtype()) ? x.to(DType::f32) : x;
  const Tensor scaled = wide * beta;
  const Tensor smooth = log1p(exp(minimum(scaled, threshold))) / beta;
  return where(gt(scaled, threshold), wide, smooth).to(x.dtype());
}

Tensor leaky_relu(const Tensor& x, double negative_slope) {
  detail::check_floating("leaky_relu", x);
  return where(gt(x, 0.0), x, x * negative_slope);
}

// (sum |x|^p)^(1/p) taken where the sum is 0 as the root of 1, then replaced by 0: the
// root's gradient there is 0 instead of 0 * inf. 16-bit x is summed in f32.
Tensor norm(const Tensor& x, double p, const Shape& dims, bool keepdim) {
  detail::check_floating("norm", x);
  ZG_CHECK(p >= 0 || p == -std::numeric_limits<double>::infinity(), "norm: p must be >= 0, inf or -inf, got ", p);
  const Tensor wide = is_16_bit(x.dtype()) ? x.to(DType::f32) : x;
  const Tensor magnitude = abs(wide);
  Tensor n;
  if (std::isinf(p)) {
    n = p > 0 ? max(magnitude, dims, keepdim) : min(magnitude, dims, keepdim);
  } else if (p == 0) {
    n = sum(ne(wide, 0.0), dims, keepdim).to(wide.dtype());
  } else if (p == 1) {
    n = sum(magnitude, dims, keepdim);
  } else {
    const Tensor total = sum(p == 2 ? wide * wide : pow(magnitude, p), dims, keepdim);
    const Tensor zero = eq(total, 0.0), safe = where(zero, 1.0, total);
    n = where(zero, 0.0, p == 2 ? sqrt(safe) : pow(safe, 1.0 / p));
  }
  return n.to(x.dtype());
}

Tensor normalize(const Tensor& x, double p, int64_t dim, double eps) {
  detail::check_floating("normalize", x);
  ZG_CHECK(eps >= 0, "normalize: eps must be non-negative, got ", eps);
  dim = wrap_dim(dim, x.dim(), "normalize");
  return x / maximum(norm(x, p, {dim}, true), eps);
}

Tensor isnan(const Tensor& x) {
  detail::check_defined("isnan", x);
  return ne(x.detach(), x.detach());
}

Tensor isinf(const Tensor& x) {
  detail::check_defined("isinf", x);
  if (!is_floating(x.dtype())) return zeros(x.shape(), TensorOptions(DType::boolean).device(x.device()));
  return eq(abs(x.detach()), std::numeric_limits<double>::infinity());
}

namespace {

Tensor nonzero_mask(const Tensor& x) { return x.dtype() == DType::boolean ? x : ne(x.detach(), 0.0); }

}  // namespace

// Counts of the non-zero (zero) elements compared with 0.
Tensor any(const Tensor& x, const Shape& dims, bool keepdim) {
  detail::check_defined("any", x);
  return gt(sum(nonzero_mask(x), dims, keepdim), 0.0);
}

Tensor all(const Tensor& x, const Shape& dims, bool keepdim) {
  detail::check_defined("all", x);
  return eq(sum(logical_not(nonzero_mask(x)), dims, keepdim), 0.0);
}

// lse = m + log sum exp(x - m), m = max(x) held constant (its gradient cancels); an infinite
// m is taken as 0, so a row of -inf gives -inf and not NaN.
Tensor logsumexp(const Tensor& x, const Shape& dims, bool keepdim) {
  detail::check_floating("logsumexp", x);
  ZG_CHECK(x.numel() > 0, "logsumexp: cannot reduce an empty tensor ", describe(x));
  Tensor m = max(x, dims, true).detach();
  m = where(eq(abs(m), std::numeric_limits<double>::infinity()), 0.0, m);
  const Tensor total = log(sum(exp(x - m), dims, keepdim));
  return total + m.reshape(total.shape());
}

// var = sum((x - mean)^2) / (N - correction), N the elements reduced into each result.
Tensor var(const Tensor& x, const Shape& dims, bool keepdim, int64_t correction) {
  detail::check_floating("var", x);
  ZG_CHECK(correction >= 0, "var: correction must be non-negative, got ", correction);
  const Tensor mu = mean(x, dims, true), d = x - mu;
  const int64_t reduced = mu.numel() == 0 ? 0 : x.numel() / mu.numel();
  return sum(d * d, dims, keepdim) / static_cast<double>(std::max<int64_t>(0, reduced - correction));
}

Tensor std(const Tensor& x, const Shape& dims, bool keepdim, int64_t correction) {
  return sqrt(var(x, dims, keepdim, correction));
}

namespace {

// [rows, cols] i64: column j - row i.
Tensor column_minus_row(int64_t rows, int64_t cols, Device device) {
  const TensorOptions i64 = TensorOptions(DType::i64).device(device);
  return arange(cols, i64).unsqueeze(0) - arange(rows, i64).unsqueeze(1);
}

// Zeroes x where column - row of its last two dims is above (lower) or below (upper) diagonal.
Tensor triangle(const char* op, const Tensor& x, int64_t diagonal, bool lower) {
  detail::check_defined(op, x);
  ZG_CHECK(x.dim() >= 2, op, ": expected a tensor of rank >= 2, got ", describe(x));
  const Tensor offset = column_minus_row(x.size(-2), x.size(-1), x.device());
  const double d = static_cast<double>(diagonal);
  return masked_fill(x, lower ? gt(offset, d) : lt(offset, d), 0.0);
}

}  // namespace

Tensor tril(const Tensor& x, int64_t diagonal) { return triangle("tril", x, diagonal, true); }
Tensor triu(const Tensor& x, int64_t diagonal) { return triangle("triu", x, diagonal, false); }

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  detail::check_floating("rms_norm", x);
  ZG_CHECK(x.dim() >= 1 && x.size(-1) > 0, "rms_norm: expected a non-empty last dim, got ", describe(x));
  ZG_CHECK(eps >= 0, "rms_norm: eps must be non-negative, got ", eps);
  if (weight.defined()) {
    detail::check_compatible("rms_norm", x, weight);
    ZG_CHECK(weight.shape() == Shape{x.size(-1)}, "rms_norm: expected a weight of shape [", x.size(-1), "], got ",
             describe(weight));
  }
  const Tensor wide = is_16_bit(x.dtype()) ? x.to(DType::f32) : x;
  const Tensor normed = (wide * rsqrt(mean(wide * wide, {-1}, true) + eps)).to(x.dtype());
  return weight.defined() ? normed * weight : normed;
}

RotaryTables rotary_tables(int64_t offset, int64_t length, int64_t dim, double theta, TensorOptions options) {
  ZG_CHECK(dim > 0 && dim % 2 == 0 && theta > 0, "rotary_tables: expected an even head size and theta > 0, got dim ",
           dim, ", theta ", theta);
  std::vector<double> frequencies(static_cast<size_t>(dim / 2));
  for (size_t i = 0; i < frequencies.size(); ++i) frequencies[i] = std::pow(theta, -2.0 * static_cast<double>(i) / dim);
  return rotary_tables(offset, length, frequencies, options);
}

RotaryTables rotary_tables(int64_t offset, int64_t length, const std::vector<double>& frequencies,
                           TensorOptions options) {
  ZG_CHECK(offset >= 0 && length >= 0 && !frequencies.empty(), "rotary_tables: expected offset, length >= 0 and at ",
           "least one frequency, got offset ", offset, ", length ", length, ", ", frequencies.size(), " frequencies");
  const int64_t half = static_cast<int64_t>(frequencies.size()), dim = 2 * half;
  // The meta device holds no values: the tables' bytes, without the trigonometry.
  if (options.device().type == DeviceType::meta) return {empty({length, dim}, options), empty({length, dim}, options)};
  std::vector<double> cos_v(static_cast<size_t>(length * dim)), sin_v(cos_v.size());
  for (int64_t t = 0; t < length; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(offset + t) * frequencies[static_cast<size_t>(i)];
      for (int64_t at : {t * dim + i, t * dim + half + i}) {
        cos_v[static_cast<size_t>(at)] = std::cos(angle);
        sin_v[static_cast<size_t>(at)] = std::sin(angle);
      }
    }
  const auto table = [&](const std::vector<double>& v) { return tensor<double>(v, {length, dim}).to(options.dtype()).to(options.device()); };
  return {table(cos_v), table(sin_v)};
}

// out = x cos + rotate_half(x) sin,  rotate_half(x1, x2) = (-x2, x1).
Tensor rotary_embedding(const Tensor& x, const RotaryTables& tables) {
  detail::check_floating("rotary_embedding", x);
  ZG_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "rotary_embedding: expected x [..., T, D] with D even, got ",
           describe(x));
  for (const Tensor* t : {&tables.cos, &tables.sin}) {
    detail::check_compatible("rotary_embedding", x, *t);
    ZG_CHECK(t->shape() == Shape({x.size(-2), x.size(-1)}), "rotary_embedding: tables ", describe(*t),
             " do not match x ", describe(x), " (expected [T, D])");
  }
  const int64_t half = x.size(-1) / 2;
  const Tensor rotated = cat({neg(x.narrow(-1, half, half)), x.narrow(-1, 0, half)}, -1);
  return x * tables.cos + rotated * tables.sin;
}

Tensor rotary_embedding(const Tensor& x, int64_t offset, double theta) {
  detail::check_floating("rotary_embedding", x);
  ZG_CHECK(x.dim() >= 2, "rotary_embedding: expected x [..., T, D], got ", describe(x));
  return rotary_embedding(x, rotary_tables(offset, x.size(-2), x.size(-1), theta, detail::options_of(x)));
}

namespace {

// x kept where its uniform draw (f32, one per element, from `draw`, called only when
// 0 < p < 1 in training) is below 1 - p, and scaled by 1/(1-p), rounded once. The backward
// keeps only the bool mask (1 byte an element: attention's [B, H, T, T] probabilities).
Tensor dropout_with_draw(const char* op, const Tensor& x, double p, bool training,
                         const std::function<Tensor()>& draw) {
  ZG_CHECK(p >= 0 && p <= 1, op, ": p must be in [0, 1], got ", p);
  ZG_CHECK(x.defined() && is_floating(x.dtype()), op, ": expected a floating tensor, got ", describe(x));
  if (!training || p == 0) return x;
  if (p == 1) return x * 0.0;  // everything dropped (as PyTorch: no draw, no 1/(1-p))
  const Tensor uniforms = draw();
  ZG_CHECK(uniforms.shape() == x.shape(), op, ": drew ", describe(uniforms), " for ", describe(x));
  const Tensor wide = is_16_bit(x.dtype()) ? x.to(DType::f32) : x;  // 1/(1-p) in f32, as PyTorch
  return where(ge(uniforms, 1.0 - p), 0.0, (wide * (1.0 / (1.0 - p))).to(x.dtype()));
}

// Pieces `held` of the draws rand(whole.shape()) in f32, the whole x [outer, parts n, inner]
// flattened around `dim`, this rank's x [outer, held n, inner] those pieces side by side:
// `outer` x held runs of n inner elements, run (o, h) starting at element (o parts + held[h])
// n inner of the whole. Each run is one fill from its own place in the Philox stream (block
// start / 4, lane start % 4), so no whole-sized buffer is made; the generator reserves the
// whole x's blocks, as rand would.
Tensor pieces_of_uniforms(const Tensor& x_pieces, int64_t dim, const std::vector<int>& held, int parts) {
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x_pieces.size(d);
  const auto count = static_cast<int64_t>(held.size());
  const int64_t run = outer == 0 ? 0 : x_pieces.numel() / outer / count;
  const Tensor uniforms = empty({outer, count, run}, TensorOptions(DType::f32).device(x_pieces.device()));
  Generator& generator = Generator::current();
  RandomSpec spec;  // U[0, 1)
  spec.seed = generator.seed();
  const uint64_t first_block = generator.reserve(run * outer * parts);
  for (int64_t o = 0; o < outer && run > 0; ++o)
    for (int64_t h = 0; h < count; ++h) {
      const auto start = static_cast<uint64_t>((o * parts + held[static_cast<size_t>(h)]) * run);
      spec.first_block = first_block + start / 4;
      spec.first_lane = static_cast<uint32_t>(start % 4);
      backend(x_pieces.device()).fill_random(uniforms.select(0, o).select(0, h), spec);
    }
  return uniforms.reshape(x_pieces.shape());
}

}  // namespace

Tensor dropout(const Tensor& x, double p, bool training) {
  return dropout_with_draw("dropout", x, p, training,
                           [&] { return rand(x.shape(), TensorOptions(DType::f32).device(x.device())); });
}

Tensor dropout_part(const Tensor& x_part, double p, bool training, int64_t dim, int part, int parts, const char* op) {
  return dropout_pieces(x_part, p, training, dim, {part}, parts, op);
}

Tensor dropout_pieces(const Tensor& x, double p, bool training, int64_t dim, const std::vector<int>& held, int parts,
                      const char* op) {
  detail::check_defined(op, x);
  ZG_CHECK(x.dim() >= 1, op, ": a 0-dim tensor has no dim to cut, got ", describe(x));
  dim = wrap_dim(dim, x.dim(), op);
  ZG_CHECK(!held.empty() && x.size(dim) % static_cast<int64_t>(held.size()) == 0, op, ": ", held.size(),
           " pieces do not divide dim ", dim, " of ", describe(x));
  for (int piece : held)
    ZG_CHECK(parts >= 1 && piece >= 0 && piece < parts, op, ": piece ", piece, " of ", parts,
             " is not a piece of the whole");
  return dropout_with_draw(op, x, p, training, [&] { return pieces_of_uniforms(x, dim, held, parts); });
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double dropout_p,
                                    bool training, int head_part, int head_parts) {
  ZG_CHECK(dropout_p >= 0 && dropout_p < 1, "scaled_dot_product_attention: dropout_p must be in [0, 1), got ", dropout_p);
  if (!training || dropout_p == 0) return scaled_dot_product_attention(q, k, v, causal);
  detail::check_floating("scaled_dot_product_attention", q);
  ZG_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim() && q.size(-1) == k.size(-1) &&
               k.size(-2) == v.size(-2) && (q.dim() < 3 || k.size(-3) == q.size(-3)),
           "scaled_dot_product_attention with dropout: expected q [..., T, D], k [..., S, D], v [..., S, Dv] with ",
           "one head count, got ", describe(q), ", ", describe(k), ", ", describe(v));
  Tensor scores = matmul(q, k, false, true) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  if (causal)  // key j after query i
    scores = masked_fill(scores, gt(column_minus_row(q.size(-2), k.size(-2), q.device()), 0.0),
                         -std::numeric_limits<double>::infinity());
  const Tensor probs = softmax(scores, -1);
  return matmul(head_parts == 1 ? dropout(probs, dropout_p, true)
                                : dropout_part(probs, dropout_p, true, -3, head_part, head_parts,
                                               "scaled_dot_product_attention"),
                v);
}

Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement) {
  detail::check_floating("multinomial", probs);
  ZG_CHECK((probs.dim() == 1 || probs.dim() == 2) && probs.size(-1) > 0, "multinomial: expected probs [C] or [B, C] ",
           "with C > 0, got ", describe(probs));
  const int64_t categories = probs.size(-1);
  ZG_CHECK(num_samples > 0 && (replacement || num_samples <= categories), "multinomial: cannot draw ", num_samples,
           " samples ", replacement ? "" : "without replacement ", "from ", categories, " categories");
  NoGradGuard no_grad;
  const Tensor rows = probs.dim() == 1 ? probs.unsqueeze(0) : probs;
  const Tensor weights = rows.to(DType::f64);
  // The checks' three figures read back at once (on a GPU each read is a host wait).
  const std::vector<double> checks =
      stack({min(weights), max(weights), min(sum(gt(weights, 0.0), {1})).to(DType::f64)}).to_vector<double>();
  const double low = checks[0], high = checks[1];
  ZG_CHECK(low >= 0 && std::isfinite(high), "multinomial: weights must be finite and non-negative, got [", low, ", ",
           high, "]");
  const auto fewest = static_cast<int64_t>(checks[2]);
  ZG_CHECK(fewest >= (replacement ? 1 : num_samples), "multinomial: a row has ", fewest, " categories of positive weight, ",
           "too few to draw ", replacement ? int64_t{1} : num_samples, replacement ? "" : " without replacement");
  const Tensor log_weights = log(weights);  // 0 -> -inf: never drawn
  const auto keys = [&] {  // log w + Gumbel noise: the largest key is a draw from w / sum(w)
    return log_weights - log(neg(log(rand(weights.shape(), TensorOptions(DType::f64).device(weights.device())))));
  };
  Tensor drawn;
  if (replacement) {
    std::vector<Tensor> draws;
    for (int64_t s = 0; s < num_samples; ++s) draws.push_back(argmax(keys(), 1, true));
    drawn = cat(draws, 1);
  } else {
    drawn = topk(keys(), num_samples, 1).indices;
  }
  return probs.dim() == 1 ? drawn.squeeze(0) : drawn;
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  check_same_shape("mse_loss", input, target);
  const Tensor d = input - target;
  return reduce(d * d, reduction);
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index, Reduction reduction) {
  detail::check_floating("nll_loss", log_probs);
  detail::check_index_dtype("nll_loss", target);
  ZG_CHECK(log_probs.dim() >= 1, "nll_loss: expected log_probs [..., C], got ", describe(log_probs));
  Shape rows = log_probs.shape();
  rows.pop_back();
  ZG_CHECK(target.shape() == rows, "nll_loss: target ", describe(target), " must have the shape of log_probs ",
           describe(log_probs), " without its last dim");
  const Tensor kept = ne(target, static_cast<double>(ignore_index));
  const Tensor safe = where(kept, target, zeros_like(target));  // ignored rows read class 0, then drop out
  const Tensor picked = gather(log_probs, -1, safe.unsqueeze(-1)).squeeze(-1);
  const Tensor losses = masked_fill(neg(picked), logical_not(kept), 0.0);
  if (reduction == Reduction::mean) return sum(losses) / sum(kept).to(log_probs.dtype());
  return reduce(losses, reduction);
}

Tensor binary_cross_entropy(const Tensor& probs, const Tensor& target, Reduction reduction) {
  check_same_shape("binary_cross_entropy", probs, target);
  if (probs.numel() > 0) {
    const double low = min(probs).to(DType::f64).item<double>(), high = max(probs).to(DType::f64).item<double>();
    ZG_CHECK(low >= 0 && high <= 1, "binary_cross_entropy: probabilities must lie in [0, 1], got [", low, ", ",
             high, "]; for logits use binary_cross_entropy_with_logits");
  }
  const Tensor losses = neg(target * maximum(log(probs), -100.0) + (1.0 - target) * maximum(log(1.0 - probs), -100.0));
  return reduce(losses, reduction);
}

Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target, Reduction reduction) {
  check_same_shape("binary_cross_entropy_with_logits", logits, target);
  const Tensor losses = maximum(logits, 0.0) - logits * target + log(1.0 + exp(neg(abs(logits))));
  return reduce(losses, reduction);
}

}  // namespace zg
