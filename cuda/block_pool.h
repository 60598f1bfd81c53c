// The blocks a caching allocator carves its segments into, and a pool of the free
// ones ordered for best fit. See caching_allocator_core.h for the states and
// invariants the allocator keeps over them.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "cuda/memory_source.h"
#include "tensor/memory.h"

namespace zg::cuda {

enum class BlockState : uint8_t {
  free,          // in its pool, ready for a request on its stream
  allocated,     // handed out
  pending_free,  // freed by its owner, still in use by other streams' work (waiting on markers)
};
const char* name(BlockState state);

// A piece of one segment (one cudaMalloc). The blocks of a segment tile it in
// address order, linked through prev / next.
struct CachedBlock {
  char* ptr = nullptr;
  int64_t size = 0;
  StreamId stream{};  // the segment's stream: the only stream this block is handed to
  bool small = false;   // the segment belongs to the small pool
  BlockState state = BlockState::free;
  CachedBlock* prev = nullptr;  // neighbours in the segment; nullptr at its ends
  CachedBlock* next = nullptr;

  // While allocated (and pending free): the request, and the other streams that used the
  // bytes (record_stream); while pending free, one marker per such stream.
  int64_t requested = 0;
  MemoryCategory category = MemoryCategory::other;
  std::vector<StreamId> used_on;
  std::vector<std::unique_ptr<StreamMarker>> markers;

  bool whole_segment() const { return !prev && !next; }
};

// The free blocks of one pool, ordered by (stream, size, address): the best fit for a
// request is one lower_bound, and among equal sizes the lowest address wins, which keeps
// reuse deterministic.
class BlockPool {
 public:
  void insert(CachedBlock* block);
  void erase(CachedBlock* block);
  // The smallest free block on `stream` with at least `size` bytes, or nullptr.
  CachedBlock* best_fit(StreamId stream, int64_t size) const;
  int64_t largest() const;  // 0 when empty
  // The free blocks that span a whole segment (what emptying the cache gives back).
  std::vector<CachedBlock*> whole_segments() const;
  size_t size() const { return blocks_.size(); }

 private:
  struct Key {
    StreamId stream;
    int64_t size;
    const char* ptr;
  };
  struct Order {
    using is_transparent = void;
    static Key key(const CachedBlock* b) { return {b->stream, b->size, b->ptr}; }
    static Key key(const Key& k) { return k; }
    template <class A, class B>
    bool operator()(const A& a, const B& b) const {
      const Key x = key(a), y = key(b);
      if (x.stream != y.stream) return x.stream < y.stream;
      if (x.size != y.size) return x.size < y.size;
      return x.ptr < y.ptr;
    }
  };
  std::set<CachedBlock*, Order> blocks_;
};

}  // namespace zg::cuda
