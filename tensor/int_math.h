// Integer arithmetic defined for every input, on the CPU and the GPU alike. C++
// leaves signed overflow and out-of-range float -> int casts undefined; these give
// what the GPU's instructions do:
//   wrapping_add/sub/mul/neg   two's complement wrap-around (integer add, sub, mul)
//   saturating_cast<I>(f)      truncate toward zero, NaN -> 0, clamp to I's range
//                              (cvt.rzi.sat, the GPU's float -> int conversion)
// and FastDivider, division by a fixed divisor without a division instruction.
#pragma once

#include <cstdint>
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

// n / d for a fixed d and any n < 2^31, by a multiplication and a shift: strided-view
// index arithmetic divides by each dim's size for every element, and a GPU has no
// integer division instruction (a 64-bit one is a subroutine of some 70 instructions).
// Granlund and Montgomery's method, as PyTorch's IntDivider:
//   shift = ceil(log2 d),  magic = floor(2^32 (2^shift - d) / d) + 1  (fits in 32 bits),
//   n / d = (mulhi(n, magic) + n) >> shift      (mulhi: the high 32 bits of the product)
// exact for d in [1, 2^31] and n < 2^31, where the sum does not overflow 32 bits.
struct FastDivider {
  uint32_t divisor = 1, magic = 1, shift = 0;

  FastDivider() = default;
  explicit FastDivider(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    magic = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d) / d + 1);
  }
  ZG_HOST_DEVICE uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(n, magic);
#else
    const uint32_t high = static_cast<uint32_t>((uint64_t{n} * magic) >> 32);
#endif
    return (high + n) >> shift;
  }
};

}  // namespace zg
