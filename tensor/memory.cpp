#include "tensor/memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "tensor/error.h"
#include "tensor/memory_timeline.h"

namespace zg {

const char* name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::parameter: return "parameter";
    case MemoryCategory::gradient: return "gradient";
    case MemoryCategory::optimizer_state: return "optimizer_state";
    case MemoryCategory::activation: return "activation";
    case MemoryCategory::communication: return "communication";
    case MemoryCategory::workspace: return "workspace";
    case MemoryCategory::other: return "other";
  }
  return "?";
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::abs(value) >= 1024.0 && unit < 4) { value /= 1024.0; ++unit; }
  char buf[32];
  if (unit == 0) std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.2f %s", value, units[unit]);
  return buf;
}

std::string memory_report(const MemoryStats& stats, const std::string& title) {
  std::ostringstream os;
  char line[192];
  auto row = [&](const char* label, const std::string& allocated, const std::string& peak,
                 const std::string& in_blocks, const std::string& peak_in_blocks) {
    std::snprintf(line, sizeof line, "  %-16s %14s %14s %14s %14s\n", label, allocated.c_str(), peak.c_str(),
                  in_blocks.c_str(), peak_in_blocks.c_str());
    os << line;
  };
  os << title << "\n";
  row("category", "allocated", "peak", "in blocks", "peak in blocks");
  int64_t in_blocks = 0;
  for (int c = 0; c < kMemoryCategories; ++c) {
    row(name(static_cast<MemoryCategory>(c)), format_bytes(stats.allocated[c]), format_bytes(stats.peak[c]),
        format_bytes(stats.reserved_by[c]), format_bytes(stats.peak_reserved_by[c]));
    in_blocks += stats.reserved_by[c];
  }
  row("total", format_bytes(stats.allocated_total), format_bytes(stats.peak_total), format_bytes(in_blocks), "");
  row("reserved", format_bytes(stats.reserved), format_bytes(stats.peak_reserved), "", "");
  std::snprintf(line, sizeof line,
                "  segments %lld taken, %lld returned; %lld retries; largest free block %s; fragmentation %.1f%%\n",
                static_cast<long long>(stats.segment_allocations), static_cast<long long>(stats.segment_frees),
                static_cast<long long>(stats.retries), format_bytes(stats.largest_free_block).c_str(),
                100.0 * stats.fragmentation());
  os << line;
  return os.str();
}

namespace {
thread_local MemoryCategory current_category = MemoryCategory::other;
}

namespace {
// Categories index the statistics' arrays: a value cast from outside the enum would
// write past them.
void check_category(MemoryCategory category, const char* where) {
  ZG_CHECK(static_cast<int>(category) < kMemoryCategories, where, ": ", static_cast<int>(category),
           " is not a memory category (0 to ", kMemoryCategories - 1, ")");
}
}  // namespace

MemoryScope::MemoryScope(MemoryCategory category) : previous_(current_category) {
  check_category(category, "MemoryScope");
  current_category = category;
}
MemoryScope::~MemoryScope() { current_category = previous_; }
MemoryCategory MemoryScope::current() { return current_category; }

void Allocator::note_held() {
  std::lock_guard lock(mutex_);
  TimelineHooks::held({device_, rank_, host_pool_, &timeline_generation_, &stats_});
}

Allocation Allocator::allocate(int64_t bytes, MemoryCategory category) {
  ZG_CHECK(bytes >= 0, "allocate: negative size ", bytes, " bytes on ", device_.str());
  check_category(category, "allocate");
  Allocation block{nullptr, bytes, category};
  if (bytes == 0) return block;
  std::lock_guard lock(mutex_);
  // The byte counters stay far from int64's end (a meta dry run can ask for anything):
  // no device holds 2^61 bytes, so a request that would take them past it is out of memory.
  constexpr int64_t kMostBytes = int64_t{1} << 61;
  if (bytes > kMostBytes - stats_.reserved || bytes > kMostBytes - stats_.allocated_total)
    throw_out_of_memory(bytes, category, "more than 2^61 bytes in all, more than any device holds");
  block.ptr = acquire(bytes, category);
  note(static_cast<int>(TimelineEvent::Kind::allocate), category, bytes);
  const int c = static_cast<int>(category);
  stats_.allocated[c] += bytes;
  stats_.peak[c] = std::max(stats_.peak[c], stats_.allocated[c]);
  stats_.reserved_by[c] += block_size(bytes);
  stats_.peak_reserved_by[c] = std::max(stats_.peak_reserved_by[c], stats_.reserved_by[c]);
  stats_.allocated_total += bytes;
  stats_.peak_total = std::max(stats_.peak_total, stats_.allocated_total);
  stats_.allocations += 1;
  return block;
}

void Allocator::deallocate(const Allocation& block) {
  if (block.bytes == 0) return;
  std::lock_guard lock(mutex_);
  release(block.ptr, block.bytes);
  note(static_cast<int>(TimelineEvent::Kind::free), block.category, block.bytes);
  stats_.allocated[static_cast<int>(block.category)] -= block.bytes;
  stats_.reserved_by[static_cast<int>(block.category)] -= block_size(block.bytes);
  stats_.allocated_total -= block.bytes;
}

MemoryStats Allocator::stats() const {
  std::lock_guard lock(mutex_);
  MemoryStats stats = stats_;
  stats.largest_free_block = largest_free_block();
  return stats;
}

void Allocator::reset_peaks() {
  std::lock_guard lock(mutex_);
  stats_.peak = stats_.allocated;
  stats_.peak_total = stats_.allocated_total;
  stats_.peak_reserved = stats_.reserved;
  stats_.peak_reserved_by = stats_.reserved_by;
}

void Allocator::set_cap(int64_t bytes) {
  ZG_CHECK(bytes >= 0, "set_cap: negative cap ", bytes, " bytes on ", device_.str());
  std::lock_guard lock(mutex_);
  stats_.cap = bytes;
}

void Allocator::note(int kind, MemoryCategory category, int64_t bytes) {
  TimelineHooks::memory({device_, rank_, host_pool_, &timeline_generation_, &stats_},
                        static_cast<TimelineEvent::Kind>(kind), category, bytes);
}

void Allocator::add_reserved(int64_t delta) {
  note(static_cast<int>(TimelineEvent::Kind::reserve), MemoryCategory::other, delta);
  stats_.reserved += delta;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  (delta > 0 ? stats_.segment_allocations : stats_.segment_frees) += 1;
}

bool Allocator::fits_cap(int64_t more_reserved) const {
  return stats_.cap == 0 || stats_.reserved + more_reserved <= stats_.cap;
}

void Allocator::add_retry() { stats_.retries += 1; }

void Allocator::throw_out_of_memory(int64_t bytes, MemoryCategory category, const std::string& reason) const {
  std::ostringstream os;
  os << "out of memory on " << device_.str() << " (" << reason << "): tried to allocate "
     << format_bytes(bytes) << " for " << name(category) << "; reserved " << format_bytes(stats_.reserved);
  if (stats_.cap > 0) os << " of a cap of " << format_bytes(stats_.cap);
  os << ", allocated " << format_bytes(stats_.allocated_total) << ", largest free block "
     << format_bytes(largest_free_block()) << "; by category, allocated (reserved):";
  for (int c = 0; c < kMemoryCategories; ++c)
    if (stats_.reserved_by[c] > 0)
      os << " " << name(static_cast<MemoryCategory>(c)) << " " << format_bytes(stats_.allocated[c]) << " ("
         << format_bytes(stats_.reserved_by[c]) << ")";
  throw OutOfMemory(os.str());
}

}  // namespace zg
