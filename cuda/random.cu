// Philox random fill, bit-identical to the CPU backend's: element i takes lane
// (first_lane + i) % 4 of counter block first_block + (first_lane + i) / 4 (first_lane
// is 0 but for a slice that starts mid-block), and both backends turn the bits
// into a value with the same function (philox::draw in tensor/philox.h), then
// round it once to the output dtype.
#include "cuda/backend.h"
#include "cuda/kernels.cuh"
#include "tensor/philox.h"

namespace zg::cuda {

namespace {

// One thread per block of four lanes: out[4k + lane - first_lane] = draw(philox(seed, first_block + k), lane).
template <class T>
__global__ void philox_fill_kernel(T* out, int64_t n, uint64_t seed, uint64_t first_block, int64_t first_lane,
                                   bool normal, double a, double b) {
  const int64_t blocks = (first_lane + n + 3) / 4;
  for (int64_t k = grid_index(); k < blocks; k += grid_stride()) {
    const philox::U32x4 bits = philox::block_bits(seed, first_block + static_cast<uint64_t>(k));
    for (int lane = 0; lane < 4; ++lane) {
      const int64_t i = k * 4 + lane - first_lane;
      if (i < 0 || i >= n) continue;
      const T v = convert<T>(philox::draw(bits, lane, normal, a, b));
      const bool on_upper_bound = !normal && static_cast<double>(widen(v)) >= b;
      out[i] = on_upper_bound ? convert<T>(a) : v;  // U[a, b): philox::draw
    }
  }
}

}  // namespace

void CudaBackend::fill_random(const Tensor& out, const RandomSpec& spec) {
  ZG_CHECK(out.is_contiguous(), "fill_random: expected a contiguous output, got a strided ", describe(out));
  const int64_t n = out.numel();
  if (n == 0) return;
  OnDevice on(out.device());
  dispatch_device(out.dtype(), [&]<class T>() {
    if constexpr (is_float_v<T>) {
      philox_fill_kernel<T><<<blocks_for((spec.first_lane + n + 3) / 4), kThreads, 0, on.stream>>>(
          device_ptr<T>(out), n, spec.seed, spec.first_block, spec.first_lane, spec.distribution == Distribution::normal,
          spec.a, spec.b);
      ZG_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace zg::cuda
