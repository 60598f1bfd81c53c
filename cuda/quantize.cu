// Blockwise symmetric quantization (Backend::quantize_blocks), the CPU's operations in the
// CPU's precision (tensor/cpu/quantize.cpp), so both give the same bits:
//   scale = max|x| / L over the block (L = 127 at 8 bits, 7 at 4)   q = round(x / scale)   x' = q scale
// Blocks and the payload lie as tensor/quant_blocks.h says. One thread block per
// quantization block: a tree max over its elements, then each thread quantizes its share
// (at 4 bits a pair of elements, one byte). A non-finite element gives q = 0, a NaN scale
// and a deferred error (cuda/deferred_errors.h) naming its index.
#include <cmath>

#include "cuda/backend.h"
#include "cuda/deferred_errors.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

struct Max {
  template <class C>
  __device__ C operator()(C a, C b) const {
    return a > b ? a : b;
  }
};

// C: the compute type (f32; f64 for f64). Block k covers [blocks.begin(k), blocks.end(k)).
template <class T, class C>
__global__ void quantize_kernel(const T* x, int8_t* q, float* scales, QuantBlocks blocks, DeferredError* error) {
  for (int64_t k = blockIdx.x; k < blocks.count(); k += gridDim.x) {
    const int64_t begin = blocks.begin(k), end = blocks.end(k);
    C amax = 0;
    bool finite = true;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const C v = static_cast<C>(widen(x[i]));
      if (!isfinite(v)) {
        finite = false;
        record_deferred_error(error, DeferredErrorKind::quantize_non_finite, i, blocks.n);
      }
      amax = Max{}(amax, math_abs(v));
    }
    amax = block_reduce(finite ? amax : C(NAN), [](C a, C b) { return isnan(a) || isnan(b) ? C(NAN) : Max{}(a, b); });
    const float s = static_cast<float>(amax / C(blocks.levels()));
    if (threadIdx.x == 0) scales[k] = s;
    const auto level = [&](int64_t i) {
      return s == 0 || isnan(s) ? 0 : static_cast<int>(round(static_cast<C>(widen(x[i])) / C(s)));
    };
    if (blocks.bits == 8)
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) q[i] = static_cast<int8_t>(level(i));
    else
      for (int64_t i = begin + 2 * threadIdx.x; i < end; i += 2 * kThreads)
        q[i / 2] = QuantBlocks::pack(level(i), level(i + 1));
  }
}

template <class T, class C>
__global__ void dequantize_kernel(const int8_t* q, const float* scales, T* out, QuantBlocks blocks) {
  for (int64_t i = grid_index(); i < blocks.n; i += grid_stride())
    out[i] = convert<T>(static_cast<C>(blocks.value(q, i)) * static_cast<C>(scales[blocks.scale_of(i)]));
}

}  // namespace

void CudaBackend::quantize_blocks(const Tensor& in, int bits, int64_t block, int64_t segment, const Tensor& q,
                                  const Tensor& scales) {
  const QuantBlocks blocks = check_quantize_arguments("quantize", in, q, scales, bits, block, segment);
  if (blocks.n == 0) return;
  OnDevice on(in.device());
  DeferredError* error = deferred_error_record(on.device);
  dispatch_device(in.dtype(), [&]<class T>() {
    if constexpr (is_float_v<T>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      quantize_kernel<T, C><<<blocks_for_rows(blocks.count()), kThreads, 0, on.stream>>>(
          device_ptr<const T>(in), device_ptr<int8_t>(q), device_ptr<float>(scales), blocks, error);
      ZG_CUDA_CHECK_LAUNCH();
    }
  });
}

void CudaBackend::dequantize_blocks(const Tensor& q, const Tensor& scales, int bits, int64_t block, int64_t segment,
                                    const Tensor& out) {
  const QuantBlocks blocks = check_quantize_arguments("dequantize", out, q, scales, bits, block, segment);
  if (blocks.n == 0) return;
  OnDevice on(out.device());
  dispatch_device(out.dtype(), [&]<class T>() {
    if constexpr (is_float_v<T>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      dequantize_kernel<T, C><<<blocks_for(blocks.n), kThreads, 0, on.stream>>>(
          device_ptr<const int8_t>(q), device_ptr<const float>(scales), device_ptr<T>(out), blocks);
      ZG_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace zg::cuda
