#include "tensor/quantize.h"

#include <algorithm>

#include "tensor/backend.h"

namespace zg {

QuantizedInt8 quantize_int8(const Tensor& x, int64_t block) {
  ZG_CHECK(x.defined() && is_floating(x.dtype()), "quantize_int8: expected a floating tensor, got ",
           x.defined() ? describe(x) : std::string("an undefined one"));
  ZG_CHECK(block > 0, "quantize_int8: the block must be positive, got ", block);
  const Tensor flat = x.contiguous().reshape({x.numel()});
  const int64_t blocks = x.numel() / block + (x.numel() % block != 0);
  QuantizedInt8 q{Tensor::empty({x.numel()}, TensorOptions(DType::i8).device(x.device())),
                  Tensor::empty({blocks}, TensorOptions(DType::f32).device(x.device())), block, x.shape(), x.dtype()};
  backend(x.device()).quantize_int8(flat, block, std::max<int64_t>(x.numel(), 1), q.values, q.scales);
  return q;
}

Tensor dequantize(const QuantizedInt8& q) {
  ZG_CHECK(q.values.defined() && q.scales.defined(), "dequantize: the QuantizedInt8 holds no values");
  Tensor out = Tensor::empty({q.values.numel()}, TensorOptions(q.dtype).device(q.values.device()));
  backend(out.device()).dequantize_int8(q.values, q.scales, q.block, std::max<int64_t>(out.numel(), 1), out);
  return out.view(q.shape);
}

}  // namespace zg
