// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11): a counter-based generator. Output = bijection(counter, key), so element
// i of a random tensor depends only on (seed, offset, i) -- never on how the work
// is split across threads. The same header compiles for a CUDA kernel, which
// therefore reproduces the CPU's numbers bit for bit.
//
// Layout used by zerograd: key = seed (lo, hi words); counter = (block lo, block
// hi, 0, 0) with block = offset + i / 4; element i takes lane i % 4.
#pragma once

#include <cmath>
#include <cstdint>

#include "tensor/host_device.h"

namespace zg::philox {

struct U32x4 {
  uint32_t v[4];
};

ZG_HOST_DEVICE void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

// Ten rounds of: (c0, c1, c2, c3) -> (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0)),
// with the key bumped by the Weyl constants W0, W1 between rounds.
ZG_HOST_DEVICE U32x4 philox4x32_10(U32x4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, counter.v[0], hi0, lo0);
    mulhilo(kM1, counter.v[2], hi1, lo1);
    counter = U32x4{{hi1 ^ counter.v[1] ^ key0, lo1, hi0 ^ counter.v[3] ^ key1, lo0}};
    key0 += kW0;
    key1 += kW1;
  }
  return counter;
}

// The four 32-bit words for counter block `block` under `seed`.
ZG_HOST_DEVICE U32x4 block_bits(uint64_t seed, uint64_t block) {
  return philox4x32_10(U32x4{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u}},
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Uniform in [0, 1) from the top 24 bits: exactly representable in f32, so every
// device computes the same value.
ZG_HOST_DEVICE float uniform01(uint32_t bits) { return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f); }

// Standard normal by Box-Muller on the lane pair (2k, 2k+1) of a block: the even
// lane gives r*cos(theta), the odd lane r*sin(theta). Computed in f64 so that the
// f32 result agrees across devices.
ZG_HOST_DEVICE double normal_from_pair(uint32_t radius_bits, uint32_t angle_bits, bool odd_lane) {
  const double u = (static_cast<double>(radius_bits >> 8) + 1.0) * (1.0 / 16777216.0);  // (0, 1]
  const double theta = 6.283185307179586 * static_cast<double>(angle_bits >> 8) * (1.0 / 16777216.0);
  const double r = ::sqrt(-2.0 * ::log(u));
  return odd_lane ? r * ::sin(theta) : r * ::cos(theta);
}

// a + b * x with each operation rounded on its own on every device: nvcc would
// otherwise fuse it into one multiply-add, which the host does not.
ZG_HOST_DEVICE double affine(double a, double b, double x) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, __dmul_rn(b, x));
#else
  return a + b * x;
#endif
}

// The value of element `lane` (0..3) of a block, in f64, before rounding to the
// tensor's dtype: U[a, b) for uniform, N(a, b^2) for normal. Both backends call
// this, so they agree wherever the f64 library functions of normal_from_pair do.
// Rounding to the dtype can carry a uniform draw just below b onto b itself (bf16
// keeps 8 bits: 1 - 2^-24 rounds to 1); both backends then write a instead -- what
// PyTorch's CUDA generator does with a draw of 1 -- so the result stays in [a, b).
ZG_HOST_DEVICE double draw(const U32x4& bits, int lane, bool normal, double a, double b) {
  if (!normal) return affine(a, b - a, static_cast<double>(uniform01(bits.v[lane])));
  return affine(a, b, normal_from_pair(bits.v[lane & 2], bits.v[lane | 1], (lane & 1) != 0));
}

}  // namespace zg::philox
