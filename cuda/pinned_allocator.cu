// The host pool on a machine with a GPU (Context::host_allocator): page-locked memory
// from cudaHostAlloc, so the GPU's copy engines move offloaded gradients and weights
// asynchronously at full bus speed (pageable memory goes through a driver bounce
// buffer and blocks the host). Pinning is slow, and the file tier (offload nvme) frees and
// takes the same units' buffers every step, so freed blocks of 1 MiB and more are cached
// by size (tensor/block_cache.h) and drained before the cap refuses a request. Accounting
// is the Allocator's, apart from the ordinary CPU allocator's.
#include <cuda_runtime.h>

#include "cuda/backend.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "tensor/backend.h"
#include "tensor/block_cache.h"

namespace zg::cuda {

namespace {

class PinnedAllocator final : public Allocator {
 public:
  PinnedAllocator() : Allocator(kCPU) {}
  ~PinnedAllocator() override {
    cache_.drain([](void* ptr, int64_t) { cudaFreeHost(ptr); });
  }

 private:
  int64_t largest_free_block() const override { return cache_.largest(); }
  void* acquire(int64_t bytes, MemoryCategory category) override {
    if (void* ptr = cache_.take(bytes)) return ptr;
    if (!fits_cap(bytes) && cache_.held() > 0) {  // the cache first, then the cap's refusal
      cache_.drain([this](void* ptr, int64_t size) { free_block(ptr, size); });
      add_retry();
    }
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
    if (!cache_.keep(ptr, bytes)) free_block(ptr, bytes);
  }
  void free_block(void* ptr, int64_t bytes) {
    cudaFreeHost(ptr);  // errors dropped: at exit the runtime may be gone
    add_reserved(-bytes);
  }

  BlockCache cache_;
};

}  // namespace

std::shared_ptr<Allocator> make_page_locked_allocator() {
  if (device_count() == 0) return nullptr;  // no GPU to copy to: ordinary memory serves
  return std::make_shared<PinnedAllocator>();
}

}  // namespace zg::cuda
