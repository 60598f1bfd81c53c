// Host -> device copies that do not make the host wait for the GPU: the bytes go
// through page-locked staging blocks (cuda/copy.cu's copy_to_device).
//
// Why: Backend::copy lets the caller reuse its host memory as soon as copy returns.
// A DMA straight from that memory runs only when the stream reaches it, so copy would
// have to wait for all the work queued before it -- in a training loop, one host
// synchronisation per batch uploaded, and the GPU idles while the host catches up.
// Instead the CPU copies the bytes into a staging block (a memcpy at host bandwidth)
// and queues the DMA from there; copy returns at once. (PyTorch gets this with
// pin_memory() and non_blocking=True, through its CachingHostAllocator.)
//
// A block is, at any time, one of:
//   free       no DMA from it is pending: it may be handed out;
//   in flight  its `done` event, recorded after its last DMA, has not completed.
// Invariant: a block is handed out only when free, so its bytes are never overwritten
// before the DMA has read them. An in-flight block becomes free once cudaEventQuery
// says its event completed -- looked at, never waited for.
//
// Blocks are allocated on demand (cudaHostAlloc, sizes powers of two from 64 KiB) and
// kept for reuse. A copy above kMaxStagedBytes, or one that would take the pool past
// kMaxPoolBytes, is not staged: the caller copies directly and waits (loading a
// checkpoint or moving a model, not a batch of tokens). One pool per rank and GPU, in
// its RankState: at most kMaxPoolBytes of page-locked memory each.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/stream.h"

namespace zg::cuda {

class HostStaging {
 public:
  static constexpr int64_t kMinBlockBytes = int64_t{64} << 10;
  static constexpr int64_t kMaxStagedBytes = int64_t{4} << 20;
  static constexpr int64_t kMaxPoolBytes = int64_t{32} << 20;

  explicit HostStaging(int device) : device_(device) {}
  ~HostStaging();  // waits for the DMAs in flight, then frees the blocks
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Copies `bytes` bytes from host memory `src` to device memory `dst`, queued on
  // `stream` of this pool's GPU, and returns without waiting: `src` may be reused at
  // once. False, having done nothing, when the copy is not staged (see above).
  bool copy_to_device(void* dst, const void* src, int64_t bytes, cudaStream_t stream);

  int64_t pinned_bytes() const;  // page-locked host memory the pool holds

 private:
  struct Block {
    void* host = nullptr;
    int64_t bytes = 0;
    std::unique_ptr<Event> done;  // recorded after the block's last DMA; null before the first
  };
  bool is_free(const Block& block) const { return !block.done || block.done->query(); }

  int device_;
  mutable std::mutex mutex_;
  std::vector<Block> blocks_;
  int64_t pinned_bytes_ = 0;
};

}  // namespace zg::cuda
