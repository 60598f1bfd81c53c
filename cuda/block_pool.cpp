#include "cuda/block_pool.h"

#include <algorithm>

#include "tensor/error.h"

namespace zg::cuda {

const char* name(BlockState state) {
  switch (state) {
    case BlockState::free: return "free";
    case BlockState::allocated: return "allocated";
    case BlockState::pending_free: return "pending_free";
  }
  return "?";
}

void BlockPool::insert(CachedBlock* block) {
  const bool inserted = blocks_.insert(block).second;
  ZG_CHECK(inserted, "block pool: block at ", static_cast<void*>(block->ptr), " is already free");
}

void BlockPool::erase(CachedBlock* block) {
  const bool erased = blocks_.erase(block) == 1;
  ZG_CHECK(erased, "block pool: block at ", static_cast<void*>(block->ptr), " is not in the pool");
}

CachedBlock* BlockPool::best_fit(StreamId stream, int64_t size) const {
  const auto it = blocks_.lower_bound(Key{stream, size, nullptr});
  return it != blocks_.end() && (*it)->stream == stream ? *it : nullptr;
}

int64_t BlockPool::largest() const {
  int64_t largest = 0;
  for (const CachedBlock* block : blocks_) largest = std::max(largest, block->size);
  return largest;
}

std::vector<CachedBlock*> BlockPool::whole_segments() const {
  std::vector<CachedBlock*> segments;
  for (CachedBlock* block : blocks_)
    if (block->whole_segment()) segments.push_back(block);
  return segments;
}

}  // namespace zg::cuda
