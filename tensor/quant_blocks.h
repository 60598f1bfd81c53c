// Where the blocks of a blockwise-quantized buffer lie (tensor/quantize.h): `block`
// elements each, restarting every `segment` elements -- an all-gather's shards, each
// quantized by its own rank, so that each shard's last block may be short. Scale k
// covers elements [begin(k), end(k)); element i belongs to scale_of(i). At 8 bits element i
// is byte i; at 4 bits two share byte i / 2 (i even in the low nibble), so blocks and
// segments are even there and no byte straddles two. The CPU and CUDA kernels share it
// (tensor/host_device.h).
#pragma once

#include <cstdint>

#include "tensor/host_device.h"

namespace zg {

struct QuantBlocks {
  int64_t n = 0, block = 1, segment = 1;  // segment: a multiple of nothing; n a multiple of it
  int bits = 8;                           // 8 or 4

  ZG_HOST_DEVICE int64_t per_segment() const { return (segment + block - 1) / block; }
  ZG_HOST_DEVICE int64_t count() const { return n / segment * per_segment(); }
  ZG_HOST_DEVICE int64_t begin(int64_t k) const { return k / per_segment() * segment + k % per_segment() * block; }
  ZG_HOST_DEVICE int64_t end(int64_t k) const {
    const int64_t segment_end = (k / per_segment() + 1) * segment, stop = begin(k) + block;
    return stop < segment_end ? stop : segment_end;
  }
  ZG_HOST_DEVICE int64_t scale_of(int64_t i) const { return i / segment * per_segment() + i % segment / block; }
  // The payload: bytes of quantized values, and the largest value, 127 or 7 (symmetric).
  ZG_HOST_DEVICE int64_t bytes() const { return bits == 8 ? n : n / 2; }
  ZG_HOST_DEVICE int levels() const { return bits == 8 ? 127 : 7; }
  // Element i's value from the payload: byte i, or i's nibble of byte i / 2, sign-extended.
  ZG_HOST_DEVICE int value(const int8_t* q, int64_t i) const {
    if (bits == 8) return q[i];
    const int byte = q[i / 2];
    return i % 2 == 0 ? static_cast<int8_t>(static_cast<uint8_t>(byte << 4)) >> 4 : byte >> 4;
  }
  // Elements i and i + 1's values as byte i / 2 (4 bits).
  ZG_HOST_DEVICE static int8_t pack(int low, int high) {
    return static_cast<int8_t>((low & 0xF) | ((high & 0xF) << 4));
  }
};

}  // namespace zg
