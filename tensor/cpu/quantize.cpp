// Blockwise symmetric quantization on the CPU (Backend::quantize_blocks), with the
// operations and precision of cuda/quantize.cu, so both give the same bits:
//   scale = max|x| / L            (per block, in f32; f64 for f64 values; L = 127 at 8 bits, 7 at 4)
//   q     = round(x / scale)      (half away from zero; 0 where scale is 0)
//   x'    = q scale               (dequantize_blocks, rounded to the output's dtype)
// Blocks and the payload lie as tensor/quant_blocks.h says.
#include <cmath>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"

namespace zg::cpu {

namespace {
constexpr int64_t kBlocksPerTask = 16;  // blocks a worker takes at once
}  // namespace

void CpuBackend::quantize_blocks(const Tensor& in, int bits, int64_t block, int64_t segment, const Tensor& q,
                                 const Tensor& scales) {
  const QuantBlocks blocks = check_quantize_arguments("quantize", in, q, scales, bits, block, segment);
  dispatch(in.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const T* x = in.data<T>();
      int8_t* out = q.data<int8_t>();
      float* scale = scales.data<float>();
      const auto element = [&](int64_t i) { return static_cast<C>(static_cast<compute_t<T>>(x[i])); };
      parallel_for(blocks.count(), kBlocksPerTask, [&](int64_t first, int64_t last) {
        for (int64_t k = first; k < last; ++k) {
          const int64_t begin = blocks.begin(k), end = blocks.end(k);
          C amax = 0;
          for (int64_t i = begin; i < end; ++i) {
            ZG_CHECK(std::isfinite(element(i)), "quantize: element ", i, " of ", describe(in), " is ", element(i),
                     "; only finite values quantize");
            amax = std::max(amax, std::fabs(element(i)));
          }
          const float s = static_cast<float>(amax / C(blocks.levels()));
          scale[k] = s;
          const auto level = [&](int64_t i) { return s == 0 ? 0 : static_cast<int>(std::round(element(i) / C(s))); };
          if (bits == 8)
            for (int64_t i = begin; i < end; ++i) out[i] = static_cast<int8_t>(level(i));
          else
            for (int64_t i = begin; i < end; i += 2) out[i / 2] = QuantBlocks::pack(level(i), level(i + 1));
        }
      });
    }
  });
}

void CpuBackend::dequantize_blocks(const Tensor& q, const Tensor& scales, int bits, int64_t block, int64_t segment,
                                   const Tensor& out) {
  const QuantBlocks blocks = check_quantize_arguments("dequantize", out, q, scales, bits, block, segment);
  dispatch(out.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const int8_t* in = q.data<int8_t>();
      const float* scale = scales.data<float>();
      T* x = out.data<T>();
      parallel_for(out.numel(), kBlocksPerTask * block, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          x[i] = convert<T>(static_cast<C>(blocks.value(in, i)) * static_cast<C>(scale[blocks.scale_of(i)]));
      });
    }
  });
}

}  // namespace zg::cpu
