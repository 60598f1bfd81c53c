// A device for dry runs: the caching allocator (caching_allocator_core.h) over address
// ranges that are never touched, so a meta run shows what a GPU's cache would reserve --
// segments, rounding, blocks cached for reuse -- for a model no machine here could hold.
// Every stream's work counts as finished at once (no frees wait on markers).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "cuda/caching_allocator_core.h"

namespace zg::cuda {

class SimulatedDevice final : public MemorySource {
 public:
  // `capacity`: the device's bytes (an allocation past them is out of memory); 0: no bound.
  explicit SimulatedDevice(int64_t capacity = 0) : capacity_(capacity) {}
  void* allocate_segment(int64_t bytes) override;
  void free_segment(void* ptr) override;
  StreamId current_stream() override { return StreamId{1}; }
  std::unique_ptr<StreamMarker> mark(StreamId stream) override;

 private:
  int64_t capacity_, in_use_ = 0;
  std::uintptr_t next_ = std::uintptr_t{1} << 40;  // addresses handed out, never read or written
  std::unordered_map<std::uintptr_t, int64_t> segments_;
};

// A caching allocator for `device` (meta, for a dry run) over a simulated device.
std::shared_ptr<CachingAllocator> simulated_caching_allocator(Device device, int64_t capacity = 0);

}  // namespace zg::cuda
