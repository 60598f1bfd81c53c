// The CUDA backend's registration and allocator. The library registers the
// backend when it is loaded; whether a GPU is actually there is only asked when
// a cuda:N tensor is first allocated, so a CUDA build runs fine without one.
#include "cuda/backend.h"
#include "cuda/caching_allocator.h"
#include "cuda/check.h"
#include "cuda/deferred_errors.h"
#include "cuda/stream.h"

namespace zg::cuda {

void require_device(Device device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear it, so that later calls do not see it
    fail(device.str(), " requested but no CUDA device is visible (cudaGetDeviceCount: ", cudaGetErrorName(status),
         ": ", cudaGetErrorString(status), ")");
  }
  ZG_CHECK(count > 0, device.str(), " requested but no CUDA device is visible (cudaGetDeviceCount: 0 devices)");
  ZG_CHECK(device.index >= 0 && device.index < count, device.str(), " requested but only ", count,
           " CUDA device(s) are visible (cuda:0 to cuda:", count - 1, ")");
}

// Every cuda:N tensor is allocated through this, so it is where a missing GPU is found.
std::shared_ptr<Allocator> CudaBackend::make_allocator(Device device) {
  require_device(device);
  return make_caching_allocator(device);
}

// The rank's compute stream, drained (a host-side collective's ranks read each other's buffers).
void CudaBackend::synchronize(Device device) {
  DeviceGuard guard(device.index);
  wait_for_stream(current_stream(device));
  raise_deferred_errors(device);
}

namespace {

CudaBackend& instance() {
  static CudaBackend backend;
  return backend;
}

// Static registration: runs when the library is loaded, makes no CUDA call.
[[maybe_unused]] const bool registered = [] {
  register_backend(DeviceType::cuda, &instance());
  register_pinned_allocator(&make_page_locked_allocator);
  return true;
}();

}  // namespace

}  // namespace zg::cuda
