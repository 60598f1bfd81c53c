// Blockwise quantization: a floating tensor as int8 (or int4) values and one f32 scale per
// block of `block` consecutive elements (scale = max|x| / 127 of the block, or / 7 at 4 bits;
// x = q scale): 1 + 4 / block bytes an element at 8 bits, 0.5 + 4 / block at 4, instead of 2
// (bf16) or 4 (f32). ZeRO++ sends ZeRO-3's weight all-gathers in int8 (qwZ) and its gradient
// reduction in int4 (qgZ) so (Wang et al. 2023; DeepSpeed's groups hold ~4k elements).
// The error is bounded per block: |x - dequantize(quantize(x))| <= scale / 2 (to the
// rounding of one f32 product, and of the result to a 16-bit dtype). Non-finite values
// are refused.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace zg {

inline constexpr int64_t kQuantizationBlock = 2048;

struct Quantized {
  Tensor values;  // i8: [n] at 8 bits; [ceil(n / 2)] at 4, element i in byte i / 2 (even i in the low nibble)
  Tensor scales;  // [ceil(n / block)] f32
  int bits = 8;
  int64_t block = kQuantizationBlock;
  Shape shape;                // of the tensor quantized
  DType dtype = DType::f32;   // of the tensor quantized: what dequantize returns
  int64_t nbytes() const { return values.nbytes() + scales.nbytes(); }
};

// `x` (floating, any shape and strides) quantized on its device to `bits` (8 or 4; at 4 the
// block is even). A non-finite element is a zg::Error: at once on the CPU, at the next
// synchronisation with the device on CUDA.
Quantized quantize(const Tensor& x, int bits = 8, int64_t block = kQuantizationBlock);
// The tensor `q` stands for, in its dtype and shape.
Tensor dequantize(const Quantized& q);

}  // namespace zg
