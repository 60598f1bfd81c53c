// CPU allocator and the data-movement kernels: fill, Philox random fill, copy.
#include <sys/mman.h>

#include <cstring>
#include <new>

#include "tensor/block_cache.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"
#include "tensor/philox.h"

namespace zg {
namespace cpu {

namespace {

// Host memory, 64-byte aligned (a cache line; enough for any vector load), and 4 KiB
// from 64 KiB up, so the file tier (tensor/file_tier.h) can read and write large buffers
// with O_DIRECT. The host pool's blocks from 2 MiB up are 2 MiB-aligned and asked to be
// backed by huge pages: a disk's DMA into 4 KiB pages of fresh memory ran at 55% of its rate
// into huge ones (bench/file_tier, a virtual disk). Reserved bytes are the rounded sizes
// actually taken from the system.
class CpuAllocator final : public Allocator {
 public:
  // `host_pool`: the rank's host pool without a GPU, whose freed large blocks are cached (block_cache.h).
  explicit CpuAllocator(bool host_pool = false) : Allocator(kCPU), host_pool_(host_pool) {}
  ~CpuAllocator() override {
    cache_.drain([this](void* ptr, int64_t bytes) { ::operator delete(ptr, alignment(bytes)); });
  }

 private:
  static constexpr int64_t kAlignment = 64, kHugePage = int64_t{2} << 20;
  static int64_t rounded(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
  std::align_val_t alignment(int64_t bytes) const {
    return static_cast<std::align_val_t>(host_pool_ && bytes >= kHugePage ? kHugePage
                                         : bytes >= (64 << 10)           ? 4096
                                                                         : kAlignment);
  }

  int64_t block_size(int64_t bytes) const override { return rounded(bytes); }
  int64_t largest_free_block() const override { return cache_.largest(); }
  void* acquire(int64_t bytes, MemoryCategory category) override {
    if (void* ptr = cache_.take(rounded(bytes))) return ptr;
    if (!fits_cap(rounded(bytes)) && cache_.held() > 0) {  // the cache first, then the cap's refusal
      cache_.drain([this](void* ptr, int64_t size) { free_block(ptr, size); });
      add_retry();
    }
    if (!fits_cap(rounded(bytes))) throw_out_of_memory(bytes, category, "over the memory cap");
    void* ptr = ::operator new(static_cast<size_t>(rounded(bytes)), alignment(rounded(bytes)), std::nothrow);
    if (!ptr) throw_out_of_memory(bytes, category, "the system allocator failed");
#ifdef MADV_HUGEPAGE
    if (host_pool_ && rounded(bytes) >= kHugePage) ::madvise(ptr, static_cast<size_t>(rounded(bytes)), MADV_HUGEPAGE);
#endif
    add_reserved(rounded(bytes));
    return ptr;
  }
  void release(void* ptr, int64_t bytes) override {
    if (!host_pool_ || !cache_.keep(ptr, rounded(bytes))) free_block(ptr, rounded(bytes));
  }
  void free_block(void* ptr, int64_t size) {
    ::operator delete(ptr, alignment(size));
    add_reserved(-size);
  }

  bool host_pool_;
  BlockCache cache_;
};

}  // namespace

std::shared_ptr<Allocator> CpuBackend::make_allocator(Device) { return std::make_shared<CpuAllocator>(); }
std::shared_ptr<Allocator> make_host_pool() { return std::make_shared<CpuAllocator>(/*host_pool=*/true); }

void CpuBackend::fill(const Tensor& out, double value) {
  dispatch(out.dtype(), [&]<class T>() {
    T* y = out.data<T>();
    const T v = convert<T>(value);
    for_each_element<1>(out.shape(), {&out.strides()}, [&](const auto& off) { y[off[0]] = v; });
  });
}

// Element i takes lane (first_lane + i) % 4 of Philox block first_block + (first_lane + i) / 4;
// the value is computed in f64 and rounded once to the output dtype (see tensor/philox.h).
void CpuBackend::fill_random(const Tensor& out, const RandomSpec& spec) {
  dispatch(out.dtype(), [&]<class T>() {
    if constexpr (is_float_v<T>) {
      T* y = out.data<T>();
      const int64_t n = out.numel(), first = spec.first_lane;
      const bool normal = spec.distribution == Distribution::normal;
      for (int64_t block = 0; block * 4 < first + n; ++block) {
        const philox::U32x4 bits = philox::block_bits(spec.seed, spec.first_block + block);
        for (int lane = 0; lane < 4; ++lane) {
          const int64_t i = block * 4 + lane - first;
          if (i < 0 || i >= n) continue;
          const T v = convert<T>(philox::draw(bits, lane, normal, spec.a, spec.b));
          const bool on_upper_bound = !normal && static_cast<double>(static_cast<compute_t<T>>(v)) >= spec.b;
          y[i] = on_upper_bound ? convert<T>(spec.a) : v;  // U[a, b): philox::draw
        }
      }
    }
  });
}

void CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    const auto* from = static_cast<const char*>(src.data_ptr());
    auto* to = static_cast<char*>(dst.data_ptr());
    const int64_t bytes = src.nbytes();
    if (from + bytes <= to || to + bytes <= from) {  // apart: in blocks over the threads
      parallel_for(bytes, int64_t{1} << 20, [&](int64_t begin, int64_t end) {
        std::memcpy(to + begin, from + begin, static_cast<size_t>(end - begin));
      });
    } else if (bytes > 0) {
      std::memmove(to, from, static_cast<size_t>(bytes));
    }
    return;
  }
  dispatch(src.dtype(), [&]<class From>() {
    dispatch(dst.dtype(), [&]<class To>() {
      const From* x = static_cast<const From*>(src.data_ptr());
      To* y = static_cast<To*>(dst.data_ptr());
      for_each_element<2>(dst.shape(), {&dst.strides(), &src.strides()},
                          [&](const auto& off) { y[off[0]] = convert<To>(x[off[1]]); });
    });
  });
}

}  // namespace cpu

Backend& cpu_backend() {
  static cpu::CpuBackend backend;
  return backend;
}

}  // namespace zg
