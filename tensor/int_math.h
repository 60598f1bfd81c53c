// Integer arithmetic defined for every input, on the CPU and the GPU alike. C++
// leaves signed overflow and out-of-range float -> int casts undefined; these give
// what the GPU's instructions do:
//   wrapping_add/sub/mul/neg   two's complement wrap-around (integer add, sub, mul)
//   saturating_cast<I>(f)      truncate toward zero, NaN -> 0, clamp to I's range
//                              (cvt.rzi.sat, the GPU's float -> int conversion)
#pragma once

#include <limits>
#include <type_traits>

#include "tensor/host_device.h"

namespace zg {

// The arithmetic is done in the unsigned type, where it wraps by definition, and
// converted back, which C++20 defines as modulo 2^bits. Floats go through as they are.
template <class T, class Op>
ZG_HOST_DEVICE constexpr T wrapping(T a, T b, Op op) {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(op(static_cast<U>(a), static_cast<U>(b)));
  } else {
    return op(a, b);
  }
}
template <class T>
ZG_HOST_DEVICE constexpr T wrapping_add(T a, T b) {
  return wrapping(a, b, [](auto x, auto y) { return x + y; });
}
template <class T>
ZG_HOST_DEVICE constexpr T wrapping_sub(T a, T b) {
  return wrapping(a, b, [](auto x, auto y) { return x - y; });
}
template <class T>
ZG_HOST_DEVICE constexpr T wrapping_mul(T a, T b) {
  return wrapping(a, b, [](auto x, auto y) { return x * y; });
}
// Floats negate by flipping the sign (-0.0 for 0.0, as IEEE and PyTorch do; 0 - x would
// give +0.0).
template <class T>
ZG_HOST_DEVICE constexpr T wrapping_neg(T a) {
  if constexpr (std::is_integral_v<T>) return wrapping_sub(T(0), a);
  else return -a;
}

// Float -> integer I. The range test is done in F: I's max rounds up to a power of two
// there (2^63 for i64), so ">= max" catches exactly the values that do not fit.
template <class I, class F>
ZG_HOST_DEVICE constexpr I saturating_cast(F v) {
  constexpr I lo = std::numeric_limits<I>::min(), hi = std::numeric_limits<I>::max();
  if (v != v) return 0;
  if (v <= static_cast<F>(lo)) return lo;
  if (v >= static_cast<F>(hi)) return hi;
  return static_cast<I>(v);
}

}  // namespace zg
