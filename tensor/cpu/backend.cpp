// CPU allocator and the data-movement kernels: fill, Philox random fill, copy.
#include <cstring>
#include <new>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"
#include "tensor/philox.h"

namespace zg {
namespace cpu {

namespace {

// Host memory, 64-byte aligned (a cache line; enough for any vector load), and 4 KiB
// from 64 KiB up, so the file tier (tensor/file_tier.h) can read and write large buffers
// with O_DIRECT. Reserved bytes are the rounded sizes actually taken from the system.
class CpuAllocator final : public Allocator {
 public:
  CpuAllocator() : Allocator(kCPU) {}

 private:
  static constexpr int64_t kAlignment = 64;
  static int64_t rounded(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
  static std::align_val_t alignment(int64_t bytes) { return static_cast<std::align_val_t>(bytes >= (64 << 10) ? 4096 : kAlignment); }

  int64_t block_size(int64_t bytes) const override { return rounded(bytes); }
  void* acquire(int64_t bytes, MemoryCategory category) override {
    if (!fits_cap(rounded(bytes))) throw_out_of_memory(bytes, category, "over the memory cap");
    void* ptr = ::operator new(static_cast<size_t>(rounded(bytes)), alignment(bytes), std::nothrow);
    if (!ptr) throw_out_of_memory(bytes, category, "the system allocator failed");
    add_reserved(rounded(bytes));
    return ptr;
  }
  void release(void* ptr, int64_t bytes) override {
    ::operator delete(ptr, alignment(bytes));
    add_reserved(-rounded(bytes));
  }
};

}  // namespace

std::shared_ptr<Allocator> CpuBackend::make_allocator(Device) { return std::make_shared<CpuAllocator>(); }

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
