#include "cuda/caching_allocator_core.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tensor/context.h"
#include "tensor/error.h"
#include "tensor/storage.h"

namespace zg::cuda {

int64_t CachingAllocator::round_size(int64_t bytes) {
  return std::max(kGranularity, (bytes + kGranularity - 1) / kGranularity * kGranularity);
}

int64_t CachingAllocator::segment_size(int64_t size) {
  if (size <= kSmallRequest) return kSmallSegment;
  if (size < kLargeRequest) return kMidSegment;
  return (size + kLargeSegmentRounding - 1) / kLargeSegmentRounding * kLargeSegmentRounding;
}

CachingAllocator::CachingAllocator(Device device, std::unique_ptr<MemorySource> source, size_t history)
    : Allocator(device), source_(std::move(source)), history_(history) {
  ZG_CHECK(source_ != nullptr, "caching allocator for ", device.str(), ": no memory source");
}

CachingAllocator::~CachingAllocator() {
  // Storages hold their allocator, so nothing is allocated any more. Pending frees need no
  // wait: cudaFree waits for the device's work first. At process exit the CUDA runtime may
  // already be unloaded, and a destructor must not throw, so a failure here is dropped.
  for (const auto& [ptr, block] : blocks_) {
    if (block->prev) continue;  // not the start of a segment
    try {
      source_->free_segment(block->ptr);
    } catch (const std::exception&) {
    }
  }
}

void* CachingAllocator::acquire(int64_t bytes, MemoryCategory category) {
  if (bytes > kMaxRequest) throw_out_of_memory(bytes, category, "larger than any device");
  const int64_t size = round_size(bytes);
  const StreamId stream = source_->current_stream();
  process_pending_frees();
  const bool small = size <= kSmallRequest;
  BlockPool& pool = small ? small_ : large_;
  CachedBlock* block = pool.best_fit(stream, size);
  // Reuse before growth: while pending frees that could serve the request add up to it,
  // wait for the oldest (see "Growth" at the top of caching_allocator_core.h).
  while (!block && reclaimable(stream, small) >= size && wait_for_oldest_pending(stream, small))
    block = pool.best_fit(stream, size);
  if (!block) block = take_segment(size, stream, category);
  if (!block && !pending_.empty()) {  // no room: any pending free may merge into a fit
    wait_for_pending_frees();
    block = pool.best_fit(stream, size);
    if (!block) block = take_segment(size, stream, category);
  }
  if (!block) {  // the device or the cap is full: give the cache back, then ask once more
    add_retry();
    release_cached_segments();
    block = take_segment(size, stream, category);
  }
  if (!block)
    throw_out_of_memory(bytes, category, fits_cap(segment_size(size)) ? "the device is full" : "over the memory cap");
  pool_of(*block).erase(block);
  if (block->size > size) split(block, size);
  block->state = BlockState::allocated;
  block->requested = bytes;
  block->category = category;
  record(MemoryAction::alloc, *block);
  return block->ptr;
}

void CachingAllocator::release(void* ptr, int64_t) {
  CachedBlock* block = allocated_block(ptr, "deallocate");
  if (block->used_on.empty()) {
    record(MemoryAction::free, *block);
    free_block(block);
    return;
  }
  // Work already issued to the other streams may still read or write the bytes: mark it,
  // and keep the block out of the pools until every mark is passed.
  // release() runs from a storage's destructor, which must not throw: if the device
  // cannot mark a stream (a sticky CUDA error, or the runtime already torn down at exit),
  // the block is never reused rather than reused too early.
  try {
    for (const StreamId stream : block->used_on) block->markers.push_back(source_->mark(stream));
  } catch (const std::exception&) {
    struct Never final : StreamMarker {
      bool done() const override { return false; }
      void wait() const override {}  // nothing to wait for: it is never done
    };
    block->markers.clear();
    block->markers.push_back(std::make_unique<Never>());
  }
  block->state = BlockState::pending_free;
  record(MemoryAction::pending_free, *block);
  pending_.push_back(block);
}

void CachingAllocator::record_stream(const void* ptr, StreamId stream) {
  const auto guard = lock();
  CachedBlock* block = allocated_block(ptr, "record_stream");
  if (stream == block->stream) return;  // work on the block's own stream is ordered already
  if (std::find(block->used_on.begin(), block->used_on.end(), stream) == block->used_on.end())
    block->used_on.push_back(stream);
}

void CachingAllocator::empty_cache() {
  const auto guard = lock();
  process_pending_frees();
  release_cached_segments();
}

int64_t CachingAllocator::largest_free_block() const { return std::max(small_.largest(), large_.largest()); }

CachedBlock* CachingAllocator::allocated_block(const void* ptr, const char* op) const {
  const auto it = blocks_.find(static_cast<const char*>(ptr));
  ZG_CHECK(it != blocks_.end() && it->second->state == BlockState::allocated, op, ": ", ptr,
           " is not an allocated block of the caching allocator on ", device().str());
  return it->second.get();
}

CachedBlock* CachingAllocator::take_segment(int64_t size, StreamId stream, MemoryCategory category) {
  const int64_t bytes = segment_size(size);
  if (!fits_cap(bytes)) return nullptr;
  void* ptr = source_->allocate_segment(bytes);
  if (!ptr) return nullptr;
  add_reserved(bytes);
  auto segment = std::make_unique<CachedBlock>();
  segment->ptr = static_cast<char*>(ptr);
  segment->size = bytes;
  segment->stream = stream;
  segment->small = size <= kSmallRequest;
  history_.record(MemoryAction::segment_alloc, ptr, bytes, 0, category, stream);
  CachedBlock* block = segment.get();
  blocks_.emplace(block->ptr, std::move(segment));
  pool_of(*block).insert(block);
  return block;
}

// `block` (in no pool) keeps its first `size` bytes; the rest becomes a free block after it.
// The rest has no free neighbour to merge with: `block` was free, so its next was not.
void CachingAllocator::split(CachedBlock* block, int64_t size) {
  auto rest = std::make_unique<CachedBlock>();
  rest->ptr = block->ptr + size;
  rest->size = block->size - size;
  rest->stream = block->stream;
  rest->small = block->small;
  rest->prev = block;
  rest->next = block->next;
  if (block->next) block->next->prev = rest.get();
  block->next = rest.get();
  block->size = size;
  CachedBlock* free_rest = rest.get();
  blocks_.emplace(free_rest->ptr, std::move(rest));
  pool_of(*free_rest).insert(free_rest);
}

void CachingAllocator::free_block(CachedBlock* block) {
  block->state = BlockState::free;
  block->requested = 0;
  block->used_on.clear();
  block->markers.clear();
  BlockPool& pool = pool_of(*block);
  for (CachedBlock* neighbour : {block->prev, block->next}) {
    if (!neighbour || neighbour->state != BlockState::free) continue;
    pool.erase(neighbour);
    block = merge(block, neighbour);
  }
  pool.insert(block);
}

// Two neighbours, in no pool, become the lower one; the upper one is destroyed.
CachedBlock* CachingAllocator::merge(CachedBlock* a, CachedBlock* b) {
  CachedBlock* lower = a->ptr < b->ptr ? a : b;
  CachedBlock* upper = lower == a ? b : a;
  lower->size += upper->size;
  lower->next = upper->next;
  if (upper->next) upper->next->prev = lower;
  blocks_.erase(upper->ptr);
  return lower;
}

void CachingAllocator::process_pending_frees() {
  for (size_t i = 0; i < pending_.size();) {
    CachedBlock* block = pending_[i];
    const bool done = std::all_of(block->markers.begin(), block->markers.end(),
                                  [](const std::unique_ptr<StreamMarker>& marker) { return marker->done(); });
    if (!done) {
      ++i;
      continue;
    }
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    record(MemoryAction::free, *block);
    free_block(block);
  }
}

// Bytes of pending frees that would return to `stream`'s blocks in the small or large pool.
int64_t CachingAllocator::reclaimable(StreamId stream, bool small) const {
  int64_t bytes = 0;
  for (const CachedBlock* block : pending_)
    if (block->stream == stream && block->small == small) bytes += block->size;
  return bytes;
}

// Waits for the oldest such pending free's marked work, then frees what is done. False
// when nothing was freed (its marker can never be passed).
bool CachingAllocator::wait_for_oldest_pending(StreamId stream, bool small) {
  const auto oldest = std::find_if(pending_.begin(), pending_.end(), [&](const CachedBlock* block) {
    return block->stream == stream && block->small == small;
  });
  if (oldest == pending_.end()) return false;
  for (const auto& marker : (*oldest)->markers) marker->wait();
  const size_t before = pending_.size();
  process_pending_frees();
  return pending_.size() < before;
}

// The host waits until every pending free's marked work is done, then frees them all:
// better than failing while the memory is only a few kernels away from free (the host
// runs ahead of the GPU, and a collective on another stream may hold many blocks).
void CachingAllocator::wait_for_pending_frees() {
  for (CachedBlock* block : pending_)
    for (const auto& marker : block->markers) marker->wait();
  process_pending_frees();
}

void CachingAllocator::release_cached_segments() {
  for (BlockPool* pool : {&small_, &large_}) {
    for (CachedBlock* segment : pool->whole_segments()) {
      source_->free_segment(segment->ptr);
      pool->erase(segment);
      add_reserved(-segment->size);
      history_.record(MemoryAction::segment_free, segment->ptr, segment->size, 0, std::nullopt, segment->stream);
      blocks_.erase(segment->ptr);
    }
  }
}

void CachingAllocator::record(MemoryAction action, const CachedBlock& block) {
  history_.record(action, block.ptr, block.size, block.requested, block.category, block.stream);
}

// {"device", "granularity", "stats": {...}, "dropped_events",
//  "events": [{"time_us", "action", "address", "size", "requested", "category", "stream"}...],
//  "segments": [{"address", "size", "stream", "pool", "blocks": [{"address", "size", "state",
//                "requested", "category"}...]}...]}   (segments in address order)
std::string CachingAllocator::snapshot_json() const {
  const MemoryStats totals = stats();
  const auto guard = lock();
  using nlohmann::json;
  json doc;
  doc["device"] = device().str();
  doc["granularity"] = kGranularity;
  doc["stats"] = {{"allocated", totals.allocated_total},     {"peak_allocated", totals.peak_total},
                  {"reserved", totals.reserved},             {"peak_reserved", totals.peak_reserved},
                  {"cap", totals.cap},                       {"segment_allocations", totals.segment_allocations},
                  {"segment_frees", totals.segment_frees},   {"retries", totals.retries},
                  {"largest_free_block", totals.largest_free_block}, {"fragmentation", totals.fragmentation()}};
  doc["dropped_events"] = history_.dropped();
  json events = json::array();
  for (const MemoryEvent& e : history_.events())
    events.push_back({{"time_us", e.time_us},
                      {"action", name(e.action)},
                      {"address", e.address},
                      {"size", e.size},
                      {"requested", e.requested},
                      {"category", e.category ? json(name(*e.category)) : json(nullptr)},
                      {"stream", static_cast<std::uintptr_t>(e.stream)}});
  doc["events"] = std::move(events);

  std::vector<const CachedBlock*> segments;
  for (const auto& [ptr, block] : blocks_)
    if (!block->prev) segments.push_back(block.get());
  std::sort(segments.begin(), segments.end(), [](const CachedBlock* a, const CachedBlock* b) { return a->ptr < b->ptr; });
  json layout = json::array();
  for (const CachedBlock* head : segments) {
    json blocks = json::array();
    int64_t bytes = 0;
    for (const CachedBlock* b = head; b; b = b->next) {
      const bool in_use = b->state != BlockState::free;
      blocks.push_back({{"address", reinterpret_cast<std::uintptr_t>(b->ptr)},
                        {"size", b->size},
                        {"state", name(b->state)},
                        {"requested", b->requested},
                        {"category", in_use ? json(name(b->category)) : json(nullptr)}});
      bytes += b->size;
    }
    layout.push_back({{"address", reinterpret_cast<std::uintptr_t>(head->ptr)},
                      {"size", bytes},
                      {"stream", static_cast<std::uintptr_t>(head->stream)},
                      {"pool", head->small ? "small" : "large"},
                      {"blocks", std::move(blocks)}});
  }
  doc["segments"] = std::move(layout);
  return doc.dump();
}

void CachingAllocator::write_snapshot(const std::string& path) const {
  const std::string json = snapshot_json();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ZG_CHECK(out.good(), "write_snapshot: cannot open ", path, " for writing");
  out << json << "\n";
  out.close();
  ZG_CHECK(out.good(), "write_snapshot: writing ", path, " failed");
}

void record_stream(const Tensor& tensor, StreamId stream) {
  ZG_CHECK(tensor.defined(), "record_stream: the tensor is undefined");
  const Storage& storage = *tensor.storage();
  auto* allocator = dynamic_cast<CachingAllocator*>(storage.allocator().get());
  ZG_CHECK(allocator != nullptr, "record_stream: the tensor's storage on ", storage.device().str(),
           " does not come from a caching allocator");
  if (storage.nbytes() == 0) return;  // nothing was allocated
  allocator->record_stream(storage.data(), stream);
}

CachingAllocator& caching_allocator(Device device) {
  const std::shared_ptr<Allocator> allocator = Context::current().allocator(device);
  auto* caching = dynamic_cast<CachingAllocator*>(allocator.get());
  ZG_CHECK(caching != nullptr, "caching_allocator: the allocator for ", device.str(), " does not cache");
  return *caching;
}

}  // namespace zg::cuda
