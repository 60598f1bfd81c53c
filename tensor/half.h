// f16 and bf16 as storage types. On the CPU every op converts them to f32,
// computes, and rounds back (round-to-nearest-even), as GPUs do for these types.
#pragma once

#include <bit>
#include <cstdint>

namespace zg {

// IEEE binary16. Conversion after F. Giesen, "float->half variants" (RTNE):
// the subnormal case lets the FPU do the rounding by adding a magic 0.5f.
struct Half {
  uint16_t bits = 0;

  Half() = default;
  Half(float f) : bits(from_float(f)) {}  // NOLINT: implicit like a number
  operator float() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t out;
    if (u >= (127u + 16u) << 23) {  // |f| >= 65536: inf, or nan kept quiet
      out = u > 0x7f800000u ? 0x7e00 : 0x7c00;
    } else if (u < 113u << 23) {  // result is a half subnormal or zero
      const float magic = std::bit_cast<float>(126u << 23);  // 0.5f
      out = static_cast<uint16_t>(std::bit_cast<uint32_t>(std::bit_cast<float>(u) + magic) -
                                  (126u << 23));
    } else {
      const uint32_t mantissa_odd = (u >> 13) & 1;
      u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff + mantissa_odd;
      out = static_cast<uint16_t>(u >> 13);
    }
    return static_cast<uint16_t>(out | (sign >> 16));
  }

  static float to_float(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t u = (h & 0x7fffu) << 13;
    const uint32_t exp = u & shifted_exp;
    u += (127u - 15u) << 23;
    if (exp == shifted_exp) {  // inf / nan
      u += (128u - 16u) << 23;
    } else if (exp == 0) {  // zero / subnormal: renormalise through the FPU
      u += 1u << 23;
      u = std::bit_cast<uint32_t>(std::bit_cast<float>(u) - std::bit_cast<float>(113u << 23));
    }
    return std::bit_cast<float>(u | (static_cast<uint32_t>(h & 0x8000u) << 16));
  }
};

// bfloat16: the top 16 bits of an f32, rounded to nearest even.
struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  BFloat16(float f) : bits(from_float(f)) {}  // NOLINT: implicit like a number
  operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

  static uint16_t from_float(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet nan
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
  }
};

}  // namespace zg
