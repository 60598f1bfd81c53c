// Element types. f16/bf16 are storage types on the CPU (computed in f32); f64
// exists so finite-difference gradient checks are exact enough on every device.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "tensor/half.h"

namespace zg {

// i8: the payload of blockwise-quantized tensors (tensor/quantize.h), not for arithmetic.
enum class DType : uint8_t { f64, f32, f16, bf16, i64, i32, i8, boolean };

inline constexpr DType f64 = DType::f64;
inline constexpr DType f32 = DType::f32;
inline constexpr DType f16 = DType::f16;
inline constexpr DType bf16 = DType::bf16;
inline constexpr DType i64 = DType::i64;
inline constexpr DType i32 = DType::i32;
inline constexpr DType i8 = DType::i8;
inline constexpr DType boolean = DType::boolean;

int64_t element_size(DType dtype);
const char* name(DType dtype);  // "f32", "bf16", "bool", ...
bool is_floating(DType dtype);
bool is_integral(DType dtype);  // i64, i32, i8 (not bool)
// What floating-point math on `dtype` accumulates in (statistics, losses, master
// weights, a scaled loss): f64 for f64, f32 otherwise.
inline DType accumulate_type(DType dtype) { return dtype == DType::f64 ? DType::f64 : DType::f32; }

// The C++ type that holds one element of a dtype, and back.
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, Half>) return DType::f16;
  else if constexpr (std::is_same_v<T, BFloat16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, int64_t>) return DType::i64;
  else if constexpr (std::is_same_v<T, int32_t>) return DType::i32;
  else if constexpr (std::is_same_v<T, int8_t>) return DType::i8;
  else if constexpr (std::is_same_v<T, bool>) return DType::boolean;
  else static_assert(sizeof(T) == 0, "no zerograd dtype for this C++ type");
}

// Calls f.template operator()<T>() with T the element type of `dtype`:
//   dispatch(t.dtype(), [&]<class T>() { ... });
template <class F>
decltype(auto) dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f64: return f.template operator()<double>();
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<Half>();
    case DType::bf16: return f.template operator()<BFloat16>();
    case DType::i64: return f.template operator()<int64_t>();
    case DType::i32: return f.template operator()<int32_t>();
    case DType::i8: return f.template operator()<int8_t>();
    case DType::boolean: return f.template operator()<bool>();
  }
  return f.template operator()<float>();  // unreachable: every enumerator is handled
}

// The type arithmetic is done in: f32 for the 16-bit floats, the type itself otherwise.
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

}  // namespace zg
