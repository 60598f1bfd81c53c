// The caching, stream-ordered allocator behind every GPU tensor, written against an
// abstract MemorySource so that all of its logic builds and is tested without a GPU
// (cuda/caching_allocator.cu plugs in the CUDA runtime). The accounting by category,
// peaks and the cap live in the Allocator base class (tensor/memory.h).
//
// Why cache: cudaMalloc and cudaFree are slow and cudaFree synchronises the device,
// so blocks freed by one training step are kept and handed to the next.
//
// Sizes. Every request is rounded up to a multiple of 512 B (so blocks stay aligned
// for any vector load, and split remainders are always usable sizes):
//   small pool: rounded size <= 1 MiB; segments of 2 MiB, each shared by many blocks;
//   large pool: rounded size  > 1 MiB; a request < 10 MiB takes a 20 MiB segment (so a
//               few mid-size tensors do not each cost a cudaMalloc), a larger one a
//               segment of its own, rounded up to a multiple of 2 MiB.
// A block found for a request is split so that the block handed out is exactly the
// rounded size; the remainder stays free in the same pool.
//
// Block states (block_pool.h): free -> allocated -> free, or allocated -> pending free
// -> free when the block's bytes were also used by other streams (record_stream).
//
// Invariants (under the Allocator lock):
//   1. The blocks of a segment tile it: contiguous, in address order through prev/next.
//   2. No two neighbours in a segment are both free: a freed block merges with free
//      neighbours at once (allocated and pending-free neighbours are left alone).
//   3. Each free block is in exactly one pool, the one of its segment; allocated and
//      pending-free blocks are in none. Every block is owned by blocks_, keyed by address.
//   4. A block is handed out only for requests on its segment's stream, so work on that
//      stream is ordered after the previous owner's work without any event.
//   5. A pending-free block becomes free only once every marker recorded at its free, one
//      on each other stream that used it, is done.
//   6. An allocated block's size is round_size(requested bytes): reserved_by in the stats
//      is exact; reserved (in the stats) is the sum of the segments' sizes and stays
//      within the cap.
//
// Growth: when no free block fits but pending frees that would return to this stream's
// pool add up to the request, the host waits for the oldest of them (its markers) and
// looks again, before it takes a new segment. Such frees come from buffers other
// streams used -- a collective's on the communication stream -- freed while the host
// runs ahead of the GPU: without the wait, each ZeRO-3 gather or ZeRO-2 gradient of a
// step would take fresh memory until the GPU caught up, and reserved bytes would grow
// towards the whole model. (PyTorch's FSDP bounds the same thing with its all-gather
// rate limiter.) Waiting on an issued collective cannot deadlock: each marker needs
// only collectives every rank has issued or will issue without waiting on this one.
//
// Out of memory: when no free block fits and no segment can be had (device full, or the
// cap reached), the host first waits for every pending free's marked work (one may merge
// with its free neighbours into a fit) and looks again; then every whole free segment is given
// back (empty_cache), and the segment is asked for once more; then OutOfMemory is thrown
// with the requested bytes, allocated and reserved bytes per category, cap and largest
// free block.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/allocation_history.h"
#include "cuda/block_pool.h"
#include "cuda/memory_source.h"
#include "tensor/memory.h"
#include "tensor/tensor.h"

namespace zg::cuda {

class CachingAllocator final : public Allocator {
 public:
  static constexpr int64_t kMiB = int64_t{1} << 20;
  static constexpr int64_t kGranularity = 512;      // every block size is a multiple of it
  static constexpr int64_t kSmallRequest = 1 * kMiB;  // up to here: the small pool
  static constexpr int64_t kSmallSegment = 2 * kMiB;
  static constexpr int64_t kLargeRequest = 10 * kMiB;  // from here: a segment of its own
  static constexpr int64_t kMidSegment = 20 * kMiB;    // shared by large requests below kLargeRequest
  static constexpr int64_t kLargeSegmentRounding = 2 * kMiB;
  static constexpr int64_t kMaxRequest = int64_t{1} << 48;  // 256 TiB: beyond any device (and overflow)
  static constexpr size_t kDefaultHistory = 50'000;         // events kept for snapshot_json

  // The block size a request of `bytes` (> 0) gets, and the segment taken for it when no
  // cached block fits.
  static int64_t round_size(int64_t bytes);
  static int64_t segment_size(int64_t size);

  CachingAllocator(Device device, std::unique_ptr<MemorySource> source, size_t history = kDefaultHistory);
  ~CachingAllocator() override;

  // The allocated block starting at `ptr` is also used by work on `stream`: when it is
  // freed, it is reused only after that work (issued up to the free) has finished.
  void record_stream(const void* ptr, StreamId stream);
  // Gives every whole free segment back to the device (after completed pending frees).
  void empty_cache();

  // The allocation events in order, the current segments with their blocks, and the
  // totals, as one JSON document (see snapshot_json in the .cpp for its fields).
  std::string snapshot_json() const;
  void write_snapshot(const std::string& path) const;

 protected:
  void* acquire(int64_t bytes, MemoryCategory category) override;
  void release(void* ptr, int64_t bytes) override;
  int64_t block_size(int64_t bytes) const override { return round_size(bytes); }
  int64_t largest_free_block() const override;

 private:
  BlockPool& pool_of(const CachedBlock& block) { return block.small ? small_ : large_; }
  CachedBlock* allocated_block(const void* ptr, const char* op) const;
  CachedBlock* take_segment(int64_t size, StreamId stream, MemoryCategory category);
  void split(CachedBlock* block, int64_t size);
  void free_block(CachedBlock* block);
  CachedBlock* merge(CachedBlock* a, CachedBlock* b);
  void process_pending_frees();
  void wait_for_pending_frees();
  int64_t reclaimable(StreamId stream, bool small) const;
  bool wait_for_oldest_pending(StreamId stream, bool small);
  void release_cached_segments();
  void record(MemoryAction action, const CachedBlock& block);

  std::unique_ptr<MemorySource> source_;
  std::unordered_map<const char*, std::unique_ptr<CachedBlock>> blocks_;
  BlockPool small_, large_;
  std::vector<CachedBlock*> pending_;  // pending-free blocks, in the order they were freed
  AllocationHistory history_;
};

// `tensor`'s storage is also used by work on `stream` (see CachingAllocator::record_stream).
// Throws zg::Error when the tensor is undefined, released or not from a caching allocator.
void record_stream(const Tensor& tensor, StreamId stream);

// The current rank context's allocator for `device`, as a caching allocator; throws
// zg::Error when that device's allocator does not cache (cpu, meta).
CachingAllocator& caching_allocator(Device device);

}  // namespace zg::cuda
