// Row kernels of the neural-network primitives: softmax, layer norm, embedding
// and cross-entropy (each forward and backward). Softmax and cross-entropy rows are
// long (a block each), layer norm's short (a warp each); elementwise results are
// rounded once to the output dtype. Statistics and results are computed in the compute
// type C -- f32 for f32, bf16 and f16, f64 for f64 -- as the elementwise kernels do
// (the parameter-gradient sums of layer norm and embedding are f64 for every dtype, so
// they are deterministic and equal the CPU's):
// softmax and cross-entropy take an exp per element of rows as long as the vocabulary,
// and an f64 exp costs some 30 f64 operations, which by estimate made GPT-2's
// cross-entropy compute-bound on an H100 (about 3 ms a step, against 1 ms of memory
// traffic). The CPU works in f64: the two agree to f32 rounding.
#include <climits>
#include <cmath>

#include <cub/device/device_radix_sort.cuh>

#include "cuda/backend.h"
#include "cuda/deferred_errors.h"
#include "cuda/kernels.cuh"
#include "cuda/online_lse.h"

namespace zg::cuda {

namespace {

template <class T>
__device__ __forceinline__ double load(const T* p, int64_t j) {
  return static_cast<double>(widen(p[j]));
}

// A row's log(sum(exp(row))) as two parts, lse = max + log_total with log_total =
// log(sum_j exp(row_j - max)), by the whole block, in C (as on the CPU in f64:
// tensor/cpu/nn.cpp). x - lse is formed as (x - max) - log_total: added up first, max +
// log_total loses log_total where |max| is large. A NaN or +inf in the row makes the
// whole row NaN.
template <class C>
struct RowLse {
  C max, log_total;
  __device__ C shifted(C x) const { return (x - max) - log_total; }  // x - lse
};

struct Merge {
  template <class C>
  __device__ OnlineLse<C> operator()(const OnlineLse<C>& a, const OnlineLse<C>& b) const { return a.merged(b); }
};

// One read of the row (cuda/online_lse.h): each thread folds its elements, the block's
// tree merges the threads'.
template <class T, class C = acc_t<T>>
__device__ RowLse<C> row_lse(const T* row, int64_t length) {
  OnlineLse<C> folded;
  for_row(row, length, [&](int64_t, T x) { folded.add(widen(x)); });
  folded = block_reduce(folded, Merge{});
  return {folded.max, folded.log_sum()};
}

// softmax(x)_j = exp(x_j - lse(x)),  log_softmax(x)_j = x_j - lse(x)  (RowLse::shifted).
template <class T>
__global__ void softmax_kernel(const T* x, T* y, int64_t rows, int64_t length, bool log_output) {
  using C = acc_t<T>;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = x + row * length;
    T* out = y + row * length;
    const RowLse<C> lse = row_lse(in, length);
    map_row(in, out, length, [&](int64_t, T x) {
      const C shifted = lse.shifted(C(widen(x)));
      return convert<T>(log_output ? shifted : math_exp(shifted));
    });
  }
}

// mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rstd = 1 / sqrt(var + eps),
// out = (x - mean) * rstd * weight + bias;  mean and rstd kept (S: f32, f64 for f64).
// With a residual (add_layer_norm), the row normalised is x + residual: the first pass
// writes it to `sum`, rounded as binary add rounds it, and the later passes read it back
// from there (each lane reads only the packs it wrote, so no barrier is needed).
// Lane l of the row's warp takes packs l, l + 32, ... of V elements (V = kPack<T>: 16-byte
// loads, where every row and vector is whole aligned packs; else V = 1).
template <class T, class S, int V>
__global__ void layer_norm_kernel(const T* x, const T* residual, T* sum, const T* weight, const T* bias, double eps,
                                  T* y, S* mean, S* rstd, int64_t rows, int64_t channels) {
  using C = acc_t<T>;
  using P = Pack<T, V>;
  const int lane = warp_lane();
  const int64_t packs = channels / V;
  const P* w = reinterpret_cast<const P*>(weight);
  const P* b = reinterpret_cast<const P*>(bias);
  for (int64_t row = warp_row(); row < rows; row += warp_row_stride()) {
    const P* x_row = reinterpret_cast<const P*>(x + row * channels);
    P* out = reinterpret_cast<P*>(y + row * channels);
    C total = 0;
    if (residual) {
      const P* r_row = reinterpret_cast<const P*>(residual + row * channels);
      P* s_row = reinterpret_cast<P*>(sum + row * channels);
      for (int64_t p = lane; p < packs; p += kWarp) {
        const P a = x_row[p], r = r_row[p];
        P added;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          added.v[k] = convert<T>(widen(a.v[k]) + widen(r.v[k]));
          total += widen(added.v[k]);
        }
        s_row[p] = added;
      }
    } else {
      for (int64_t p = lane; p < packs; p += kWarp) {
        const P a = x_row[p];
#pragma unroll
        for (int k = 0; k < V; ++k) total += widen(a.v[k]);
      }
    }
    const P* in = residual ? reinterpret_cast<const P*>(sum + row * channels) : x_row;
    const C mu = warp_reduce(total, Add{}) / static_cast<C>(channels);
    C squares = 0;
    for (int64_t p = lane; p < packs; p += kWarp) {
      const P a = in[p];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const C d = widen(a.v[k]) - mu;
        squares += d * d;
      }
    }
    const C r = C(1) / math_sqrt(warp_reduce(squares, Add{}) / static_cast<C>(channels) + static_cast<C>(eps));
    for (int64_t p = lane; p < packs; p += kWarp) {
      const P a = in[p];
      P o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        C v = (widen(a.v[k]) - mu) * r;
        if (w) v *= widen(w[p].v[k]);
        if (b) v += widen(b[p].v[k]);
        o.v[k] = convert<T>(v);
      }
      out[p] = o;
    }
    if (lane == 0) {
      mean[row] = static_cast<S>(mu);
      rstd[row] = static_cast<S>(r);
    }
  }
}

// Layer norm backward, the part per row (one warp each, packs as in the forward): with
// xhat = (x - mean) rstd and gxhat = g w,
//   dx = rstd (gxhat - mean_C(gxhat) - xhat mean_C(gxhat xhat)).
template <class T, class S, int V>
__global__ void layer_norm_backward_kernel(const T* grad_out, const T* x, const T* weight, const S* mean,
                                           const S* rstd, T* grad_x, int64_t rows, int64_t channels) {
  using C = acc_t<T>;
  using P = Pack<T, V>;
  const int lane = warp_lane();
  const int64_t packs = channels / V;
  const P* w = reinterpret_cast<const P*>(weight);
  for (int64_t row = warp_row(); row < rows; row += warp_row_stride()) {
    const P* g = reinterpret_cast<const P*>(grad_out + row * channels);
    const P* in = reinterpret_cast<const P*>(x + row * channels);
    const C mu = static_cast<C>(mean[row]), r = static_cast<C>(rstd[row]);
    C sum_gxhat = 0, sum_gxhat_xhat = 0;
    for (int64_t p = lane; p < packs; p += kWarp) {
      const P gp = g[p], xp = in[p];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const C gxhat = widen(gp.v[k]) * (w ? widen(w[p].v[k]) : C(1));
        sum_gxhat += gxhat;
        sum_gxhat_xhat += gxhat * (widen(xp.v[k]) - mu) * r;
      }
    }
    const C mean_gxhat = warp_reduce(sum_gxhat, Add{}) / static_cast<C>(channels);
    const C mean_gxhat_xhat = warp_reduce(sum_gxhat_xhat, Add{}) / static_cast<C>(channels);
    P* out = reinterpret_cast<P*>(grad_x + row * channels);
    for (int64_t p = lane; p < packs; p += kWarp) {
      const P gp = g[p], xp = in[p];
      P o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const C gxhat = widen(gp.v[k]) * (w ? widen(w[p].v[k]) : C(1)), xhat = (widen(xp.v[k]) - mu) * r;
        o.v[k] = convert<T>(r * (gxhat - mean_gxhat - xhat * mean_gxhat_xhat));
      }
      out[p] = o;
    }
  }
}

// Layer norm backward, the parameters' part: dw = sum_M(g xhat), db = sum_M(g), in two
// deterministic stages. Stage 1: block (c-tile, chunk) sums its chunk of rows for each
// channel c into partial[chunk, c] (threads walk channels, so every load is coalesced).
template <class T, class S>
__global__ void layer_norm_param_partials_kernel(const T* grad_out, const T* x, const S* mean, const S* rstd,
                                                 double* partial_dw, double* partial_db, int64_t rows,
                                                 int64_t channels, int64_t rows_per_chunk) {
  const int64_t c = blockIdx.x * int64_t{kThreads} + threadIdx.x, chunk = blockIdx.y;
  if (c >= channels) return;
  double dw = 0, db = 0;
  const int64_t end = (chunk + 1) * rows_per_chunk < rows ? (chunk + 1) * rows_per_chunk : rows;
  for (int64_t row = chunk * rows_per_chunk; row < end; ++row) {
    const double g = load(grad_out, row * channels + c);
    dw += g * (load(x, row * channels + c) - static_cast<double>(mean[row])) * static_cast<double>(rstd[row]);
    db += g;
  }
  partial_dw[chunk * channels + c] = dw;
  partial_db[chunk * channels + c] = db;
}

// Stage 2: dw[c] = sum over chunks of partial_dw[chunk, c] (likewise db), rounded once to T.
// A block takes 8 channels and splits the chunks among 32 lanes of them (lane y sums chunks
// y, y + 32, ...: short chains of loads, many in flight, where one thread a channel would walk
// all 512 chunks alone); lane 0 then adds the lanes' sums in order, so the result does not
// depend on timing.
constexpr int kParamSumChannels = 8, kParamSumLanes = kThreads / kParamSumChannels;
template <class T>
__global__ void layer_norm_param_sum_kernel(const double* partial_dw, const double* partial_db, T* grad_weight,
                                            T* grad_bias, int64_t chunks, int64_t channels) {
  __shared__ double lane_dw[kParamSumLanes][kParamSumChannels], lane_db[kParamSumLanes][kParamSumChannels];
  const int x = static_cast<int>(threadIdx.x % kParamSumChannels), y = static_cast<int>(threadIdx.x / kParamSumChannels);
  const int64_t c = blockIdx.x * int64_t{kParamSumChannels} + x;
  double dw = 0, db = 0;
  if (c < channels) {
    for (int64_t k = y; k < chunks; k += kParamSumLanes) {
      dw += partial_dw[k * channels + c];
      db += partial_db[k * channels + c];
    }
  }
  lane_dw[y][x] = dw;
  lane_db[y][x] = db;
  __syncthreads();
  if (y != 0 || c >= channels) return;
  for (int lane = 1; lane < kParamSumLanes; ++lane) {
    dw += lane_dw[lane][x];
    db += lane_db[lane][x];
  }
  if (grad_weight) grad_weight[c] = convert<T>(dw);
  if (grad_bias) grad_bias[c] = convert<T>(db);
}

// out[i, c] = weight[indices[i], c]. A bad index gives a zero row and a deferred error.
template <class T, class I>
__global__ void embedding_kernel(const T* weight, const I* indices, T* out, int64_t n, int64_t vocab, int64_t channels,
                                 DeferredError* error) {
  for (int64_t e = grid_index(); e < n * channels; e += grid_stride()) {
    const int64_t i = e / channels, c = e % channels;
    const int64_t row = static_cast<int64_t>(indices[i]);
    if (row < 0 || row >= vocab) {
      out[e] = convert<T>(0.0);
      if (c == 0) record_deferred_error(error, DeferredErrorKind::embedding_index, row, vocab);
    } else {
      out[e] = weight[row * channels + c];
    }
  }
}

// Embedding backward, deterministic and parallel: the positions 0..n-1 are radix-sorted
// by their index (stable, so each row's positions stay in order of i), which makes the
// contributions to one row a contiguous segment of the sorted list. Then thread
// (segment start s, channel c) sums grad_out[position, c] over its segment in f64 and
// adds the sum to grad_weight[row, c] once -- exactly what the CPU backend does, so the
// two agree bit for bit; no atomics, and every row is written by one thread a channel.
template <class I>
__global__ void iota_kernel(I* values, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) values[i] = static_cast<I>(i);
}

// grid: x = channel tiles, y = sorted positions (the block exits unless its position starts a segment).
template <class T, class I>
__global__ void embedding_backward_kernel(const T* grad_out, const I* sorted_rows, const I* sorted_positions,
                                          T* grad_weight, int64_t n, int64_t vocab, int64_t channels,
                                          DeferredError* error) {
  const int64_t c = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  for (int64_t s = blockIdx.y; s < n; s += gridDim.y) {
    const I row = sorted_rows[s];
    if (s > 0 && sorted_rows[s - 1] == row) continue;  // not the start of its row's segment
    if (row < 0 || row >= vocab) {
      if (c == 0) record_deferred_error(error, DeferredErrorKind::embedding_backward_index, row, vocab);
      continue;
    }
    if (c >= channels) continue;
    double total = 0;
    for (int64_t k = s; k < n && sorted_rows[k] == row; ++k)
      total += load(grad_out, static_cast<int64_t>(sorted_positions[k]) * channels + c);
    T& w = grad_weight[static_cast<int64_t>(row) * channels + c];
    w = convert<T>(static_cast<double>(widen(w)) + total);
  }
}

// loss_i = lse(logits_i) - logits_i[t_i], 0 where t_i == ignore_index, NaN (and a
// deferred error) where t_i is outside [0, classes).
template <class T, class I, class Loss>
__global__ void cross_entropy_kernel(const T* logits, const I* target, Loss* loss, int64_t rows, int64_t classes,
                                     int64_t ignore_index, DeferredError* error) {
  using C = acc_t<T>;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = static_cast<int64_t>(target[row]);  // the same for the whole block
    if (t == ignore_index) {
      if (threadIdx.x == 0) loss[row] = Loss(0);
      continue;
    }
    if (t < 0 || t >= classes) {
      if (threadIdx.x == 0) {
        loss[row] = Loss(NAN);
        record_deferred_error(error, DeferredErrorKind::cross_entropy_target, t, classes);
      }
      continue;
    }
    const T* x = logits + row * classes;
    const RowLse<C> lse = row_lse(x, classes);
    if (threadIdx.x == 0) loss[row] = static_cast<Loss>(-lse.shifted(C(widen(x[t]))));
  }
}

// Cross-entropy backward, one block per row, the softmax recomputed from the loss, which
// holds lse - x[t]: x_j - lse = (x_j - x[t]) - loss (Backend::cross_entropy_backward). So
// the row is read once and written once, and the [N, C] probabilities never exist:
//   dx_j = g (exp(x_j - lse) - [j == t]),   dx = 0 on ignored rows.
// A target out of range gives a NaN row and a deferred error, as the CPU throws: the
// forward checked the targets, but their bytes may have been written since.
// grad_logits may be logits itself: every thread reads x[t] (and the row's stats) before
// a barrier, and each then writes only the elements it read.
template <class T, class I, class Loss>
__global__ void cross_entropy_backward_kernel(const T* logits, const I* target, const Loss* loss,
                                              const Loss* grad_loss, T* grad_logits, int64_t rows, int64_t classes,
                                              int64_t ignore_index, DeferredError* error) {
  using C = acc_t<T>;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = static_cast<int64_t>(target[row]);
    const T* x = logits + row * classes;
    T* dx = grad_logits + row * classes;
    if (t == ignore_index) {
      for (int64_t j = threadIdx.x; j < classes; j += kThreads) dx[j] = convert<T>(C(0));
      continue;
    }
    const bool valid = t >= 0 && t < classes;
    if (!valid && threadIdx.x == 0)
      record_deferred_error(error, DeferredErrorKind::cross_entropy_backward_target, t, classes);
    const C g = static_cast<C>(grad_loss[row]);
    const C target_logit = valid ? C(widen(x[t])) : C(NAN), loss_row = static_cast<C>(loss[row]);
    RowLse<C> lse{target_logit, loss_row};
    // Where the loss cannot serve (Backend::kCrossEntropyLossUsable; x[t] = -inf makes it
    // inf), read the row again: the branch is the same for the whole block, which row_lse needs.
    if (valid && !(isfinite(target_logit) && math_abs(loss_row) <= C(Backend::kCrossEntropyLossUsable)))
      lse = row_lse(x, classes);
    __syncthreads();  // x[t] is read by all before the thread owning j = t overwrites it
    map_row(x, dx, classes, [&](int64_t j, T x_j) {
      return convert<T>(g * (math_exp(lse.shifted(C(widen(x_j)))) - (j == t ? C(1) : C(0))));
    });
  }
}

// body.template operator()<T>() for the floating dtypes; throws for the others.
template <class Body>
void with_float(DType dtype, const char* op, Body&& body) {
  dispatch_device(dtype, [&]<class T>() {
    if constexpr (is_float_v<T>) body.template operator()<T>();
    else fail(op, ": not defined for ", name(dtype));
  });
}

template <class Body>
void with_index(DType dtype, const char* op, Body&& body) {
  if (dtype == DType::i64) return body.template operator()<int64_t>();
  if (dtype == DType::i32) return body.template operator()<int32_t>();
  fail(op, ": indices must be i32 or i64, got ", name(dtype));
}

void require_contiguous(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    if (t->defined()) ZG_CHECK(t->is_contiguous(), op, ": expected a contiguous tensor, got a strided ", describe(*t));
}

}  // namespace

void CudaBackend::softmax(const Tensor& in, bool log, const Tensor& out) {
  require_contiguous("softmax", {&in, &out});
  const int64_t rows = in.size(0), length = in.size(1);
  OnDevice on(in.device());
  with_float(in.dtype(), "softmax", [&]<class T>() {
    if (rows == 0) return;
    softmax_kernel<T><<<blocks_for_rows(rows), kThreads, 0, on.stream>>>(device_ptr<const T>(in), device_ptr<T>(out),
                                                                         rows, length, log);
    ZG_CUDA_CHECK_LAUNCH();
  });
}

namespace {

// Launches layer_norm_kernel; residual and sum undefined for a plain layer norm.
void launch_layer_norm(const char* op, const Tensor& x, const Tensor& residual, const Tensor& sum,
                       const Tensor& weight, const Tensor& bias, double eps, const Tensor& out, const Tensor& mean,
                       const Tensor& rstd) {
  require_contiguous(op, {&x, &residual, &sum, &weight, &bias, &out, &mean, &rstd});
  const int64_t rows = x.size(0), channels = x.size(1);
  OnDevice on(x.device());
  with_float(x.dtype(), op, [&]<class T>() {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    ZG_CHECK(mean.dtype() == dtype_of<S>() && rstd.dtype() == dtype_of<S>(), op, ": mean and rstd must be ",
             name(dtype_of<S>()), " for ", describe(x), ", got ", describe(mean), " and ", describe(rstd));
    if (rows == 0) return;
    auto optional = [](const Tensor& t) { return t.defined() ? device_ptr<const T>(t) : nullptr; };
    const T* in = device_ptr<const T>(x);
    T* added = sum.defined() ? device_ptr<T>(sum) : nullptr;
    T* y = device_ptr<T>(out);
    const bool packed = whole_packs<T>(channels, in, optional(residual), added, optional(weight), optional(bias), y);
    (packed ? layer_norm_kernel<T, S, kPack<T>> : layer_norm_kernel<T, S, 1>)<<<blocks_for_warp_rows(rows), kThreads, 0,
                                                                               on.stream>>>(
        in, optional(residual), added, optional(weight), optional(bias), eps, y, device_ptr<S>(mean),
        device_ptr<S>(rstd), rows, channels);
    ZG_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void CudaBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                             const Tensor& mean, const Tensor& rstd) {
  launch_layer_norm("layer_norm", x, Tensor(), Tensor(), weight, bias, eps, out, mean, rstd);
}

void CudaBackend::add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                                 double eps, const Tensor& sum, const Tensor& out, const Tensor& mean,
                                 const Tensor& rstd) {
  launch_layer_norm("add_layer_norm", x, residual, sum, weight, bias, eps, out, mean, rstd);
}

void CudaBackend::layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                      const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                      const Tensor& grad_weight, const Tensor& grad_bias) {
  require_contiguous("layer_norm_backward", {&grad_out, &x, &weight, &mean, &rstd, &grad_x, &grad_weight, &grad_bias});
  const int64_t rows = x.size(0), channels = x.size(1);
  OnDevice on(x.device());
  with_float(x.dtype(), "layer_norm_backward", [&]<class T>() {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    ZG_CHECK(mean.dtype() == dtype_of<S>() && rstd.dtype() == dtype_of<S>(), "layer_norm_backward: mean and rstd must be ",
             name(dtype_of<S>()), " for ", describe(x), ", got ", describe(mean), " and ", describe(rstd));
    if (rows > 0) {
      const T* g = device_ptr<const T>(grad_out);
      const T* in = device_ptr<const T>(x);
      const T* w = weight.defined() ? device_ptr<const T>(weight) : nullptr;
      T* dx = device_ptr<T>(grad_x);
      const bool packed = whole_packs<T>(channels, g, in, w, dx);
      (packed ? layer_norm_backward_kernel<T, S, kPack<T>> : layer_norm_backward_kernel<T, S, 1>)<<<
          blocks_for_warp_rows(rows), kThreads, 0, on.stream>>>(g, in, w, device_ptr<const S>(mean),
                                                                device_ptr<const S>(rstd), dx, rows, channels);
      ZG_CUDA_CHECK_LAUNCH();
    }
    if (!grad_weight.defined() && !grad_bias.defined()) return;
    if (rows == 0) {
      for (const Tensor* p : {&grad_weight, &grad_bias})
        if (p->defined()) fill(*p, 0.0);
      return;
    }
    // About 32 rows per chunk, at most 512 chunks: enough blocks to fill the GPU, and
    // partials (2 x chunks x C doubles) that stay small.
    const int64_t chunks = std::min<int64_t>((rows + 31) / 32, 512), rows_per_chunk = (rows + chunks - 1) / chunks;
    const Tensor partials = empty({2, chunks, channels}, TensorOptions(DType::f64).device(x.device()));
    double* partial_dw = device_ptr<double>(partials);
    double* partial_db = partial_dw + chunks * channels;
    const dim3 grid(static_cast<unsigned>((channels + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
    layer_norm_param_partials_kernel<T, S><<<grid, kThreads, 0, on.stream>>>(
        device_ptr<const T>(grad_out), device_ptr<const T>(x), device_ptr<const S>(mean), device_ptr<const S>(rstd),
        partial_dw, partial_db, rows, channels, rows_per_chunk);
    ZG_CUDA_CHECK_LAUNCH();
    layer_norm_param_sum_kernel<T><<<static_cast<unsigned>((channels + kParamSumChannels - 1) / kParamSumChannels),
                                     kThreads, 0, on.stream>>>(
        partial_dw, partial_db, grad_weight.defined() ? device_ptr<T>(grad_weight) : nullptr,
        grad_bias.defined() ? device_ptr<T>(grad_bias) : nullptr, chunks, channels);
    ZG_CUDA_CHECK_LAUNCH();
  });
}

// Index checks: the indices live on the GPU, and reading them on the host would
// cost a synchronisation per call; a bad index is reported as a deferred error
// instead (cuda/deferred_errors.h): at the next copy to the host, as a zg::Error.
void CudaBackend::embedding(const Tensor& weight, const Tensor& indices, const Tensor& out) {
  require_contiguous("embedding", {&weight, &indices, &out});
  const int64_t vocab = weight.size(0), channels = weight.size(1), n = indices.numel();
  OnDevice on(weight.device());
  DeferredError* error = deferred_error_record(on.device);
  dispatch_device(weight.dtype(), [&]<class T>() {
    with_index(indices.dtype(), "embedding", [&]<class I>() {
      if (n * channels == 0) return;
      embedding_kernel<T, I><<<blocks_for(n * channels), kThreads, 0, on.stream>>>(
          device_ptr<const T>(weight), device_ptr<const I>(indices), device_ptr<T>(out), n, vocab, channels, error);
      ZG_CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) {
  require_contiguous("embedding_backward", {&grad_out, &indices, &grad_weight});
  ZG_CHECK(grad_out.dtype() == grad_weight.dtype(), "embedding_backward: dtypes differ: ", describe(grad_out), " and ",
           describe(grad_weight));
  const int64_t vocab = grad_weight.size(0), channels = grad_weight.size(1), n = indices.numel();
  OnDevice on(grad_weight.device());
  DeferredError* error = deferred_error_record(on.device);
  with_float(grad_weight.dtype(), "embedding_backward", [&]<class T>() {
    with_index(indices.dtype(), "embedding_backward", [&]<class I>() {
      if (n * channels == 0) return;
      ZG_CHECK(n <= INT_MAX, "embedding_backward: ", n, " indices are more than one sort takes");
      // Sort (index, position) pairs by index; CUB's temporary storage from the allocator.
      const TensorOptions index_options = TensorOptions(indices.dtype()).device(on.device);
      const Tensor positions = empty({n}, index_options), sorted_rows = empty({n}, index_options),
                   sorted_positions = empty({n}, index_options);
      iota_kernel<I><<<blocks_for(n), kThreads, 0, on.stream>>>(device_ptr<I>(positions), n);
      ZG_CUDA_CHECK_LAUNCH();
      size_t temp_bytes = 0;
      ZG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, device_ptr<const I>(indices),
                                                    device_ptr<I>(sorted_rows), device_ptr<const I>(positions),
                                                    device_ptr<I>(sorted_positions), static_cast<int>(n), 0,
                                                    static_cast<int>(sizeof(I) * 8), on.stream));
      const Tensor temp = empty({static_cast<int64_t>(std::max<size_t>(temp_bytes, 1))},
                                TensorOptions(DType::boolean).device(on.device));
      ZG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, device_ptr<const I>(indices),
                                                    device_ptr<I>(sorted_rows), device_ptr<const I>(positions),
                                                    device_ptr<I>(sorted_positions), static_cast<int>(n), 0,
                                                    static_cast<int>(sizeof(I) * 8), on.stream));
      const dim3 grid(static_cast<unsigned>((channels + kThreads - 1) / kThreads),
                      static_cast<unsigned>(std::min<int64_t>(n, 65535)));
      embedding_backward_kernel<T, I><<<grid, kThreads, 0, on.stream>>>(
          device_ptr<const T>(grad_out), device_ptr<const I>(sorted_rows), device_ptr<const I>(sorted_positions),
          device_ptr<T>(grad_weight), n, vocab, channels, error);
      ZG_CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                const Tensor& loss) {
  require_contiguous("cross_entropy", {&logits, &target, &loss});
  const int64_t rows = logits.size(0), classes = logits.size(1);
  OnDevice on(logits.device());
  DeferredError* error = deferred_error_record(on.device);
  with_float(logits.dtype(), "cross_entropy", [&]<class T>() {
    using Loss = std::conditional_t<std::is_same_v<T, double>, double, float>;
    ZG_CHECK(loss.dtype() == dtype_of<Loss>(), "cross_entropy: losses must be ", name(dtype_of<Loss>()), " for ",
             describe(logits), ", got ", describe(loss));
    with_index(target.dtype(), "cross_entropy", [&]<class I>() {
      if (rows == 0) return;
      cross_entropy_kernel<T, I, Loss><<<blocks_for_rows(rows), kThreads, 0, on.stream>>>(
          device_ptr<const T>(logits), device_ptr<const I>(target), device_ptr<Loss>(loss), rows, classes,
          ignore_index, error);
      ZG_CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                         const Tensor& loss, const Tensor& grad_loss, const Tensor& grad_logits) {
  require_contiguous("cross_entropy_backward", {&logits, &target, &loss, &grad_loss, &grad_logits});
  const int64_t rows = logits.size(0), classes = logits.size(1);
  OnDevice on(logits.device());
  DeferredError* error = deferred_error_record(on.device);
  with_float(logits.dtype(), "cross_entropy_backward", [&]<class T>() {
    using Loss = std::conditional_t<std::is_same_v<T, double>, double, float>;
    ZG_CHECK(loss.dtype() == dtype_of<Loss>() && grad_loss.dtype() == dtype_of<Loss>(),
             "cross_entropy_backward: losses and their gradient must be ", name(dtype_of<Loss>()), " for ",
             describe(logits), ", got ", describe(loss), " and ", describe(grad_loss));
    with_index(target.dtype(), "cross_entropy_backward", [&]<class I>() {
      if (rows == 0) return;
      cross_entropy_backward_kernel<T, I, Loss><<<blocks_for_rows(rows), kThreads, 0, on.stream>>>(
          device_ptr<const T>(logits), device_ptr<const I>(target), device_ptr<const Loss>(loss),
          device_ptr<const Loss>(grad_loss), device_ptr<T>(grad_logits), rows, classes, ignore_index, error);
      ZG_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace zg::cuda
