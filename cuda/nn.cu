// Row kernels of the neural-network primitives: softmax, layer norm, embedding
// (forward and backward) and cross-entropy. One block per row; row statistics
// (max, sums) are accumulated in f64 as on the CPU, elementwise results rounded
// once to the output dtype.
#include <cmath>

#include "cuda/backend.h"
#include "cuda/deferred_errors.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

struct Max {
  __device__ double operator()(double a, double b) const { return fmax(a, b); }  // NaN is ignored, as by std::max
};

template <class T>
__device__ __forceinline__ double load(const T* p, int64_t j) {
  return static_cast<double>(widen(p[j]));
}

// lse(row) = max + log(sum_j exp(row_j - max)), by the whole block; an infinite
// max is returned as it is (as on the CPU).
template <class T>
__device__ double row_logsumexp(const T* row, int64_t length) {
  double max = -INFINITY;
  for (int64_t j = threadIdx.x; j < length; j += kThreads) max = fmax(max, load(row, j));
  max = block_reduce(max, Max{});
  if (isinf(max)) return max;
  double total = 0;
  for (int64_t j = threadIdx.x; j < length; j += kThreads) total += exp(load(row, j) - max);
  total = block_reduce(total, Add{});
  return max + log(total);
}

// softmax(x)_j = exp(x_j - lse(x)),  log_softmax(x)_j = x_j - lse(x).
template <class T>
__global__ void softmax_kernel(const T* x, T* y, int64_t rows, int64_t length, bool log_output) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = x + row * length;
    T* out = y + row * length;
    const double lse = row_logsumexp(in, length);
    for (int64_t j = threadIdx.x; j < length; j += kThreads) {
      const double shifted = load(in, j) - lse;
      out[j] = convert<T>(log_output ? shifted : exp(shifted));
    }
  }
}

// mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rstd = 1 / sqrt(var + eps),
// out = (x - mean) * rstd * weight + bias;  mean and rstd kept (S: f32, f64 for f64).
template <class T, class S>
__global__ void layer_norm_kernel(const T* x, const T* weight, const T* bias, double eps, T* y, S* mean, S* rstd,
                                  int64_t rows, int64_t channels) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = x + row * channels;
    T* out = y + row * channels;
    double total = 0;
    for (int64_t j = threadIdx.x; j < channels; j += kThreads) total += load(in, j);
    const double mu = block_reduce(total, Add{}) / static_cast<double>(channels);
    double squares = 0;
    for (int64_t j = threadIdx.x; j < channels; j += kThreads) {
      const double d = load(in, j) - mu;
      squares += d * d;
    }
    const double r = 1.0 / sqrt(block_reduce(squares, Add{}) / static_cast<double>(channels) + eps);
    for (int64_t j = threadIdx.x; j < channels; j += kThreads) {
      double v = (load(in, j) - mu) * r;
      if (weight) v *= load(weight, j);
      if (bias) v += load(bias, j);
      out[j] = convert<T>(v);
    }
    if (threadIdx.x == 0) {
      mean[row] = static_cast<S>(mu);
      rstd[row] = static_cast<S>(r);
    }
  }
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

// grad_weight[indices[i], c] += grad_out[i, c] for i = 0, 1, ..., n-1 in order.
// One thread per channel walks the indices in order, so repeated rows need no
// atomics, the result is deterministic, and each addition is rounded to T as on
// the CPU (bit-identical to it). Parallel only over channels: fine for now.
template <class T, class I>
__global__ void embedding_backward_kernel(const T* grad_out, const I* indices, T* grad_weight, int64_t n, int64_t vocab,
                                          int64_t channels, DeferredError* error) {
  for (int64_t c = grid_index(); c < channels; c += grid_stride()) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = static_cast<int64_t>(indices[i]);
      if (row < 0 || row >= vocab) {
        if (c == 0) record_deferred_error(error, DeferredErrorKind::embedding_backward_index, row, vocab);
        continue;
      }
      T& w = grad_weight[row * channels + c];
      w = convert<T>(widen(w) + widen(grad_out[i * channels + c]));
    }
  }
}

// loss_i = lse(logits_i) - logits_i[t_i], 0 where t_i == ignore_index, NaN (and a
// deferred error) where t_i is outside [0, classes).
template <class T, class I, class Loss>
__global__ void cross_entropy_kernel(const T* logits, const I* target, Loss* loss, int64_t rows, int64_t classes,
                                     int64_t ignore_index, DeferredError* error) {
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
    const double lse = row_logsumexp(x, classes);
    if (threadIdx.x == 0) loss[row] = static_cast<Loss>(lse - load(x, t));
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

void CudaBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                             const Tensor& mean, const Tensor& rstd) {
  require_contiguous("layer_norm", {&x, &weight, &bias, &out, &mean, &rstd});
  const int64_t rows = x.size(0), channels = x.size(1);
  OnDevice on(x.device());
  with_float(x.dtype(), "layer_norm", [&]<class T>() {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    ZG_CHECK(mean.dtype() == dtype_of<S>() && rstd.dtype() == dtype_of<S>(), "layer_norm: mean and rstd must be ",
             name(dtype_of<S>()), " for ", describe(x), ", got ", describe(mean), " and ", describe(rstd));
    if (rows == 0) return;
    layer_norm_kernel<T, S><<<blocks_for_rows(rows), kThreads, 0, on.stream>>>(
        device_ptr<const T>(x), weight.defined() ? device_ptr<const T>(weight) : nullptr,
        bias.defined() ? device_ptr<const T>(bias) : nullptr, eps, device_ptr<T>(out), device_ptr<S>(mean),
        device_ptr<S>(rstd), rows, channels);
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
      embedding_backward_kernel<T, I><<<blocks_for(channels), kThreads, 0, on.stream>>>(
          device_ptr<const T>(grad_out), device_ptr<const I>(indices), device_ptr<T>(grad_weight), n, vocab, channels,
          error);
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

}  // namespace zg::cuda
