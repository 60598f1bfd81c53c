// Where the blocks of a blockwise-quantized buffer lie (tensor/quantize.h): `block`
// elements each, restarting every `segment` elements -- an all-gather's shards, each
// quantized by its own rank, so that each shard's last block may be short. Scale k
// covers elements [begin(k), end(k)); element i belongs to scale_of(i). The CPU and CUDA
// kernels share it (tensor/host_device.h).
#pragma once

#include <cstdint>

#include "tensor/host_device.h"

namespace zg {

struct QuantBlocks {
  int64_t n = 0, block = 1, segment = 1;  // segment: a multiple of nothing; n a multiple of it

  ZG_HOST_DEVICE int64_t per_segment() const { return (segment + block - 1) / block; }
  ZG_HOST_DEVICE int64_t count() const { return n / segment * per_segment(); }
  ZG_HOST_DEVICE int64_t begin(int64_t k) const { return k / per_segment() * segment + k % per_segment() * block; }
  ZG_HOST_DEVICE int64_t end(int64_t k) const {
    const int64_t segment_end = (k / per_segment() + 1) * segment, stop = begin(k) + block;
    return stop < segment_end ? stop : segment_end;
  }
  ZG_HOST_DEVICE int64_t scale_of(int64_t i) const { return i / segment * per_segment() + i % segment / block; }
};

}  // namespace zg
