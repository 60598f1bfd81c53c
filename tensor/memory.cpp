#include "tensor/memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "tensor/error.h"

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
  char line[128];
  os << title << "\n";
  std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", "category", "allocated", "peak");
  os << line;
  for (int c = 0; c < kMemoryCategories; ++c) {
    std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", name(static_cast<MemoryCategory>(c)),
                  format_bytes(stats.allocated[c]).c_str(), format_bytes(stats.peak[c]).c_str());
    os << line;
  }
  std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", "total", format_bytes(stats.allocated_total).c_str(),
                format_bytes(stats.peak_total).c_str());
  os << line;
  std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", "reserved", format_bytes(stats.reserved).c_str(),
                format_bytes(stats.peak_reserved).c_str());
  os << line;
  return os.str();
}

namespace {
thread_local MemoryCategory current_category = MemoryCategory::other;
}

MemoryScope::MemoryScope(MemoryCategory category) : previous_(current_category) {
  current_category = category;
}
MemoryScope::~MemoryScope() { current_category = previous_; }
MemoryCategory MemoryScope::current() { return current_category; }

Block Allocator::allocate(int64_t bytes, MemoryCategory category) {
  ZG_CHECK(bytes >= 0, "allocate: negative size ", bytes, " bytes on ", device_.str());
  Block block{nullptr, bytes, category};
  if (bytes == 0) return block;
  std::lock_guard lock(mutex_);
  if (stats_.cap > 0 && stats_.allocated_total + bytes > stats_.cap)
    throw_out_of_memory(bytes, category, "over the memory cap");
  block.ptr = acquire(bytes, category);
  const int c = static_cast<int>(category);
  stats_.allocated[c] += bytes;
  stats_.peak[c] = std::max(stats_.peak[c], stats_.allocated[c]);
  stats_.allocated_total += bytes;
  stats_.peak_total = std::max(stats_.peak_total, stats_.allocated_total);
  stats_.allocations += 1;
  return block;
}

void Allocator::deallocate(const Block& block) {
  if (block.bytes == 0) return;
  std::lock_guard lock(mutex_);
  release(block.ptr, block.bytes);
  stats_.allocated[static_cast<int>(block.category)] -= block.bytes;
  stats_.allocated_total -= block.bytes;
}

MemoryStats Allocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void Allocator::reset_peaks() {
  std::lock_guard lock(mutex_);
  stats_.peak = stats_.allocated;
  stats_.peak_total = stats_.allocated_total;
  stats_.peak_reserved = stats_.reserved;
}

void Allocator::set_cap(int64_t bytes) {
  ZG_CHECK(bytes >= 0, "set_cap: negative cap ", bytes, " bytes on ", device_.str());
  std::lock_guard lock(mutex_);
  stats_.cap = bytes;
}

void Allocator::add_reserved(int64_t delta) {
  stats_.reserved += delta;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
}

void Allocator::throw_out_of_memory(int64_t bytes, MemoryCategory category, const std::string& reason) const {
  std::ostringstream os;
  os << "out of memory on " << device_.str() << " (" << reason << "): tried to allocate "
     << format_bytes(bytes) << " for " << name(category) << "; allocated " << format_bytes(stats_.allocated_total);
  if (stats_.cap > 0) os << " of a cap of " << format_bytes(stats_.cap);
  os << ", reserved " << format_bytes(stats_.reserved) << "; by category:";
  for (int c = 0; c < kMemoryCategories; ++c)
    if (stats_.allocated[c] > 0) os << " " << name(static_cast<MemoryCategory>(c)) << " " << format_bytes(stats_.allocated[c]);
  throw OutOfMemory(os.str());
}

}  // namespace zg
