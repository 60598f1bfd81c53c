#include "nn/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "autograd/functions.h"
#include "autograd/graph.h"

namespace zg::nn {

namespace {

// `cached` (the first S positions) followed by `fresh` along dim 2, written into `buffer`
// after them; the buffer doubles (from S + 1) when full. Returns the S + 1 positions' view.
// Where a gradient is to flow through the cache (grad mode on, an input requiring grad), a
// cat instead: the buffer's in-place writes would cut it.
Tensor append(Tensor& buffer, const Tensor& cached, const Tensor& fresh) {
  if (GradMode::is_enabled() && (cached.requires_grad() || fresh.requires_grad())) return cat({cached, fresh}, 2);
  const int64_t length = cached.size(2), needed = length + fresh.size(2);
  if (!buffer.defined() || buffer.size(2) < needed) {
    Shape shape = fresh.shape();
    shape[2] = std::max(needed, 2 * length);
    const Tensor grown = empty(shape, TensorOptions(fresh.dtype()).device(fresh.device()));
    grown.narrow(2, 0, length).copy_(cached);
    buffer = grown;
  }
  buffer.narrow(2, length, fresh.size(2)).copy_(fresh);
  return buffer.narrow(2, 0, needed);
}

}  // namespace

Tensor cached_attention(KVCache::Layer& layer, const Tensor& q, const Tensor& k, const Tensor& v) {
  const bool prompt = !layer.keys.defined();
  ZG_CHECK(prompt || q.size(2) == 1, "KV cache: after the prompt, one token a forward (got ", q.size(2),
           " with ", layer.keys.size(2), " cached)");
  layer.keys = prompt ? k : append(layer.key_buffer, layer.keys, k);
  layer.values = prompt ? v : append(layer.value_buffer, layer.values, v);
  return scaled_dot_product_attention(q, layer.keys, layer.values, /*causal=*/prompt);
}

namespace {

// Index of the token `u` (in [0, 1)) falls on in the distribution softmax(row) restricted
// by the options; row is one position's logits.
int64_t draw(std::vector<double> row, const SamplingOptions& o, double u) {
  const auto most_likely = static_cast<int64_t>(std::max_element(row.begin(), row.end()) - row.begin());
  if (o.temperature == 0) return most_likely;
  std::vector<int64_t> order(row.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
  size_t kept = order.size();
  if (o.top_k > 0) kept = std::min(kept, static_cast<size_t>(o.top_k));
  std::vector<double> p(kept);
  double total = 0;
  for (size_t i = 0; i < kept; ++i) total += p[i] = std::exp((row[order[i]] - row[most_likely]) / o.temperature);
  if (o.top_p < 1) {  // the fewest tokens whose probabilities reach top_p (the first always kept)
    double mass = 0;
    size_t nucleus = 0;
    while (nucleus < kept && (nucleus == 0 || mass < o.top_p * total)) mass += p[nucleus++];
    kept = nucleus, total = mass;
  }
  double at = u * total;
  for (size_t i = 0; i + 1 < kept; ++i) {
    if (at < p[i]) return order[i];
    at -= p[i];
  }
  return order[kept - 1];
}

}  // namespace

Tensor generate(CausalLM& model, const Tensor& prompt, int64_t max_new_tokens, const SamplingOptions& options) {
  const int64_t block_size = model.block_size();
  ZG_CHECK(prompt.defined() && prompt.dim() == 2 && prompt.size(1) > 0 && is_integral(prompt.dtype()),
           "generate: expected a prompt of token ids [B, T] with T > 0, got ", describe(prompt));
  ZG_CHECK(max_new_tokens >= 0, "generate: max_new_tokens must be non-negative, got ", max_new_tokens);
  const bool was_training = model.is_training();
  model.eval();
  struct Restore {
    Module& m;
    bool training;
    ~Restore() { m.train(training); }
  } restore{model, was_training};
  NoGradGuard no_grad;
  KVCache cache;
  Tensor tokens = prompt.to(DType::i64), next = tokens;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    if (cache.length() + next.size(1) > block_size) {  // past the window: its last tokens, afresh
      cache.clear();
      const int64_t keep = std::min(tokens.size(1), block_size);
      next = tokens.narrow(1, tokens.size(1) - keep, keep);
    }
    const Tensor logits = model.forward(next, cache);
    next = sample(logits.select(1, logits.size(1) - 1), options);
    tokens = cat({tokens, next}, 1);
  }
  return tokens;
}

Tensor sample(const Tensor& logits, const SamplingOptions& o) {
  ZG_CHECK(logits.defined() && logits.dim() == 2 && logits.size(1) > 0 && is_floating(logits.dtype()),
           "sample: expected logits [B, V] with V > 0, got ", describe(logits));
  ZG_CHECK(o.temperature >= 0 && o.top_k >= 0 && o.top_p > 0 && o.top_p <= 1,
           "sample: expected temperature >= 0, top_k >= 0 and top_p in (0, 1], got ", o.temperature, ", ", o.top_k,
           ", ", o.top_p);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const std::vector<double> values = logits.to(kCPU).to(DType::f64).contiguous().to_vector<double>();
  const std::vector<double> u = rand({rows}, DType::f64).to_vector<double>();  // one draw a row, always
  std::vector<int64_t> picked;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> row(values.begin() + r * vocab, values.begin() + (r + 1) * vocab);
    // As torch.multinomial refuses such probabilities: a NaN or +inf logit has no softmax,
    // and a row all -inf gives every token probability 0.
    const bool bad = std::any_of(row.begin(), row.end(), [](double x) { return std::isnan(x) || x == INFINITY; });
    ZG_CHECK(!bad && std::any_of(row.begin(), row.end(), [](double x) { return x > -INFINITY; }), "sample: row ", r,
             " of the logits ", describe(logits), bad ? " holds NaN or +inf" : " is -inf everywhere",
             ", so it gives no distribution to draw from; check the model's forward (a diverged run gives NaN)");
    picked.push_back(draw(row, o, u[r]));
  }
  return tensor<int64_t>(picked, {rows, 1}).to(logits.device());
}

}  // namespace zg::nn
