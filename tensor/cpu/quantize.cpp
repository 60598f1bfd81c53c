// Blockwise symmetric int8 quantization on the CPU (Backend::quantize_int8), with the
// operations and precision of cuda/quantize.cu, so both give the same bits:
//   scale = max|x| / 127          (per block, in f32; f64 for f64 values)
//   q     = round(x / scale)      (half away from zero; 0 where scale is 0)
//   x'    = q scale               (dequantize_int8, rounded to the output's dtype)
#include <cmath>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"

namespace zg::cpu {

namespace {
constexpr int64_t kBlocksPerTask = 16;  // blocks a worker takes at once
}  // namespace

void CpuBackend::quantize_int8(const Tensor& in, int64_t block, const Tensor& q, const Tensor& scales) {
  check_quantize_arguments("quantize_int8", in, q, scales, block);
  const int64_t n = in.numel();
  dispatch(in.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const T* x = in.data<T>();
      int8_t* out = q.data<int8_t>();
      float* scale = scales.data<float>();
      parallel_for(scales.numel(), kBlocksPerTask, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
          const int64_t begin = b * block, end = std::min(n, begin + block);
          C amax = 0;
          for (int64_t i = begin; i < end; ++i) {
            const C v = static_cast<C>(static_cast<compute_t<T>>(x[i]));
            ZG_CHECK(std::isfinite(v), "quantize_int8: element ", i, " of ", describe(in), " is ", v,
                     "; only finite values quantize");
            amax = std::max(amax, std::fabs(v));
          }
          const float s = static_cast<float>(amax / C(127));
          scale[b] = s;
          for (int64_t i = begin; i < end; ++i)
            out[i] = s == 0 ? int8_t(0)
                            : static_cast<int8_t>(std::round(static_cast<C>(static_cast<compute_t<T>>(x[i])) / C(s)));
        }
      });
    }
  });
}

void CpuBackend::dequantize_int8(const Tensor& q, const Tensor& scales, int64_t block, const Tensor& out) {
  check_quantize_arguments("dequantize_int8", out, q, scales, block);
  dispatch(out.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const int8_t* in = q.data<int8_t>();
      const float* scale = scales.data<float>();
      T* x = out.data<T>();
      parallel_for(out.numel(), kBlocksPerTask * block, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) x[i] = convert<T>(static_cast<C>(in[i]) * static_cast<C>(scale[i / block]));
      });
    }
  });
}

}  // namespace zg::cpu
