// Timing for the benches: milliseconds per call of a function that issues work on a
// device. On CUDA the calls are bracketed by two events on the rank's compute stream
// and nothing waits between them, so the figure is the GPU's time, not the host's;
// on the CPU, wall-clock time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#ifdef ZG_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/stream.h"
#endif
#include "tensor/device.h"

namespace zg::bench {

#ifdef ZG_WITH_CUDA
class TimingEvent {
 public:
  TimingEvent() { ZG_CUDA_CHECK(cudaEventCreate(&event_)); }
  ~TimingEvent() { cudaEventDestroy(event_); }
  TimingEvent(const TimingEvent&) = delete;
  TimingEvent& operator=(const TimingEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};
#endif

inline double ms_per_call(const std::function<void()>& call, int64_t iters, Device device) {
#ifdef ZG_WITH_CUDA
  if (device.type == DeviceType::cuda) {
    cuda::DeviceGuard guard(device.index);
    const cudaStream_t stream = cuda::current_stream(device);
    TimingEvent start, stop;
    ZG_CUDA_CHECK(cudaEventRecord(start.get(), stream));
    for (int64_t i = 0; i < iters; ++i) call();
    ZG_CUDA_CHECK(cudaEventRecord(stop.get(), stream));
    ZG_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float elapsed_ms = 0;
    ZG_CUDA_CHECK(cudaEventElapsedTime(&elapsed_ms, start.get(), stop.get()));
    return elapsed_ms / static_cast<double>(iters);
  }
#endif
  (void)device;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) call();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
         static_cast<double>(iters);
}

}  // namespace zg::bench
