#include "cuda/host_staging.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "cuda/check.h"

namespace zg::cuda {

HostStaging::~HostStaging() {
  // Destructors must not throw: errors are dropped (at exit the runtime may be gone).
  for (Block& block : blocks_) {
    if (block.done) cudaEventSynchronize(block.done->get());
    cudaFreeHost(block.host);
  }
}

bool HostStaging::copy_to_device(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes > kMaxStagedBytes) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  // The smallest free block that holds the bytes (best fit keeps big blocks for big copies).
  Block* chosen = nullptr;
  for (Block& block : blocks_)
    if (block.bytes >= bytes && (!chosen || block.bytes < chosen->bytes) && is_free(block)) chosen = &block;
  if (!chosen) {
    const int64_t size = std::max(kMinBlockBytes, static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(bytes))));
    if (pinned_bytes_ + size > kMaxPoolBytes) return false;
    Block block;
    block.bytes = size;
    const cudaError_t status = cudaHostAlloc(&block.host, static_cast<size_t>(size), cudaHostAllocPortable);
    if (status == cudaErrorMemoryAllocation) {  // page-locked memory is scarce: copy unstaged
      cudaGetLastError();
      return false;
    }
    ZG_CUDA_CHECK(status);
    pinned_bytes_ += size;
    blocks_.push_back(std::move(block));
    chosen = &blocks_.back();
  }
  std::memcpy(chosen->host, src, static_cast<size_t>(bytes));
  DeviceGuard guard(device_);  // the event belongs to the stream's device
  ZG_CUDA_CHECK(cudaMemcpyAsync(dst, chosen->host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream));
  if (!chosen->done) chosen->done = std::make_unique<Event>();
  chosen->done->record(stream);
  return true;
}

int64_t HostStaging::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pinned_bytes_;
}

}  // namespace zg::cuda
