// The backend interface: the few primitive kernels a device must provide.
// Everything else -- broadcasting, reductions over any dims, cat/split, casts,
// composite ops, and every autograd formula -- is written once above it.
//
// Contract for every kernel: inputs are validated by the front-end (autograd/functions/*.cpp);
// outputs are allocated by the caller and contiguous unless stated; inputs of an
// elementwise kernel have exactly the output's shape but may have any strides
// (a broadcast input has stride 0 in the broadcast dims).
#pragma once

#include <cstdint>
#include <memory>

#include "tensor/activation.h"
#include "tensor/device.h"
#include "tensor/memory.h"
#include "tensor/quant_blocks.h"
#include "tensor/tensor.h"

namespace zg {

enum class UnaryOp : uint8_t {
  neg, abs, exp, log, sqrt, rsqrt, sin, cos, tanh, sigmoid, relu,
  gelu,         // GPT-2's tanh approximation
  erf,          // the error function, 2/sqrt(pi) int_0^x exp(-t^2) dt
  log1p,        // log(1 + x), accurate for small x
  logical_not,  // bool -> bool
};

enum class BinaryOp : uint8_t {
  add, sub, mul, div, pow, maximum, minimum,  // out has the inputs' dtype
  gelu_backward,  // (x, g) -> g * gelu'(x): GELU's gradient in one pass, floating only
  eq, ne, lt, le, gt, ge,                     // out is bool
  logical_and, logical_or,                    // bool x bool -> bool
};
bool is_comparison(BinaryOp op);
bool is_logical(BinaryOp op);

enum class ReduceOp : uint8_t {
  sum, mean, max, min, argmax, argmin,
  sum_of_squares,  // out in f32 (f64 for f64 input), whatever the input dtype: for gradient norms
};

enum class Distribution : uint8_t { uniform, normal };
struct RandomSpec {
  Distribution distribution = Distribution::uniform;
  double a = 0.0;  // uniform: low;  normal: mean
  double b = 1.0;  // uniform: high; normal: std
  uint64_t seed = 0;
  uint64_t first_block = 0;  // Philox counter block of element 0 (see tensor/philox.h)
  // The lane of first_block that element 0 takes (0..3), so a slice of a tensor that
  // starts mid-block is written without its neighbours: element i takes lane
  // (first_lane + i) % 4 of block first_block + (first_lane + i) / 4.
  uint32_t first_lane = 0;
};

// One AdamW step (Loshchilov & Hutter), decoupled weight decay, bias-corrected:
//   g = grad * grad_scale;  p -= lr * weight_decay * p
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// computed as p -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps), the
// constants in f64 on the host and the division by sqrt(1 - beta2^step) a product with its
// reciprocal: one division and one square root an element (DeepSpeed's CPU Adam's form).
struct AdamWStep {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  double grad_scale = 1.0;  // unscales (1 / loss scale) and clips in the same pass
  int64_t step = 1;         // 1 for the first update
  // Optional: a one-element tensor of the master's dtype and device that multiplies
  // grad_scale -- a clipping coefficient computed on the device, so the step needs no
  // host read of the gradient norm (optim::clip_coefficient_on_device).
  Tensor device_scale;
};

// What every backend's adamw checks first: master, grad, m, v (and compute, unless
// undefined or the master itself) contiguous with the master's numel; m and v in the
// master's dtype; device_scale, if given, one element of the master's dtype and device.
void check_adamw_arguments(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v,
                           const Tensor& compute, const AdamWStep& step);

// What every backend's quantize_blocks / dequantize_blocks checks first: bits 8 or 4; values
// [n] floating and q [blocks.bytes()] i8, contiguous, on one device; scales [blocks.count()]
// f32 there; block and segment positive (even at 4 bits), segment dividing n. Returns the
// blocks' layout.
QuantBlocks check_quantize_arguments(const char* op, const Tensor& values, const Tensor& q, const Tensor& scales,
                                     int bits, int64_t block, int64_t segment);

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::shared_ptr<Allocator> make_allocator(Device device) = 0;

  // Blocks the calling thread until the work this rank has issued on `device` is done
  // (the CUDA backend: its current stream). Host-side collectives call it so that other
  // ranks read finished buffers; nothing on the training hot path does.
  virtual void synchronize(Device device) { (void)device; }

  // out[i] = value.
  virtual void fill(const Tensor& out, double value) = 0;
  // out[i] = the Philox value for element i (out contiguous; RandomSpec says where i = 0 is).
  virtual void fill_random(const Tensor& out, const RandomSpec& spec) = 0;
  // dst[i] = cast(src[i]); same shape, both any strides, dtypes may differ.
  // Devices may differ when one of them is the CPU (host <-> device transfer).
  // Like every kernel that writes an operand it reads (binary's out = a), src and dst
  // are either the same elements or disjoint: Tensor::copy_ and add_ stage a source
  // that overlaps otherwise (x.copy_(x.t())).
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;

  virtual void unary(UnaryOp op, const Tensor& in, const Tensor& out) = 0;
  virtual void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  // out[i] = cond[i] ? a[i] : b[i]; cond is bool.
  virtual void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) = 0;

  // in: [M, R] contiguous; out: [M] (i64 for argmax/argmin, f32/f64 for sum_of_squares). Reduces each row.
  virtual void reduce(ReduceOp op, const Tensor& in, const Tensor& out) = 0;

  // out[b] = a[b] @ b_[b]: a [B, M, K], b [B, K, N], out [B, M, N] contiguous. Each
  // matrix of a and b is row- or column-major (unit stride in one of its two
  // dims); the batch stride may be anything, 0 included.
  virtual void matmul(const Tensor& a, const Tensor& b, const Tensor& out) = 0;

  // A linear layer in one call -- on CUDA one cuBLASLt GEMM whose epilogue adds the
  // bias and applies the activation while the tile is still in registers:
  //   pre = x weight^T + bias,   out = act(pre)
  // x [M, K], weight [N, K] contiguous; bias [N] or undefined; out [M, N] contiguous;
  // pre [M, N] is defined (and written, for the backward) only when act != none.
  // The default composes it from matmul, binary and unary.
  virtual void linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act, const Tensor& out,
                      const Tensor& pre);
  // The parameter gradients of linear(), given grad = dL/dpre [M, N] and x [M, K]:
  //   grad_weight [N, K] = grad^T x,   grad_bias [N] = sum over rows of grad
  // (on CUDA one GEMM whose epilogue also reduces the bias gradient). grad_bias may be
  // undefined: not wanted. The default composes it from matmul, copy and reduce.
  virtual void linear_weight_grad(const Tensor& grad, const Tensor& x, const Tensor& grad_weight,
                                  const Tensor& grad_bias);

  // Over the last dim of in [M, C] (contiguous): out = softmax or log_softmax.
  virtual void softmax(const Tensor& in, bool log, const Tensor& out) = 0;

  // x [M, C] contiguous; weight, bias [C] (either may be undefined);
  // out [M, C]; mean, rstd [M] in f32 (f64 for f64 input), kept for backward.
  virtual void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                          const Tensor& out, const Tensor& mean, const Tensor& rstd) = 0;

  // The residual add fused with the layer norm that reads it -- a pre-norm block's
  // h = x + attn(ln_1(x)) followed by ln_2(h) -- so the sum is normalised while it is
  // being written instead of being read back:
  //   sum = x + residual (rounded to x's dtype, as binary add),  layer_norm(sum) -> out, mean, rstd
  // x, residual, sum [M, C] contiguous; the rest as for layer_norm. The default runs
  // binary add, then layer_norm.
  virtual void add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                              double eps, const Tensor& sum, const Tensor& out, const Tensor& mean,
                              const Tensor& rstd);

  // Layer norm's backward over rows, in one pass (no [M, C] temporaries): x, grad_out,
  // grad_x [M, C] contiguous; mean, rstd [M] from the forward. With xhat = (x - mean) rstd
  // and gxhat = grad_out * weight (weight undefined: 1):
  //   grad_x = rstd (gxhat - mean_C(gxhat) - xhat mean_C(gxhat xhat))
  //   grad_weight = sum_M(grad_out xhat),  grad_bias = sum_M(grad_out)
  // grad_weight and grad_bias ([C], x's dtype, overwritten) may be undefined: not wanted.
  virtual void layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                   const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight,
                                   const Tensor& grad_bias) = 0;

  // out[i, :] = weight[indices[i], :]; weight [V, C] contiguous, indices [N] i32/i64
  // contiguous, out [N, C]. Throws on an index outside [0, V) where it can check.
  virtual void embedding(const Tensor& weight, const Tensor& indices, const Tensor& out) = 0;

  // Fused AdamW over flat spans, all [n] contiguous: master, m, v in f32 (f64 for f64
  // training; updated in place), grad in any floating dtype; compute (if defined and not master itself) receives the
  // new master rounded to its dtype in the same call -- the bf16/f16 weights the model runs with.
  virtual void adamw(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v,
                     const Tensor& compute, const AdamWStep& step) = 0;

  // Blockwise symmetric int8 or int4 (ZeRO++'s qwZ, qgZ): `in` cut into blocks of `block`
  // elements, restarting every `segment` elements (tensor/quant_blocks.h: a gather's shards;
  // n for one run of blocks, the last shorter); per block scale = max|x| / L (L = 127 at 8
  // bits, 7 at 4) and q = round(x / scale) (half away from zero), so |x - q scale| <= scale / 2,
  // packed two a byte at 4 bits. A block of zeros has scale 0. Computed in f32 (f64 for f64).
  // A non-finite element is an error: the CPU throws, naming its index; CUDA writes q = 0 and
  // a NaN scale and reports it at the next synchronisation.
  virtual void quantize_blocks(const Tensor& in, int bits, int64_t block, int64_t segment, const Tensor& q,
                               const Tensor& scales) = 0;
  // out[i] = q[i] scales[scale_of(i)], rounded to out's dtype: every shard of a gather at once.
  virtual void dequantize_blocks(const Tensor& q, const Tensor& scales, int bits, int64_t block, int64_t segment,
                                 const Tensor& out) = 0;

  // grad_weight[indices[i], :] += grad_out[i, :] (rows repeat: accumulate). Each row's
  // contributions are summed in f64 in order of i and added once (rounded once to its dtype).
  // grad_out [N, C] contiguous, indices [N], grad_weight [V, C] contiguous.
  virtual void embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) = 0;

  // indices[i, :] = the positions that sort row i of in ([M, R] contiguous, a float or integer
  // dtype) ascending or descending; indices [M, R] i64 contiguous. Stable (ties keep their
  // order), NaN above +inf as PyTorch sorts. The values are a gather of in by them.
  virtual void sort_rows(const Tensor& in, bool descending, const Tensor& indices) = 0;

  // out[i, j] = in[i, 0] + ... + in[i, j]: each row of in [M, R] scanned (cumsum). in and out
  // contiguous, of one dtype, not bool. Floats are summed in f64 on the CPU, in their compute
  // type (f32 for 16-bit) on a GPU, each prefix rounded once; integers wrap.
  virtual void cumsum_rows(const Tensor& in, const Tensor& out) = 0;

  // loss[i] = logsumexp(logits[i, :]) - logits[i, target[i]], or 0 where
  // target[i] == ignore_index; logits [N, C] contiguous, target [N] i32/i64,
  // loss [N] in f32 (f64 for f64 logits) whatever the logits' dtype.
  virtual void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                             const Tensor& loss) = 0;
  // Its backward, softmax recomputed row by row so the [N, C] probabilities are never
  // stored; the row's logsumexp comes from the forward's loss, x - lse = (x - x[t]) - loss,
  // unless the loss cannot serve (not finite, or above kCrossEntropyLossUsable, where its
  // f32 rounding error would sit in every probability's exponent): then from the row again.
  //   grad_logits[i, :] = grad_loss[i] (exp(logits[i, :] - lse_i) - onehot(target[i])),
  // and 0 on rows whose target is ignore_index. loss, grad_loss [N] in the loss dtype;
  // grad_logits [N, C] contiguous in the logits' dtype, and may be logits itself (the
  // front-end writes the gradient over logits no one reads again): a row's reads of
  // logits come before its writes.
  static constexpr double kCrossEntropyLossUsable = 1024;
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                      const Tensor& loss, const Tensor& grad_loss, const Tensor& grad_logits) = 0;

  // Fused ("flash") attention: the [T, S] scores are never stored. q [B, H, T, D],
  // k, v [B, H, S, D] and out [B, H, T, D] have unit stride in D and any other strides
  // (so [B, T, H, D] buffers pass as transposed views, no copy); stats [B, H, T] is f32
  // and contiguous. Computes
  //   out = softmax(q k^T * scale, keys j > i masked when causal) v
  //   stats[b, h, i] = logsumexp_j (q_i . k_j * scale)     (kept for the backward)
  // Returns false, touching nothing, where the device has no fused kernel for these
  // shapes and dtypes: the front-end then composes attention from matmul and softmax.
  // q, k or v requires grad exactly when attention_backward may follow (the front-end
  // passes them detached otherwise), so a backend may check its backward up front.
  virtual bool attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                         const Tensor& out, const Tensor& stats) {
    (void)q, (void)k, (void)v, (void)causal, (void)scale, (void)out, (void)stats;
    return false;
  }
  // Its backward, called only after attention() returned true for the same q, k, v:
  // dq, dk, dv from grad_out, using out and stats. The front-end allocates grad_out as a
  // fresh [B, T, H, D] buffer passed as its [B, H, T, D] view, and dq, dk, dv the same
  // way -- except where q, k, v are packed (packed_qkv below): then dq, dk, dv are the
  // thirds of one fresh [B, T, 3, H, D] buffer, laid out as q, k, v.
  virtual void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                                  const Tensor& dq, const Tensor& dk, const Tensor& dv);
};

// What a flash-attention kernel (cuDNN's scaled-dot-product attention) takes, judged from
// dtypes, sizes and layouts alone: why it cannot take q, k, v [B, H, T|S, D] and out, or
// "". The CUDA backend asks this before it asks cuDNN; the meta backend's attention()
// says yes exactly here, so a dry run's activation bytes are a GPU run's (the [B, H, T]
// statistics kept for backward, not the [B, H, T, S] probabilities of the composed path).
// cuDNN may still decline when it builds its graph -- some GPUs stop at head size 128 --
// so for D in (128, 256] a dry run can count less than such a GPU would keep.
std::string flash_attention_unsupported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out);

// Whether q, k, v [B, H, T, D] are the three thirds of one [B, T, 3, H, D]-contiguous
// buffer: GPT's projection [B, T, 3C] seen head by head (packed_attention). Flash
// attention's backward then writes dq, dk, dv into one such buffer, laid out as q, k, v
// (as llm.c does): the gradient of the projection, with no copy. The front-end (which
// allocates that buffer) and a backend (which builds its backward for those layouts
// during the forward) decide by this one rule.
bool packed_qkv(const Tensor& q, const Tensor& k, const Tensor& v);
// Why such a kernel cannot read one operand `t` (named `which` in the reason), or "".
std::string flash_attention_unreadable(const Tensor& t, const char* which);

// The backend for a device. The CPU and meta backends are built in; the CUDA
// backend registers itself when the library is built with CUDA.
Backend& backend(Device device);
void register_backend(DeviceType type, Backend* backend);
// The host pool's allocator (Context::host_allocator): page-locked memory from the CUDA
// backend when it is built in and a GPU is visible, else null (ordinary memory then).
using PinnedAllocatorFactory = std::shared_ptr<Allocator> (*)();
void register_pinned_allocator(PinnedAllocatorFactory make);
std::shared_ptr<Allocator> make_pinned_allocator();

}  // namespace zg
