// A rank context holds everything that is per rank: its allocators (and so its
// memory figures) and its random generator. Ranks may be threads of one process,
// so nothing here is global: each thread has a current context, by default one
// of its own, and a ContextGuard makes another one current for a scope.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tensor/device.h"
#include "tensor/error.h"
#include "tensor/memory.h"

namespace zg {

// Philox state: a seed (the key) and an offset (the next unused counter block).
// Every random op reserves ceil(n / 4) blocks, so a sequence of random ops gives
// the same numbers on every device and however the work is split. A context may be
// current on several threads: reserving is atomic, so no two ops get the same blocks
// (which op gets which blocks then depends on timing, and a manual_seed while another
// thread draws may pair the old seed with the new offset: seed from one thread).
class Generator {
 public:
  static constexpr uint64_t kDefaultSeed = 0x5eed;
  explicit Generator(uint64_t seed = kDefaultSeed, uint64_t offset = 0) : seed_(seed), offset_(offset) {}

  void manual_seed(uint64_t seed) { seed_ = seed; offset_ = 0; }
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_offset(uint64_t offset) { offset_ = offset; }
  // Reserves the counter blocks for `n` values; returns the first block.
  // Refused where the offset would wrap around (and the stream repeat).
  uint64_t reserve(int64_t n) {
    const uint64_t blocks = (static_cast<uint64_t>(n) + 3) / 4;
    uint64_t first = offset_.load();
    do {
      ZG_CHECK(blocks <= UINT64_MAX - first, "random: the generator at offset ", first, " cannot reserve ", blocks,
               " more counter blocks without wrapping around to numbers it gave before; reseed it (manual_seed)");
    } while (!offset_.compare_exchange_weak(first, first + blocks));
    return first;
  }

  // The generator this thread's random ops draw from: the current context's, unless a
  // GeneratorGuard put another in its place.
  static Generator& current();

 private:
  std::atomic<uint64_t> seed_, offset_;
};

// Makes `generator` the one this thread's random ops draw from, for a scope. An
// activation-checkpointing recompute replays its forward's numbers from its own copy
// of the state this way: the context's generator is never rewound, and an exception in
// the replay leaves nothing to restore. The replay is exact when the checkpointed
// forward drew its blocks in one run -- no other thread drawing from the same context
// meanwhile (PyTorch's checkpoint assumes the same) -- and when the function draws on
// the thread that calls it (the guard is per thread).
class GeneratorGuard {
 public:
  explicit GeneratorGuard(Generator& generator);
  ~GeneratorGuard();
  GeneratorGuard(const GeneratorGuard&) = delete;
  GeneratorGuard& operator=(const GeneratorGuard&) = delete;

 private:
  Generator* previous_;
};

class Context {
 public:
  explicit Context(int rank = 0);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const { return rank_; }
  // The allocator for `device`, created by the device's backend on first use.
  std::shared_ptr<Allocator> allocator(Device device);
  // Installs `allocator` (made for `device`) as this rank's for `device`, before the first
  // use: a dry run on meta through a caching allocator over a simulated device
  // (cuda/simulated_device.h) shows what a GPU's cache would reserve.
  void set_allocator(Device device, std::shared_ptr<Allocator> allocator);
  MemoryStats memory_stats(Device device = kCPU) { return allocator(device)->stats(); }
  // The host pool: where offloaded state lives (TensorOptions::pinned). Page-locked
  // (cudaHostAlloc) when this build has CUDA and a GPU is visible, so copies to and from
  // the GPU run asynchronously at full bus speed; else ordinary memory. Either way freed
  // blocks of 1 MiB and more are kept for reuse (tensor/block_cache.h), and an
  // allocator of its own, so its bytes are counted apart from the device's -- also on a
  // CPU run, where both are host memory. `device` is cpu, or meta for a dry run's pool.
  std::shared_ptr<Allocator> host_allocator(Device device = kCPU);
  MemoryStats host_memory_stats(Device device = kCPU) { return host_allocator(device)->stats(); }
  Generator& generator() { return generator_; }
  // Per-rank state a backend keeps for `device` (the CUDA backend: this rank's
  // streams and library handles), made by `make` on first use and released before
  // the rank's allocators (which may hold it longer: a CUDA allocator keeps the
  // streams its blocks are ordered on). Ranks sharing one GPU never share a stream.
  std::shared_ptr<void> backend_state(Device device, const std::function<std::shared_ptr<void>()>& make);

  // Every allocator this rank has made: its devices' and its host pools.
  std::vector<std::shared_ptr<Allocator>> allocators();
  // Every allocator of every live context made for a rank (not threads' own contexts).
  static std::vector<std::shared_ptr<Allocator>> rank_allocators();

  // This thread's current context (a per-thread default when no guard is active).
  static Context& current();

 private:
  struct ThreadDefault {};
  Context(ThreadDefault) : rank_(0), thread_default_(true) {}

  int rank_;
  bool thread_default_ = false;  // a thread's own context, not one made for a rank
  std::mutex mutex_;
  std::map<Device, std::shared_ptr<Allocator>> allocators_, host_allocators_;
  std::map<Device, std::shared_ptr<void>> backend_states_;  // declared after allocators_: destroyed first
  Generator generator_;
};

// Makes `context` current on this thread until the guard is destroyed.
class ContextGuard {
 public:
  explicit ContextGuard(Context& context);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  Context* previous_;
};

// Shorthands on the current context.
inline MemoryStats memory_stats(Device device = kCPU) { return Context::current().memory_stats(device); }
inline MemoryStats host_memory_stats(Device device = kCPU) { return Context::current().host_memory_stats(device); }
inline void manual_seed(uint64_t seed) { Context::current().generator().manual_seed(seed); }

}  // namespace zg
