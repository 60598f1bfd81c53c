// A bounded log of what a caching allocator did, in order, for drawing a memory
// timeline: each request handed out or given back, and each segment taken from or
// returned to the device. The oldest events are dropped once `capacity` is reached,
// so a long run keeps its latest steps and a bounded footprint.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>

#include "cuda/memory_source.h"
#include "tensor/memory.h"

namespace zg::cuda {

enum class MemoryAction : uint8_t {
  alloc,          // a block was handed out
  free,           // a block became reusable (at once, or when its pending free completed)
  pending_free,   // its owner freed a block that other streams still use
  segment_alloc,  // bytes taken from the device (cudaMalloc)
  segment_free,   // bytes given back to the device (cudaFree)
};
const char* name(MemoryAction action);

struct MemoryEvent {
  int64_t time_us = 0;  // since the history began
  MemoryAction action = MemoryAction::alloc;
  std::uintptr_t address = 0;
  int64_t size = 0;       // the block's or the segment's bytes
  int64_t requested = 0;  // the bytes asked for (blocks); 0 for segments
  std::optional<MemoryCategory> category;  // the request's category (none for a segment_free)
  StreamId stream{};
};

class AllocationHistory {
 public:
  explicit AllocationHistory(size_t capacity) : capacity_(capacity) {}

  void record(MemoryAction action, const void* address, int64_t size, int64_t requested,
              std::optional<MemoryCategory> category, StreamId stream);
  const std::deque<MemoryEvent>& events() const { return events_; }
  int64_t dropped() const { return dropped_; }  // events pushed out by newer ones
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::deque<MemoryEvent> events_;
  int64_t dropped_ = 0;
};

}  // namespace zg::cuda
