// The host pool on a machine with a GPU (Context::host_allocator): page-locked memory
// from cudaHostAlloc, so the GPU's copy engines move offloaded gradients and weights
// asynchronously at full bus speed (pageable memory goes through a driver bounce
// buffer and blocks the host). Pinning is slow and pins physical pages, so the pool
// holds long-lived state (master weights, Adam m and v, gradient shards): nothing is
// cached, a freed block goes straight back. Accounting is the Allocator's, apart from
// the ordinary CPU allocator's.
#include <cuda_runtime.h>

#include "cuda/backend.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "tensor/backend.h"

namespace zg::cuda {

namespace {

class PinnedAllocator final : public Allocator {
 public:
  PinnedAllocator() : Allocator(kCPU) {}

 private:
  void* acquire(int64_t bytes, MemoryCategory category) override {
    if (!fits_cap(bytes)) throw_out_of_memory(bytes, category, "over the memory cap");
    void* ptr = nullptr;
    const cudaError_t status = cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocPortable);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw_out_of_memory(bytes, category, "cudaHostAlloc could not page-lock that much host memory");
    }
    ZG_CUDA_CHECK(status);
    add_reserved(bytes);
    return ptr;
  }
  void release(void* ptr, int64_t bytes) override {
    cudaFreeHost(ptr);  // errors dropped: at exit the runtime may be gone
    add_reserved(-bytes);
  }
};

}  // namespace

std::shared_ptr<Allocator> make_page_locked_allocator() {
  if (device_count() == 0) return nullptr;  // no GPU to copy to: ordinary memory serves
  return std::make_shared<PinnedAllocator>();
}

}  // namespace zg::cuda
