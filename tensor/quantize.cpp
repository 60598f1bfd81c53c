#include "tensor/quantize.h"

#include "tensor/backend.h"

namespace zg {

Quantized quantize(const Tensor& x, int bits, int64_t block) {
  ZG_CHECK(x.defined() && is_floating(x.dtype()), "quantize: expected a floating tensor, got ",
           x.defined() ? describe(x) : std::string("an undefined one"));
  ZG_CHECK(bits == 8 || bits == 4, "quantize: quantizes to 8 or 4 bits, not ", bits);
  ZG_CHECK(block > 0 && (bits == 8 || block % 2 == 0), "quantize: the block must be positive",
           bits == 4 ? " and even at 4 bits" : "", ", got ", block);
  Tensor flat = x.contiguous().reshape({x.numel()});
  if (bits == 4 && x.numel() % 2 != 0) {  // an odd count: a zero after the last element fills its byte
    const Tensor even = zeros({x.numel() + 1}, TensorOptions(x.dtype()).device(x.device()));
    backend(x.device()).copy(flat, even.narrow(0, 0, x.numel()));
    flat = even;
  }
  const int64_t n = flat.numel(), blocks = n / block + (n % block != 0);
  const TensorOptions on = TensorOptions(DType::i8).device(x.device());
  Quantized q{Tensor::empty({bits == 8 ? n : n / 2}, on), Tensor::empty({blocks}, on.dtype(DType::f32)), bits, block,
              x.shape(), x.dtype()};
  backend(x.device()).quantize_blocks(flat, bits, block, std::max<int64_t>(n, bits == 8 ? 1 : 2), q.values, q.scales);
  return q;
}

Tensor dequantize(const Quantized& q) {
  ZG_CHECK(q.values.defined() && q.scales.defined(), "dequantize: the Quantized holds no values");
  const int64_t n = q.bits == 8 ? q.values.numel() : 2 * q.values.numel();
  Tensor out = Tensor::empty({n}, TensorOptions(q.dtype).device(q.values.device()));
  backend(out.device()).dequantize_blocks(q.values, q.scales, q.bits, q.block, std::max<int64_t>(n, q.bits == 8 ? 1 : 2), out);
  return out.narrow(0, 0, numel(q.shape)).view(q.shape);
}

}  // namespace zg
