// Input checks shared by the op front-ends. Each throws zg::Error whose message
// starts with the op's name and describes the offending tensors.
#pragma once

#include "tensor/tensor.h"

namespace zg::detail {

// Defined, and holding values: not deferred (tensor/deferred.h).
void check_defined(const char* op, const Tensor& t);
// Both defined, on one device, of one dtype.
void check_compatible(const char* op, const Tensor& a, const Tensor& b);
void check_floating(const char* op, const Tensor& x);
void check_index_dtype(const char* op, const Tensor& indices);  // i32 or i64

// [..., C] -> rows [M, C], M the product of the leading dims (given, not inferred with
// -1, which a zero-size C leaves ambiguous). A view where the layout allows, else a copy.
Tensor as_rows(const Tensor& x);

// A tensor written element by element (the destination of an in-place op, a gradient
// that backward accumulates into) needs one memory location per element: through a
// broadcast (stride 0) dim, several elements would update one value.
void check_no_broadcast_dims(const char* op, const char* what, const Tensor& t);

TensorOptions options_of(const Tensor& t);
// Whether `dtype` holds v: exactly for integers and bools; for floats, without a finite
// value overflowing to inf (rounding is the dtype's business).
bool holds(DType dtype, double v);
// A scalar operand of `op`: a 0-dim tensor holding `value` in t's dtype, on t's device.
// Refused where the dtype cannot hold it -- a fraction, NaN or an out-of-range value for
// an integer or bool tensor, a finite value that overflows a float dtype -- since the
// op would silently use another value (lt(int_tensor, 2.5) compared with 2).
Tensor scalar_like(const char* op, const Tensor& t, double value);

}  // namespace zg::detail
