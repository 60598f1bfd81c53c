// CUDA streams and events as RAII types, and the streams of the current rank.
//
// Each rank context (tensor/context.h) owns, per GPU, one compute stream (every
// kernel of that rank runs on it, in issue order) and one communication stream
// (collectives, so they overlap compute). Ranks that share one GPU therefore
// never serialise on a common stream. Nothing here synchronises the host but
// wait_for_stream and Event::synchronize, which say so and are counted.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tensor/device.h"

namespace zg::cuda {

// Makes `device` current for the scope (cudaSetDevice), restoring the previous one
// only if it changed and the thread had chosen it (setting a device creates its
// context: a thread that never used GPU 0 should not get one there on the way out; a
// thread's first device simply stays current).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// A non-blocking stream (does not synchronise with the legacy default stream).
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

// A timing-disabled event: marks a point in a stream's work.
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream);
  bool query() const;                // true once the recorded work has finished (never blocks)
  void synchronize() const;          // blocks the host until then
  void block(cudaStream_t waiter) const;  // `waiter` waits for it on the device (cudaStreamWaitEvent)
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Blocks the host until the work queued on `stream` so far has finished. Every wait of
// the backend goes through here or Event::synchronize (copies to the host,
// Backend::synchronize), and each is counted in host_waits().
void wait_for_stream(cudaStream_t stream);

// How many times this process's host has waited for a GPU (all ranks and devices): a
// training step must not change it (tests/test_cuda.cpp, bench/train_step).
int64_t host_waits();

// The current rank context's streams on `device` (created on first use).
cudaStream_t current_stream(Device device);
cudaStream_t communication_stream(Device device);

}  // namespace zg::cuda
