#include "tensor/checks.h"

#include <cmath>

#include "tensor/deferred.h"

namespace zg::detail {

void check_defined(const char* op, const Tensor& t) {
  ZG_CHECK(t.defined(), op, ": got an undefined tensor");
  check_materialized(op, t);
}

void check_no_broadcast_dims(const char* op, const char* what, const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d)
    ZG_CHECK(t.strides()[d] != 0 || t.shape()[d] <= 1, op, ": the ", what, " ", describe(t),
             " has broadcast (stride 0) dims, so several elements share one memory location");
}

void check_compatible(const char* op, const Tensor& a, const Tensor& b) {
  check_defined(op, a);
  check_defined(op, b);
  ZG_CHECK(a.device() == b.device(), op, ": device mismatch: ", describe(a), " and ", describe(b));
  ZG_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", describe(a), " and ", describe(b));
}

void check_floating(const char* op, const Tensor& x) {
  check_defined(op, x);
  ZG_CHECK(is_floating(x.dtype()), op, ": expected a floating-point tensor, got ", describe(x));
}

void check_index_dtype(const char* op, const Tensor& indices) {
  check_defined(op, indices);
  ZG_CHECK(is_integral(indices.dtype()), op, ": expected i32 or i64 indices, got ", describe(indices));
}

TensorOptions options_of(const Tensor& t) { return TensorOptions(t.dtype()).device(t.device()); }

Tensor as_rows(const Tensor& x) {
  const int64_t channels = x.size(-1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);  // <= numel or 0: cannot overflow
  return x.contiguous().view({rows, channels});
}

bool holds(DType dtype, double v) {
  switch (dtype) {
    case DType::f64: return true;
    case DType::f32: return !std::isfinite(v) || std::isfinite(static_cast<float>(v));
    case DType::f16: return !std::isfinite(v) || std::isfinite(static_cast<float>(Half(static_cast<float>(v))));
    case DType::bf16: return !std::isfinite(v) || std::isfinite(static_cast<float>(BFloat16(static_cast<float>(v))));
    case DType::i64: return v == std::trunc(v) && v >= -0x1p63 && v < 0x1p63;  // NaN is not its own trunc
    case DType::i32: return v == std::trunc(v) && v >= -0x1p31 && v < 0x1p31;
    case DType::i8: return v == std::trunc(v) && v >= -128 && v < 128;
    case DType::boolean: return v == 0 || v == 1;
  }
  return false;
}

Tensor scalar_like(const char* op, const Tensor& t, double value) {
  ZG_CHECK(holds(t.dtype(), value), op, ": the scalar ", value, " does not fit ", describe(t),
           " (a scalar takes the tensor's dtype); convert the tensor first, e.g. to(DType::f32)");
  return full({}, value, options_of(t));
}

}  // namespace zg::detail
