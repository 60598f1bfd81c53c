// What the caching allocator needs from a device, and nothing more: segments of
// memory, the stream the caller's work goes to, and markers of a stream's progress.
// cuda/caching_allocator.cu plugs in cudaMalloc / cudaFree / cudaEvent*; the tests
// plug in host memory and markers they complete by hand. No CUDA header here.
#pragma once

#include <cstdint>
#include <memory>

namespace zg::cuda {

// A stream by value: a cudaStream_t's address (0 is the legacy default stream). A type
// of its own, so it never converts to or from a plain number or pointer by accident.
enum class StreamId : std::uintptr_t {};

// The point a stream's work had reached when the marker was made (a CUDA event).
class StreamMarker {
 public:
  virtual ~StreamMarker() = default;
  virtual bool done() const = 0;  // true once that work has finished; never blocks
  virtual void wait() const = 0;  // blocks the host until then (only when memory runs out)
};

class MemorySource {
 public:
  virtual ~MemorySource() = default;
  // `bytes` of device memory, or nullptr when the device has no room (any other failure throws).
  virtual void* allocate_segment(int64_t bytes) = 0;
  virtual void free_segment(void* ptr) = 0;
  // The stream the calling thread's work goes to: each allocation is ordered on it.
  virtual StreamId current_stream() = 0;
  // Marks the work issued to `stream` so far.
  virtual std::unique_ptr<StreamMarker> mark(StreamId stream) = 0;
};

}  // namespace zg::cuda
