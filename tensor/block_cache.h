// The host pool's cache: freed blocks kept by their exact size for the next request of that
// size (PyTorch's CachingHostAllocator does the same). The file tier pages the same units'
// buffers out and back in every step; without the cache each page-in takes fresh memory --
// a page fault per 4 KiB, and with a GPU cudaHostAlloc's pinning, slower still. Blocks under
// kMinBytes are not kept (malloc reuses those already). The allocator counts cached bytes
// as reserved and drains the cache before it refuses a request for its cap.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace zg {

class BlockCache {
 public:
  static constexpr int64_t kMinBytes = int64_t{1} << 20;

  // A cached block of exactly `bytes`, or nullptr.
  void* take(int64_t bytes) {
    const auto it = free_.find(bytes);
    if (it == free_.end()) return nullptr;
    void* ptr = it->second.back();
    it->second.pop_back();
    if (it->second.empty()) free_.erase(it);
    held_ -= bytes;
    return ptr;
  }
  // Keeps a freed block (true), or declines one under kMinBytes (false: the caller frees it).
  bool keep(void* ptr, int64_t bytes) {
    if (bytes < kMinBytes) return false;
    free_[bytes].push_back(ptr);
    held_ += bytes;
    return true;
  }
  // free(ptr, bytes) for every cached block.
  template <class Free>
  void drain(Free free) {
    for (const auto& [bytes, blocks] : free_)
      for (void* ptr : blocks) free(ptr, bytes);
    free_.clear();
    held_ = 0;
  }
  int64_t held() const { return held_; }
  int64_t largest() const { return free_.empty() ? 0 : free_.rbegin()->first; }

 private:
  std::map<int64_t, std::vector<void*>> free_;
  int64_t held_ = 0;
};

}  // namespace zg
