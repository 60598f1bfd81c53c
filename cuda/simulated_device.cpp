#include "cuda/simulated_device.h"

#include "tensor/error.h"

namespace zg::cuda {

void* SimulatedDevice::allocate_segment(int64_t bytes) {
  if (capacity_ > 0 && bytes > capacity_ - in_use_) return nullptr;
  const std::uintptr_t at = next_;
  next_ += static_cast<std::uintptr_t>(bytes);
  segments_[at] = bytes;
  in_use_ += bytes;
  return reinterpret_cast<void*>(at);
}

void SimulatedDevice::free_segment(void* ptr) {
  const auto it = segments_.find(reinterpret_cast<std::uintptr_t>(ptr));
  ZG_CHECK(it != segments_.end(), "SimulatedDevice: freeing ", ptr, ", which is not a segment it handed out");
  in_use_ -= it->second;
  segments_.erase(it);
}

std::unique_ptr<StreamMarker> SimulatedDevice::mark(StreamId) {
  struct Done final : StreamMarker {
    bool done() const override { return true; }
    void wait() const override {}
  };
  return std::make_unique<Done>();
}

std::shared_ptr<CachingAllocator> simulated_caching_allocator(Device device, int64_t capacity) {
  return std::make_shared<CachingAllocator>(device, std::make_unique<SimulatedDevice>(capacity));
}

}  // namespace zg::cuda
