// What every kernel file of the CUDA backend shares: the element types as the
// device sees them, value conversion exactly as the CPU backend converts, the
// strided indexer that lets one kernel read any view (cuda/strided_indexer.h), launch
// shapes, and block- and warp-wide reductions. Included only by cuda/*.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/stream.h"
#include "cuda/strided_indexer.h"
#include "tensor/dtype.h"
#include "tensor/int_math.h"
#include "tensor/tensor.h"

namespace zg::cuda {

// ---- element types on the device ----
// zg::Half / zg::BFloat16 are bit-compatible with __half / __nv_bfloat16; kernels
// use CUDA's types so that conversions are the hardware's round-to-nearest-even,
// the same rounding as tensor/half.h.
template <class T>
struct device_type {
  using type = T;
};
template <>
struct device_type<Half> {
  using type = __half;
};
template <>
struct device_type<BFloat16> {
  using type = __nv_bfloat16;
};
template <class T>
using device_t = typename device_type<T>::type;
static_assert(sizeof(__half) == sizeof(Half) && sizeof(__nv_bfloat16) == sizeof(BFloat16));

template <class T>
constexpr bool is_half_v = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;
template <class T>
constexpr bool is_float_v = std::is_floating_point_v<T> || is_half_v<T>;

// The type arithmetic is done in: f32 for the 16-bit floats, the type itself otherwise.
template <class T>
using acc_t = std::conditional_t<is_half_v<T>, float, T>;

// Calls f.template operator()<T>() with T the *device* element type of `dtype`.
template <class F>
decltype(auto) dispatch_device(DType dtype, F&& f) {
  return dispatch(dtype, [&]<class T>() -> decltype(auto) { return f.template operator()<device_t<T>>(); });
}

// A 16-bit value widened to f32; anything else unchanged.
template <class T>
__device__ __forceinline__ acc_t<T> widen(T v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return v;
}

// Value conversion, as cpu::convert (tensor/cpu/loops.h): to bool is "!= 0", to the
// 16-bit floats goes through f32 (so a double is rounded twice, as on the CPU), float to
// integer saturates with NaN to 0 (tensor/int_math.h), everything else is a static_cast
// of the source's compute value.
template <class To, class From>
__device__ __forceinline__ To convert(From v) {
  const auto c = widen(v);
  if constexpr (std::is_same_v<To, bool>) return c != decltype(c)(0);
  else if constexpr (std::is_same_v<To, __half>) return __float2half_rn(static_cast<float>(c));
  else if constexpr (std::is_same_v<To, __nv_bfloat16>) return __float2bfloat16_rn(static_cast<float>(c));
  else if constexpr (std::is_integral_v<To> && std::is_floating_point_v<decltype(c)>) return saturating_cast<To>(c);
  else return static_cast<To>(c);
}

// ---- launches ----
inline constexpr int kThreads = 256;  // every kernel of this backend uses 256-thread blocks

// Blocks for a grid-stride loop over n items (n > 0).
inline unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 16));
}
// Blocks for kernels that give each block one row at a time.
inline unsigned blocks_for_rows(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, 1 << 16)); }

// Kernels for short rows (layer norm's C = 768) give each warp one row at a time, and
// reduce with shuffles instead of a block's barriers.
inline constexpr int kWarp = 32, kRowsPerBlock = kThreads / kWarp;
inline unsigned blocks_for_warp_rows(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1 << 16));
}
// for (int64_t row = warp_row(); row < rows; row += warp_row_stride()): the same row
// for the whole warp, so all 32 lanes take part in its shuffles.
__device__ __forceinline__ int64_t warp_row() { return blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / kWarp; }
__device__ __forceinline__ int64_t warp_row_stride() { return int64_t{gridDim.x} * kRowsPerBlock; }
__device__ __forceinline__ int warp_lane() { return static_cast<int>(threadIdx.x % kWarp); }

// Grid-stride loops: for (int64_t i = grid_index(); i < n; i += grid_stride())
__device__ __forceinline__ int64_t grid_index() { return blockIdx.x * int64_t{kThreads} + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t{gridDim.x} * kThreads; }

// Every launch is followed by this: it reports a bad launch configuration at once
// (it does not wait for the kernel).
#define ZG_CUDA_CHECK_LAUNCH() ZG_CUDA_CHECK(cudaGetLastError())

// The device and stream every method of the backend works with: `device` made
// current for the scope, and the current rank's compute stream on it.
struct OnDevice {
  explicit OnDevice(Device d) : device(d), guard(d.index), stream(current_stream(d)) {}
  Device device;
  DeviceGuard guard;
  cudaStream_t stream;
};

template <class T>
T* device_ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// ---- 128-bit loads ----
// A 16-byte pack of elements -- 8 bf16, 4 f32, 2 f64 -- moved by one load or store:
// a quarter to an eighth of the instructions of element loads, and no index arithmetic
// per element.
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <class T>
inline constexpr int kPack = 16 / sizeof(T);

// Whether a row of `length` elements at each pointer is whole, aligned packs.
template <class T, class... Pointers>
__host__ __device__ bool whole_packs(int64_t length, const Pointers*... rows) {
  return length % kPack<T> == 0 && ((reinterpret_cast<uintptr_t>(rows) % 16 == 0) && ...);
}

// For a block's row: f(j, row[j]) over the elements this thread owns (packs, or
// elements, threadIdx.x, threadIdx.x + kThreads, ...), by packs where the row allows.
template <class T, class F>
__device__ __forceinline__ void for_row(const T* row, int64_t length, F&& f) {
  constexpr int V = kPack<T>;
  if (whole_packs<T>(length, row)) {
    for (int64_t p = threadIdx.x; p < length / V; p += kThreads) {
      const Pack<T, V> in = reinterpret_cast<const Pack<T, V>*>(row)[p];
#pragma unroll
      for (int k = 0; k < V; ++k) f(p * V + k, in.v[k]);
    }
  } else {
    for (int64_t j = threadIdx.x; j < length; j += kThreads) f(j, row[j]);
  }
}

// For a block's row: out[j] = f(j, in[j]) over the elements this thread owns, by packs
// where both rows allow. `out` may be `in`: each thread writes only what it read.
template <class T, class F>
__device__ __forceinline__ void map_row(const T* in, T* out, int64_t length, F&& f) {
  constexpr int V = kPack<T>;
  if (whole_packs<T>(length, in, out)) {
    for (int64_t p = threadIdx.x; p < length / V; p += kThreads) {
      const Pack<T, V> x = reinterpret_cast<const Pack<T, V>*>(in)[p];
      Pack<T, V> y;
#pragma unroll
      for (int k = 0; k < V; ++k) y.v[k] = f(p * V + k, x.v[k]);
      reinterpret_cast<Pack<T, V>*>(out)[p] = y;
    }
  } else {
    for (int64_t j = threadIdx.x; j < length; j += kThreads) out[j] = f(j, in[j]);
  }
}

// ---- block reduction ----
// combine(a, b) over the 256 values of a block; every thread gets the result.
// Tree order, so the result does not depend on timing.
template <class T, class Combine>
__device__ T block_reduce(T value, Combine combine) {
  __shared__ __align__(16) unsigned char raw[kThreads * sizeof(T)];
  T* values = reinterpret_cast<T*>(raw);
  values[threadIdx.x] = value;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) values[threadIdx.x] = combine(values[threadIdx.x], values[threadIdx.x + half]);
    __syncthreads();
  }
  const T result = values[0];
  __syncthreads();  // the buffer may be reused by the next call
  return result;
}

// combine(a, b) over the 32 lanes of a warp; every lane gets the result. A butterfly:
// at each step two lanes combine the same two values (in either order, which Add and
// fmax do not mind), so all lanes agree bit for bit and timing plays no part.
template <class T, class Combine>
__device__ T warp_reduce(T value, Combine combine) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    value = combine(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

struct Add {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// ---- device math in the compute type (f32 or f64) ----
template <class C>
__device__ __forceinline__ C math_exp(C x) {
  if constexpr (std::is_same_v<C, float>) return expf(x);
  else return exp(x);
}
template <class C>
__device__ __forceinline__ C math_log(C x) {
  if constexpr (std::is_same_v<C, float>) return logf(x);
  else return log(x);
}
template <class C>
__device__ __forceinline__ C math_sqrt(C x) {
  if constexpr (std::is_same_v<C, float>) return sqrtf(x);
  else return sqrt(x);
}

template <class C>
__device__ __forceinline__ C math_abs(C x) {
  if constexpr (std::is_same_v<C, float>) return fabsf(x);
  else return fabs(x);
}
template <class C>
__device__ __forceinline__ C math_sin(C x) {
  if constexpr (std::is_same_v<C, float>) return sinf(x);
  else return sin(x);
}
template <class C>
__device__ __forceinline__ C math_cos(C x) {
  if constexpr (std::is_same_v<C, float>) return cosf(x);
  else return cos(x);
}
template <class C>
__device__ __forceinline__ C math_tanh(C x) {
  if constexpr (std::is_same_v<C, float>) return tanhf(x);
  else return tanh(x);
}
template <class C>
__device__ __forceinline__ C math_erf(C x) {
  if constexpr (std::is_same_v<C, float>) return erff(x);
  else return erf(x);
}
template <class C>
__device__ __forceinline__ C math_log1p(C x) {
  if constexpr (std::is_same_v<C, float>) return log1pf(x);
  else return log1p(x);
}

}  // namespace zg::cuda
