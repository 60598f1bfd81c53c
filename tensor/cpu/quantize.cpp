// Blockwise symmetric int8 quantization on the CPU (Backend::quantize_int8), with the
// operations and precision of cuda/quantize.cu, so both give the same bits:
//   scale = max|x| / 127          (per block, in f32; f64 for f64 values)
//   q     = round(x / scale)      (half away from zero; 0 where scale is 0)
//   x'    = q scale               (dequantize_int8, rounded to the output's dtype)
// Blocks lie as tensor/quant_blocks.h says (restarting at every segment).
#include <cmath>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"

namespace zg::cpu {

namespace {
constexpr int64_t kBlocksPerTask = 16;  // blocks a worker takes at once
}  // namespace

void CpuBackend::quantize_int8(const Tensor& in, int64_t block, int64_t segment, const Tensor& q, const Tensor& scales) {
  const QuantBlocks blocks = check_quantize_arguments("quantize_int8", in, q, scales, block, segment);
  dispatch(in.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const T* x = in.data<T>();
      int8_t* out = q.data<int8_t>();
      float* scale = scales.data<float>();
      parallel_for(blocks.count(), kBlocksPerTask, [&](int64_t first, int64_t last) {
        for (int64_t k = first; k < last; ++k) {
          const int64_t begin = blocks.begin(k), end = blocks.end(k);
          C amax = 0;
          for (int64_t i = begin; i < end; ++i) {
            const C v = static_cast<C>(static_cast<compute_t<T>>(x[i]));
            ZG_CHECK(std::isfinite(v), "quantize_int8: element ", i, " of ", describe(in), " is ", v,
                     "; only finite values quantize");
            amax = std::max(amax, std::fabs(v));
          }
          const float s = static_cast<float>(amax / C(127));
          scale[k] = s;
          for (int64_t i = begin; i < end; ++i)
            out[i] = s == 0 ? int8_t(0)
                            : static_cast<int8_t>(std::round(static_cast<C>(static_cast<compute_t<T>>(x[i])) / C(s)));
        }
      });
    }
  });
}

void CpuBackend::dequantize_int8(const Tensor& q, const Tensor& scales, int64_t block, int64_t segment,
                                 const Tensor& out) {
  const QuantBlocks blocks = check_quantize_arguments("dequantize_int8", out, q, scales, block, segment);
  dispatch(out.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const int8_t* in = q.data<int8_t>();
      const float* scale = scales.data<float>();
      T* x = out.data<T>();
      parallel_for(out.numel(), kBlocksPerTask * block, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          x[i] = convert<T>(static_cast<C>(in[i]) * static_cast<C>(scale[blocks.scale_of(i)]));
      });
    }
  });
}

}  // namespace zg::cpu
