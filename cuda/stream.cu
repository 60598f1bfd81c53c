#include "cuda/stream.h"

#include <atomic>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/rank_state.h"
#include "tensor/context.h"

namespace zg::cuda {

// Destructors drop CUDA errors: they must not throw, and at process exit the runtime may
// already be unloaded.

namespace {
// Whether this thread has made a device current. Until it has, cudaGetDevice says 0
// without a context existing there, and setting 0 back on the way out would create one
// (cudaSetDevice makes the primary context): under mpirun every rank would hold one on
// GPU 0. So a thread's first device stays current (as PyTorch's MaybeSetDevice).
thread_local bool device_chosen = false;
}  // namespace

DeviceGuard::DeviceGuard(int device) {
  ZG_CUDA_CHECK(cudaGetDevice(&previous_));
  if (device != previous_) {
    ZG_CUDA_CHECK(cudaSetDevice(device));
    changed_ = device_chosen;
  }
  device_chosen = true;
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

Stream::Stream(int device) : device_(device) {
  DeviceGuard guard(device);
  ZG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

Stream::~Stream() { cudaStreamDestroy(stream_); }

// Created on the current device; record it only on that device's streams.
Event::Event() { ZG_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }

Event::~Event() { cudaEventDestroy(event_); }

void Event::record(cudaStream_t stream) { ZG_CUDA_CHECK(cudaEventRecord(event_, stream)); }

bool Event::query() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    cudaGetLastError();  // "not yet" is an answer, not an error: do not leave it for the next check
    return false;
  }
  ZG_CUDA_CHECK(status);
  return true;
}

namespace {
std::atomic<int64_t> waits{0};
}  // namespace

void Event::synchronize() const {
  waits.fetch_add(1, std::memory_order_relaxed);
  ZG_CUDA_CHECK(cudaEventSynchronize(event_));
}

void wait_for_stream(cudaStream_t stream) {
  waits.fetch_add(1, std::memory_order_relaxed);
  ZG_CUDA_CHECK(cudaStreamSynchronize(stream));
}

int64_t host_waits() { return waits.load(std::memory_order_relaxed); }

void Event::block(cudaStream_t waiter) const { ZG_CUDA_CHECK(cudaStreamWaitEvent(waiter, event_, 0)); }

RankState::~RankState() {
  attention_graphs.reset();
  if (cudnn_) cudnnDestroy(cudnn_);
  if (cublas_) cublasDestroy(cublas_);
  if (cublas_lt_) cublasLtDestroy(cublas_lt_);
}

cublasHandle_t RankState::cublas() {
  std::call_once(cublas_made_, [&] {
    DeviceGuard guard(device_);
    ZG_CUBLAS_CHECK(cublasCreate(&cublas_));
    ZG_CUBLAS_CHECK(cublasSetMathMode(
        cublas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  });
  return cublas_;
}

cublasLtHandle_t RankState::cublas_lt() {
  std::call_once(cublas_lt_made_, [&] {
    DeviceGuard guard(device_);
    ZG_CUBLAS_CHECK(cublasLtCreate(&cublas_lt_));
  });
  return cublas_lt_;
}

cudnnHandle_t RankState::cudnn() {
  std::call_once(cudnn_made_, [&] {
    DeviceGuard guard(device_);  // a handle belongs to the device current when it is made
    ZG_CUDNN_CHECK(cudnnCreate(&cudnn_));
  });
  return cudnn_;
}

std::shared_ptr<RankState> shared_rank_state(Device device) {
  ZG_CHECK(device.type == DeviceType::cuda, "cuda: ", device.str(), " is not a GPU");
  // The slot holds a RankState for every cuda device: only this function fills it.
  const std::shared_ptr<void> state = Context::current().backend_state(device, [device] {
    check_device(device.index);
    return std::static_pointer_cast<void>(std::make_shared<RankState>(device.index));
  });
  return std::static_pointer_cast<RankState>(state);
}

RankState& rank_state(Device device) { return *shared_rank_state(device); }

cudaStream_t current_stream(Device device) { return rank_state(device).compute.get(); }

cudaStream_t communication_stream(Device device) { return rank_state(device).communication.get(); }

}  // namespace zg::cuda
