// The differentiable functions (functions/*.cpp, each forward beside its backward
// formula). Each validates its inputs (throwing zg::Error that names the op, shapes,
// dtypes and devices), works out the output's shape and dtype, allocates it, and
// calls one primitive kernel of the tensor's backend. Composite ops are built from
// the primitives here, once, for every device.
//
// Type rules are strict, so nothing is converted behind the user's back: the
// tensors of one op share a dtype and a device; scalars take the tensor's dtype.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tensor/activation.h"
#include "tensor/tensor.h"

namespace zg {

// ---- elementwise, unary ----
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
// GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Tensor gelu(const Tensor& x);
Tensor erf(const Tensor& x);
// log(1 + x), accurate for small x (a primitive: log(1 + x) composed rounds 1 + x first,
// losing x's low digits -- all of x below 1e-16 in f64).
Tensor log1p(const Tensor& x);
// The exact GELU, 0.5 x (1 + erf(x / sqrt 2)): PyTorch's default (approximate='none'),
// Hugging Face's "gelu"; composed of erf.
Tensor gelu_exact(const Tensor& x);
// grad * gelu'(x) in one kernel: GELU's backward, exposed for fused layers (not differentiable).
Tensor gelu_backward(const Tensor& x, const Tensor& grad);
Tensor logical_not(const Tensor& x);

// ---- elementwise, binary, with broadcasting ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor sub(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor maximum(const Tensor& a, double b);
Tensor minimum(const Tensor& a, double b);

// Comparisons give bool tensors.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double b);
Tensor ne(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor le(const Tensor& a, double b);
Tensor gt(const Tensor& a, double b);
Tensor ge(const Tensor& a, double b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);

// cond ? a : b, broadcasting all three; cond is bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, double a, const Tensor& b);
// x with `value` wherever mask (bool, broadcastable to x) is true.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);

Tensor operator-(const Tensor& x);
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

// ---- reductions: over `dims` (all dims when empty); keepdim leaves them as size 1 ----
Tensor sum(const Tensor& x, const Shape& dims = {}, bool keepdim = false);  // ints and bool sum to i64
Tensor mean(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor max(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor min(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);  // i64; first index of the maximum
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& x);  // index into the flattened tensor
// sum(x^2) over every element, accumulated and returned in f32 (f64 for f64): gradient norms
// of bf16/f16 buffers without an f32 copy. Not differentiable.
Tensor sum_of_squares(const Tensor& x);
// out[..., i, ...] = sum_{j <= i} x[..., j, ...] along dim, as torch.cumsum; integer and bool
// inputs sum to i64. One backend primitive (a scan of rows); the gradient is the reversed
// cumsum of the gradient.
Tensor cumsum(const Tensor& x, int64_t dim);

// ---- linear algebra ----
// Batched matrix product with NumPy broadcasting of the batch dims; trans_a / trans_b
// use the transpose of the last two dims (free: a strided view). 1-D operands are
// promoted as in torch.matmul.
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// A linear layer over the last dim of x [..., K]: act(x weight^T + bias), weight [N, K],
// bias [N] or undefined, act none or GELU (GPT-2's tanh form). One backend call
// forward (on CUDA a cuBLASLt GEMM with a bias/GELU epilogue) and a GEMM for the input
// gradient plus one for the weight's that also reduces the bias gradient.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act = Activation::none);
// GPT-2's MLP, linear(gelu(linear(x, fc_weight, fc_bias)), proj_weight, proj_bias), as one
// op that keeps only x and the pre-activation for backward: the GELU output, as large,
// is made again there (as llm.c does). A layer keeps 4C values a token fewer, for one
// elementwise pass more.
Tensor mlp(const Tensor& x, const Tensor& fc_weight, const Tensor& fc_bias, const Tensor& proj_weight,
           const Tensor& proj_bias);

// ---- neural-network primitives ----
Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);

struct LayerNormOutput {
  Tensor out;
  Tensor mean;  // x.shape[:-1], f32 (f64 for f64 input)
  Tensor rstd;  // 1 / sqrt(var + eps), same shape
};
// Normalises over the last dim: (x - mean) * rstd * weight + bias. weight and bias
// ([C]) may be undefined tensors, meaning 1 and 0.
LayerNormOutput layer_norm_with_stats(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);

// The pre-norm residual step in one kernel: sum = x + residual, out = layer_norm(sum)
// (a GPT block's h = x + attn(ln_1(x)) and ln_2(h)). Values and gradients are those of
// the two ops apart -- the sum is rounded to x's dtype before it is normalised -- but
// the sum is normalised as it is written, not read back. x and residual share shape,
// dtype and device.
struct AddLayerNormOutput {
  Tensor sum;  // x + residual
  Tensor out;  // layer_norm(sum, weight, bias, eps)
};
AddLayerNormOutput add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                                  double eps = 1e-5);

// Rows of weight [V, C] picked by integer indices of any shape: out is indices.shape + [C].
Tensor embedding(const Tensor& weight, const Tensor& indices);

// Mean over the targets != ignore_index of -log softmax(logits)[target];
// logits [..., C], target [...] (i32/i64). NaN when every target is ignored. The loss is
// f32 for 16-bit logits (f64 for f64), as under PyTorch's autocast: an f16 loss scaled
// by a GradScaler (65536) overflowed for any loss above 1, and f16 holds a loss near 3
// only to 0.002.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100);

// softmax(q k^T / sqrt(D)) v over the last two dims, batched over the rest; `causal`
// masks key j > query i. q [..., T, D], k [..., S, D], v [..., S, Dv] -> [..., T, Dv].
// Grouped-query attention: k and v [..., H_kv, S, D] with H_kv dividing q's H heads
// ([..., H, T, D]); query head h reads key head h / (H / H_kv), as in Llama 2/3.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal);
// Grouped-query attention's keys or values [..., H_kv, S, D] repeated to H heads, contiguous
// (what the fused kernels read): head h is head h / (H / H_kv). Their gradient sums the repeats.
Tensor repeat_heads(const Tensor& kv, int64_t heads);
// The same over GPT's packed projection: qkv [B, T, 3C] holds q, k and v side by side,
// each C = heads * D wide -> [B, T, C], the heads side by side. Equal to splitting qkv
// into [B, H, T, D] heads and calling the above, as one op: its gradient is one
// [B, T, 3C] buffer (split's backward builds three, zero-filled, and adds them).
Tensor packed_attention(const Tensor& qkv, int64_t heads, bool causal);

// ---- joining and splitting ----
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);  // views; the last may be shorter
std::vector<Tensor> split(const Tensor& x, const Shape& sizes, int64_t dim = 0);   // views of the given sizes
// Tensors of one shape joined along a new dim `dim` (in [-(rank + 1), rank]).
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// `chunks` views along dim, each ceil(size / chunks) long (the last shorter; fewer parts
// when the size runs out first), as torch.chunk.
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
// The slices x.select(dim, i) for every i, as torch.unbind.
std::vector<Tensor> unbind(const Tensor& x, int64_t dim = 0);

// ---- indexing (functions/indexing.cpp: rows through embedding and its scatter-add) ----
// x's slices at `index` (1-D, i32/i64) along dim: out.shape[dim] = index.numel().
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// out[i][j][k] = x[i][index[i][j][k]][k] for dim 1 (likewise for any dim), as torch.gather:
// index has x's rank and no dim larger than x's except `dim`; out has index's shape.
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// x with src added at `index` along dim (torch.scatter_add: out[i][index[i][j][k]][k] +=
// src[i][j][k] for dim 1); index and src share a shape. Repeated indices accumulate.
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// i64 [..., num_classes]: 1 where the class is the index. num_classes -1: max(indices) + 1.
Tensor one_hot(const Tensor& indices, int64_t num_classes = -1);
// x sorted along dim, stably (ties keep their order; NaN above +inf), and the i64 positions
// the values came from. The values are gather(x, dim, indices): their gradient scatters back.
struct SortResult {
  Tensor values, indices;
};
SortResult sort(const Tensor& x, int64_t dim = -1, bool descending = false);
// The k largest (smallest) along dim, largest (smallest) first, as torch.topk.
SortResult topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true);
// num_samples category indices (i64) for each row of probs ([C] or [B, C]: non-negative,
// finite weights, each row's sum > 0, normalised or not), drawn from the rank's generator:
// without replacement distinct categories (Gumbel-top-k: the keys log p - log(-log u)),
// with replacement independent draws (the largest key, afresh each time). As torch.multinomial.
Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement = false);

// ---- rearranging (functions/rearrange.cpp, composed: gradients follow from the parts) ----
// x with the order of each of `dims` reversed, as torch.flip (floating x: an index_select).
Tensor flip(const Tensor& x, const Shape& dims);
// x tiled repeats[i] times along dim i, as Tensor.repeat: repeats has at least x's rank,
// and x is first given leading size-1 dims up to it. out.shape[i] = repeats[i] * shape[i].
Tensor repeat(const Tensor& x, const Shape& repeats);
// As torch.nn.functional.pad: `pad` holds (before, after) pairs from the last dim
// backward, (left, right, top, bottom, ...). constant fills with `value` (a negative pad
// crops); reflect mirrors x without repeating its edge (pad < size); replicate repeats the edge.
enum class PadMode { constant, reflect, replicate };
Tensor pad(const Tensor& x, const Shape& pad, PadMode mode = PadMode::constant, double value = 0.0);
// Einstein summation over operands of one dtype and device, as torch.einsum:
// "ij,jk->ik" (matmul), "bij,bjk->bik", "ij->ji", "ij->" (sum), "i,j->ij" (outer),
// "ij,ij->i"; without "->" the output is the letters used once, in alphabetical order.
// Each pair of operands is contracted as one batched matmul (permute and reshape around
// it). Refused: a letter repeated within one operand (traces, diagonals) and "..." (ellipsis).
Tensor einsum(const std::string& equation, const std::vector<Tensor>& operands);

// ---- composed from the ops above (functions/composite.cpp; gradients follow from theirs) ----
Tensor silu(const Tensor& x);  // x sigmoid(x), Llama's MLP activation ("swish")
// x limited to [low, high]; the gradient is 1 inside and 0 where x was clamped; NaN stays.
Tensor clamp(const Tensor& x, double low, double high);
// log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (torch's F.softplus).
Tensor softplus(const Tensor& x, double beta = 1.0, double threshold = 20.0);
// x where x > 0, negative_slope * x elsewhere (F.leaky_relu).
Tensor leaky_relu(const Tensor& x, double negative_slope = 0.01);
// The vector p-norm over dims (all when empty), as torch.linalg.vector_norm: (sum |x|^p)^(1/p)
// for p > 0, max |x| for p = inf, min |x| for -inf, the count of non-zeros for p = 0. The
// gradient at a zero norm is 0 (not 0/0), as PyTorch's.
Tensor norm(const Tensor& x, double p = 2.0, const Shape& dims = {}, bool keepdim = false);
// x / max(norm(x, p, {dim}, true), eps), as F.normalize.
Tensor normalize(const Tensor& x, double p = 2.0, int64_t dim = 1, double eps = 1e-12);
// Bool tensors: where x is NaN; where x is +-inf (never, for integer x).
Tensor isnan(const Tensor& x);
Tensor isinf(const Tensor& x);
// Bool: whether any (all) elements over dims (all when empty) are non-zero, as torch.any / torch.all.
Tensor any(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor all(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
// log sum exp over dims (all when empty), with the max taken out first: finite for any finite x.
Tensor logsumexp(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
// The variance over dims, divided by N - correction (1: the unbiased estimate, as torch.var).
Tensor var(const Tensor& x, const Shape& dims = {}, bool keepdim = false, int64_t correction = 1);
Tensor std(const Tensor& x, const Shape& dims = {}, bool keepdim = false, int64_t correction = 1);
// The lower (upper) triangle of the last two dims: elements with j - i <= diagonal (>=) kept, the rest 0.
Tensor tril(const Tensor& x, int64_t diagonal = 0);
Tensor triu(const Tensor& x, int64_t diagonal = 0);
// x / sqrt(mean(x^2 over the last dim) + eps) * weight (Zhang and Sennrich 2019, Llama's
// norm); 16-bit x is normalised in f32 and rounded back before the weight, as in Llama.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
// Rotary position embedding (Su et al. 2021) over x [..., T, D], D even, in the
// "rotate half" layout of Llama and Hugging Face: position p = offset + t, frequency
// f_i = theta^(-2i/D) for i < D/2, and with x = (x1, x2) halves,
//   out = x cos(p f) + (-x2, x1) sin(p f)       (cos, sin repeated over both halves)
Tensor rotary_embedding(const Tensor& x, int64_t offset = 0, double theta = 10000.0);
// The same with the cos and sin tables made once ([T, D], x's dtype and device), for a
// model that rotates every layer's q and k at the same positions.
struct RotaryTables {
  Tensor cos, sin;
};
RotaryTables rotary_tables(int64_t offset, int64_t length, int64_t dim, double theta, TensorOptions options);
// The same with the frequencies given (D/2 of them; a scaled rope adjusts theta's).
RotaryTables rotary_tables(int64_t offset, int64_t length, const std::vector<double>& frequencies,
                           TensorOptions options);
Tensor rotary_embedding(const Tensor& x, const RotaryTables& tables);

// In training, zeroes each element with probability p and scales the rest by 1/(1-p)
// (a 16-bit x scaled in f32 and rounded once); the mask comes from the rank's Philox
// generator, so a run is reproducible and activation checkpointing replays it.
// Identity when not training or p = 0.
Tensor dropout(const Tensor& x, double p, bool training = true);
// dropout(x, p, training) of a whole x cut into `parts` equal pieces along `dim`, on piece
// `part` (x_part): the whole op's mask elements of that piece, from the same generator
// state, which then moves past the whole draw -- so every later random op matches the
// uncut run. Tensor parallelism draws its masks so (a sequence shard's rows, a rank's heads
// of the attention probabilities). Errors name `op`.
Tensor dropout_part(const Tensor& x_part, double p, bool training, int64_t dim, int part, int parts,
                    const char* op = "dropout_part");
// The same for a rank holding several pieces `held` of `parts` along `dim`, side by side in
// that order (context parallelism's load-balanced chunks of a sequence).
Tensor dropout_pieces(const Tensor& x, double p, bool training, int64_t dim, const std::vector<int>& held, int parts,
                      const char* op = "dropout_pieces");
// Attention with dropout on its probabilities (nanoGPT's and Hugging Face GPT-2's attn_dropout):
// softmax(q k^T / sqrt(D) [causal mask]) dropped, then times v, composed of the ops above (the
// fused kernels keep no probabilities to drop); with p = 0 or not training, the fused op.
// q, k, v [.., H, T, D] may be heads `head_part` of `head_parts` equal groups of the whole
// attention's (tensor parallelism): the probabilities then draw that group's mask.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double dropout_p,
                                    bool training = true, int head_part = 0, int head_parts = 1);

// ---- losses; reduction: the mean (default), the sum, or none (per element) ----
enum class Reduction { mean, sum, none };
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::mean);
// -log_probs[..., target] over targets != ignore_index; log_probs [..., C], target [...].
// The mean is over the targets kept (NaN when none is), as torch.nn.functional.nll_loss.
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index = -100,
                Reduction reduction = Reduction::mean);
// -(t log p + (1 - t) log(1 - p)), each log floored at -100 as PyTorch does; p in [0, 1].
Tensor binary_cross_entropy(const Tensor& probs, const Tensor& target, Reduction reduction = Reduction::mean);
// The same of sigmoid(logits), computed stably: max(x, 0) - x t + log(1 + exp(-|x|)).
Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target,
                                        Reduction reduction = Reduction::mean);

}  // namespace zg
