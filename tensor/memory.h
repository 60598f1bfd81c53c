// Memory accounting: every byte an allocator hands out is tagged with what it is
// for, so a training step can be read as "parameters + gradients + optimizer
// state + activations + communication buffers".
//
// Invariants (held under the allocator's lock):
//   allocated_total == sum(allocated[c])      bytes handed out and not yet freed
//   peak[c] >= allocated[c], peak_total >= allocated_total
//   reserved >= allocated_total               bytes taken from the system
//   reserved >= sum(reserved_by[c])           the rest is cached: free blocks kept for reuse
//   reserved_by[c] >= allocated[c]            a block holds its request rounded up
// Figures are per allocator, and each rank context owns its allocators, so ranks
// running as threads of one process never see each other's bytes.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "tensor/device.h"

namespace zg {

enum class MemoryCategory : uint8_t {
  parameter,
  gradient,
  optimizer_state,
  activation,
  communication,
  workspace,
  other,
};
inline constexpr int kMemoryCategories = 7;
const char* name(MemoryCategory category);

struct MemoryStats {
  std::array<int64_t, kMemoryCategories> allocated{};  // current bytes, by category
  std::array<int64_t, kMemoryCategories> peak{};       // high-water mark, by category
  int64_t allocated_total = 0;
  int64_t peak_total = 0;      // high-water mark of allocated_total (not the sum of peaks)
  int64_t reserved = 0;        // bytes held from the system (>= allocated: caching, rounding)
  int64_t peak_reserved = 0;
  int64_t allocations = 0;     // allocate() calls that returned bytes
  int64_t cap = 0;             // bound on `reserved`; 0: no cap

  // Bytes of reserved memory occupied by each category's blocks (its requests after
  // the allocator's rounding), and their high-water marks.
  std::array<int64_t, kMemoryCategories> reserved_by{};
  std::array<int64_t, kMemoryCategories> peak_reserved_by{};
  int64_t segment_allocations = 0;  // times bytes were taken from the system (cudaMalloc calls)
  int64_t segment_frees = 0;        // times they were given back (cudaFree calls)
  int64_t retries = 0;              // allocations that had to free the cache and try again
  int64_t largest_free_block = 0;   // largest cached block ready for reuse (0 without a cache)

  int64_t operator[](MemoryCategory c) const { return allocated[static_cast<int>(c)]; }
  int64_t peak_of(MemoryCategory c) const { return peak[static_cast<int>(c)]; }
  int64_t reserved_of(MemoryCategory c) const { return reserved_by[static_cast<int>(c)]; }
  // 1 - allocated / reserved: the share of reserved bytes not holding a live allocation
  // (cached free blocks, rounding). 0 when nothing is reserved.
  double fragmentation() const {
    return reserved > 0 ? 1.0 - static_cast<double>(allocated_total) / static_cast<double>(reserved) : 0.0;
  }
};

std::string format_bytes(int64_t bytes);  // "4.00 KiB"
// A table of current and peak bytes per category (allocated, and reserved by its blocks),
// then totals, reserved bytes, and the segment / retry / fragmentation figures.
std::string memory_report(const MemoryStats& stats, const std::string& title);

// RAII: allocations made on this thread inside the scope are tagged `category`.
// Scopes nest; the default outside any scope is `other`.
class MemoryScope {
 public:
  explicit MemoryScope(MemoryCategory category);
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;
  static MemoryCategory current();

 private:
  MemoryCategory previous_;
};

// One allocation: where it is, how many bytes were asked for, and what for.
struct Allocation {
  void* ptr = nullptr;
  int64_t bytes = 0;
  MemoryCategory category = MemoryCategory::other;
};

// The allocator interface. Accounting lives here, once; a backend supplies only
// acquire/release (and reports bytes it holds from the system via add_reserved).
class Allocator {
 public:
  explicit Allocator(Device device) : device_(device) {}
  virtual ~Allocator() = default;
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  Device device() const { return device_; }
  bool host_pool() const { return host_pool_; }  // a rank's host pool (set_owner), not a device's allocator
  // Who owns it, for a memory timeline's events: set by the rank context that made it.
  void set_owner(int rank, bool host_pool) { rank_ = rank, host_pool_ = host_pool; }
  // Its figures into the recording memory timeline, unless already noted there.
  void note_held();

  // Throws OutOfMemory (with a per-category summary) when the cap or the device is exhausted.
  Allocation allocate(int64_t bytes, MemoryCategory category);
  void deallocate(const Allocation& block);

  MemoryStats stats() const;
  void reset_peaks();  // peaks restart from the current figures
  // Simulates a smaller device: taking more than `bytes` in total from the system
  // (reserved bytes, cache included) fails. 0 removes the cap.
  void set_cap(int64_t bytes);

 protected:
  // Called with the lock held; bytes > 0. `category` is for the out-of-memory message.
  // acquire checks the cap (fits_cap) before taking bytes from the system.
  virtual void* acquire(int64_t bytes, MemoryCategory category) = 0;
  virtual void release(void* ptr, int64_t bytes) = 0;
  // The bytes an allocation of `bytes` occupies (after rounding): counted in reserved_by.
  virtual int64_t block_size(int64_t bytes) const { return bytes; }
  // The largest cached block ready for reuse; called with the lock held.
  virtual int64_t largest_free_block() const { return 0; }

  // With the lock held: one call per segment taken from (delta > 0) or given back
  // to (delta < 0) the system.
  void add_reserved(int64_t delta);
  bool fits_cap(int64_t more_reserved) const;  // reserved + more_reserved stays within the cap
  void add_retry();
  // Subclass operations outside acquire/release (emptying a cache) take the same lock.
  std::unique_lock<std::mutex> lock() const { return std::unique_lock(mutex_); }

  [[noreturn]] void throw_out_of_memory(int64_t bytes, MemoryCategory category,
                                        const std::string& reason) const;

 private:
  void note(int kind, MemoryCategory category, int64_t bytes);  // to a recording memory timeline

  Device device_;
  int rank_ = 0;
  bool host_pool_ = false;
  uint64_t timeline_generation_ = 0;  // the recording this allocator last noted into
  mutable std::mutex mutex_;
  MemoryStats stats_;
};

}  // namespace zg
