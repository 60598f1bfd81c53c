#include "cuda/allocation_history.h"

namespace zg::cuda {

const char* name(MemoryAction action) {
  switch (action) {
    case MemoryAction::alloc: return "alloc";
    case MemoryAction::free: return "free";
    case MemoryAction::pending_free: return "pending_free";
    case MemoryAction::segment_alloc: return "segment_alloc";
    case MemoryAction::segment_free: return "segment_free";
  }
  return "?";
}

void AllocationHistory::record(MemoryAction action, const void* address, int64_t size, int64_t requested,
                               std::optional<MemoryCategory> category, StreamId stream) {
  if (capacity_ == 0) return;
  if (events_.size() == capacity_) {
    events_.pop_front();
    ++dropped_;
  }
  const auto elapsed = std::chrono::steady_clock::now() - start_;
  events_.push_back({std::chrono::duration_cast<std::chrono::microseconds>(elapsed).count(), action,
                     reinterpret_cast<std::uintptr_t>(address), size, requested, category, stream});
}

}  // namespace zg::cuda
