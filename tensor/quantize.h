// Blockwise int8 quantization: a floating tensor as int8 values and one f32 scale per
// block of `block` consecutive elements (scale = max|x| / 127 of the block, x = q scale),
// 1 + 4 / block bytes an element instead of 2 (bf16) or 4 (f32). ZeRO++'s qwZ sends
// ZeRO-3's weight all-gathers so (Wang et al. 2023; DeepSpeed's groups hold ~4k elements).
// The error is bounded per block: |x - dequantize(quantize(x))| <= scale / 2 (to the
// rounding of one f32 product, and of the result to a 16-bit dtype). Non-finite values
// are refused.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace zg {

inline constexpr int64_t kQuantizationBlock = 2048;

struct QuantizedInt8 {
  Tensor values;  // [n] i8, the tensor's elements in row-major order
  Tensor scales;  // [ceil(n / block)] f32
  int64_t block = kQuantizationBlock;
  Shape shape;                // of the tensor quantized
  DType dtype = DType::f32;   // of the tensor quantized: what dequantize returns
  int64_t nbytes() const { return values.nbytes() + scales.nbytes(); }
};

// `x` (floating, any shape and strides) quantized on its device. A non-finite element is a
// zg::Error: at once on the CPU, at the next synchronisation with the device on CUDA.
QuantizedInt8 quantize_int8(const Tensor& x, int64_t block = kQuantizationBlock);
// The tensor `q` stands for, in its dtype and shape.
Tensor dequantize(const QuantizedInt8& q);

}  // namespace zg
