// How a unit makes and moves its flat buffers: allocated in a memory category (on the
// host from the rank's host pool), and copied with a cast through the backend (gradients
// and shards are not autograd state). The library's own, shared by unit.cpp and
// paged_state.cpp.
#pragma once

#include "tensor/backend.h"
#include "tensor/tensor.h"

namespace zg::dist {

// On the host (cpu or meta) a buffer comes from the rank's host pool (TensorOptions::pinned).
inline Tensor allocate(int64_t numel, DType dtype, Device device, MemoryCategory category, bool zeroed,
                       bool host = false) {
  MemoryScope scope(category);
  Tensor t = empty({numel}, TensorOptions(dtype).device(device).pinned(host));
  if (zeroed) t.zero_();
  return t;
}

// dst = src rounded to dst's dtype; across devices (offload) through the device's backend.
inline void cast_into(const Tensor& src, const Tensor& dst) {
  backend(dst.device().type == DeviceType::cpu ? src.device() : dst.device()).copy(src, dst);
}

// `t` on `device` in `dtype`: itself, or a `communication` copy (offload's transfers).
inline Tensor moved(const Tensor& t, Device device, DType dtype) {
  if (t.device() == device && t.dtype() == dtype) return t;
  const Tensor out = allocate(t.numel(), dtype, device, MemoryCategory::communication, false);
  cast_into(t, out);
  return out;
}

}  // namespace zg::dist
