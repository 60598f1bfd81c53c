// allocator: alloc/free pairs per second on cuda:0 for three allocators:
//   zerograd         the caching allocator that the current rank context owns for cuda:0, the
//                    object every GPU tensor's bytes come from: Tensor::empty calls its
//                    allocate(bytes, category), and deallocate runs when the storage dies.
//                    Timed through those two calls, so the rows compare allocators; what
//                    empty adds (a TensorImpl and a Storage on the host heap) is the same on
//                    every device and left out.
//   cudaMalloc       cudaMalloc / cudaFree (cudaFree synchronises the device).
//   cudaMallocAsync  cudaMallocAsync / cudaFreeAsync on the rank's compute stream, from the
//                    device's default memory pool with its release threshold raised to the
//                    maximum, so freed memory stays in the pool (as PyTorch's cudaMallocAsync
//                    backend sets it).
//
// Patterns, each a sequence of steps "free the block in slot s, allocate B bytes into it":
//   fixed B   one slot: allocate B bytes and free them, --pairs times (B from --sizes);
//   mixed     32 slots picked at random, sizes drawn log-uniformly from 4 KiB to 64 MiB (fixed
//             seed): up to 32 blocks live at once, like a training step's activations.
// Each allocator replays a sequence twice and the second replay is timed (warm caches, as
// in a training loop's later steps), starting and ending with the device idle:
//   pairs/s = pairs / seconds of the timed replay
//
// Without a GPU it says so on stderr (and prints [] with --json) and exits 0, so a smoke run
// on a machine without one passes.
//
//   build/bench/allocator --pairs 10000 --sizes 4K,1M,64M --json
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/args.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/stream.h"
#include "zerograd.h"

using namespace zg;

namespace {

constexpr int kMixedSlots = 32;

struct Step {
  int slot;
  int64_t bytes;
};

struct Pattern {
  std::string name;
  int slots;
  std::vector<Step> steps;  // one alloc/free pair each
};

Pattern fixed(int64_t bytes, int64_t pairs) {
  return {"fixed " + format_bytes(bytes), 1, std::vector<Step>(pairs, Step{0, bytes})};
}

Pattern mixed(int64_t pairs) {
  std::mt19937_64 rng(1);
  std::uniform_int_distribution<int> slot(0, kMixedSlots - 1);
  std::uniform_real_distribution<double> log2_bytes(12, 26);  // 4 KiB .. 64 MiB
  Pattern p{"mixed, " + std::to_string(kMixedSlots) + " live", kMixedSlots, {}};
  for (int64_t i = 0; i < pairs; ++i) p.steps.push_back({slot(rng), static_cast<int64_t>(std::exp2(log2_bytes(rng)))});
  return p;
}

struct Method {
  std::function<void*(int64_t)> allocate;
  std::function<void(void*, int64_t)> free;
};

// Seconds to replay `p` with `method`; every block it allocates is freed again.
double replay_seconds(const Method& method, const Pattern& p) {
  struct Live {
    void* ptr = nullptr;
    int64_t bytes = 0;
  };
  std::vector<Live> slots(p.slots);
  ZG_CUDA_CHECK(cudaDeviceSynchronize());
  const auto start = std::chrono::steady_clock::now();
  for (const Step& s : p.steps) {
    Live& live = slots[s.slot];
    if (live.ptr != nullptr) method.free(live.ptr, live.bytes);
    live = {method.allocate(s.bytes), s.bytes};
  }
  for (const Live& live : slots)
    if (live.ptr != nullptr) method.free(live.ptr, live.bytes);
  ZG_CUDA_CHECK(cudaDeviceSynchronize());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void usage() {
  std::printf(
      "usage: allocator [--pairs 10000] [--sizes 4K,1M,64M] [--json]\n"
      "Alloc/free pairs per second on cuda:0: zerograd's caching allocator, cudaMalloc/cudaFree and\n"
      "cudaMallocAsync/cudaFreeAsync (default pool, caching), for a fixed size (each of --sizes, with\n"
      "K, M, G = KiB, MiB, GiB) and a mixed pattern with up to 32 blocks live. Needs a GPU: without\n"
      "one it says so and exits 0.\n");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t pairs = 10000;
    std::vector<int64_t> sizes = {4 << 10, 1 << 20, 64 << 20};
    bool json = false;
    bench::Args args("allocator", argc, argv);
    while (!args.done()) {
      const std::string flag = args.next();
      if (flag == "--pairs") pairs = args.count(flag);
      else if (flag == "--sizes") sizes = args.byte_sizes(flag);
      else if (flag == "--json") json = true;
      else if (flag == "--help") {
        usage();
        return 0;
      } else {
        fail("allocator: unknown flag '", flag, "' (--help lists them)");
      }
    }
    if (cuda::device_count() == 0) {
      std::fprintf(stderr, "allocator: needs a GPU and none is visible; nothing measured\n");
      if (json) std::printf("[]\n");
      return 0;
    }

    const Device device = kCUDA;
    cuda::DeviceGuard guard(device.index);
    const std::shared_ptr<Allocator> caching = Context::current().allocator(device);
    const cudaStream_t stream = cuda::current_stream(device);
    cudaMemPool_t pool = nullptr;
    ZG_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device.index));
    uint64_t keep_everything = UINT64_MAX;
    ZG_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything));

    const MemoryCategory category = MemoryCategory::activation;
    const Method zerograd{[&](int64_t bytes) { return caching->allocate(bytes, category).ptr; },
                          [&](void* ptr, int64_t bytes) { caching->deallocate({ptr, bytes, category}); }};
    const Method raw{[](int64_t bytes) {
                       void* ptr = nullptr;
                       ZG_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(bytes)));
                       return ptr;
                     },
                     [](void* ptr, int64_t) { ZG_CUDA_CHECK(cudaFree(ptr)); }};
    const Method pooled{[&](int64_t bytes) {
                          void* ptr = nullptr;
                          ZG_CUDA_CHECK(cudaMallocAsync(&ptr, static_cast<size_t>(bytes), stream));
                          return ptr;
                        },
                        [&](void* ptr, int64_t) { ZG_CUDA_CHECK(cudaFreeAsync(ptr, stream)); }};

    std::vector<Pattern> patterns;
    for (int64_t bytes : sizes) patterns.push_back(fixed(bytes, pairs));
    patterns.push_back(mixed(pairs));

    if (json) std::printf("[\n");
    else
      std::printf("alloc/free pairs per second on %s, %s; %lld pairs per pattern, the second of two replays timed\n"
                  "zerograd: the rank context's caching allocator (allocate / deallocate, what Tensor::empty calls)\n\n"
                  "%-18s %12s %12s %16s %10s %10s %12s\n",
                  device.str().c_str(), cuda::device_description(device.index).c_str(), (long long)pairs, "pattern",
                  "zerograd", "cudaMalloc", "cudaMallocAsync", "zg/malloc", "zg/async", "zg segments");
    for (size_t i = 0; i < patterns.size(); ++i) {
      const Pattern& p = patterns[i];
      for (const Method* m : {&zerograd, &raw, &pooled}) replay_seconds(*m, p);  // warms the caches
      const double n = static_cast<double>(p.steps.size());
      const int64_t segments_before = caching->stats().segment_allocations;
      const double zg_rate = n / replay_seconds(zerograd, p);
      const int64_t segments = caching->stats().segment_allocations - segments_before;  // its cudaMalloc calls
      const double malloc_rate = n / replay_seconds(raw, p), async_rate = n / replay_seconds(pooled, p);
      if (json)
        std::printf("  {\"pattern\": \"%s\", \"pairs\": %lld, \"zerograd\": %.1f, \"cudaMalloc\": %.1f, "
                    "\"cudaMallocAsync\": %.1f, \"zerograd_segment_allocations\": %lld}%s\n",
                    p.name.c_str(), (long long)p.steps.size(), zg_rate, malloc_rate, async_rate, (long long)segments,
                    i + 1 < patterns.size() ? "," : "");
      else
        std::printf("%-18s %12.0f %12.0f %16.0f %9.1fx %9.1fx %12lld\n", p.name.c_str(), zg_rate, malloc_rate,
                    async_rate, zg_rate / malloc_rate, zg_rate / async_rate, (long long)segments);
      std::fflush(stdout);
    }
    if (json) std::printf("]\n");
    else std::printf("\nzg segments: cudaMalloc calls the caching allocator made in the timed replay\n");
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
