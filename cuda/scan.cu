// Prefix sums of each row (cumsum): a block a row, the row scanned in tiles of kThreads
// elements by CUB's BlockScan, each tile's total carried into the next. Floats sum in
// their compute type (f32 for 16-bit), integers in the unsigned type, where they wrap.
#include <cub/block/block_scan.cuh>

#include "cuda/backend.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

// The type a row is summed in: a float's compute type, an integer's unsigned type.
template <class T>
__host__ __device__ constexpr auto scan_zero() {
  if constexpr (is_float_v<T>) return acc_t<T>(0);
  else return std::make_unsigned_t<T>(0);
}
template <class T>
using scan_t = decltype(scan_zero<T>());

template <class T>
__global__ void cumsum_rows_kernel(const T* in, T* out, int64_t rows, int64_t length) {
  using Acc = scan_t<T>;
  using Scan = cub::BlockScan<Acc, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = in + r * length;
    T* prefix = out + r * length;
    Acc carry = Acc(0);
    for (int64_t start = 0; start < length; start += kThreads) {
      const int64_t j = start + threadIdx.x;
      const Acc v = j < length ? static_cast<Acc>(widen(row[j])) : Acc(0);
      Acc scanned, tile_total;
      Scan(temp).InclusiveSum(v, scanned, tile_total);
      if (j < length) {
        if constexpr (is_float_v<T>) prefix[j] = convert<T>(carry + scanned);
        else prefix[j] = static_cast<T>(carry + scanned);  // modulo 2^bits (C++20)
      }
      carry += tile_total;
      __syncthreads();  // temp is reused by the next tile
    }
  }
}

}  // namespace

void CudaBackend::cumsum_rows(const Tensor& in, const Tensor& out) {
  ZG_CHECK(in.dim() == 2 && in.is_contiguous() && out.is_contiguous() && out.shape() == in.shape() &&
               out.dtype() == in.dtype(),
           "cumsum_rows: expected a contiguous [M, R] input and an output of its shape and dtype, got ", describe(in),
           " and ", describe(out));
  if (in.numel() == 0) return;
  OnDevice on(in.device());
  dispatch_device(in.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("cumsum_rows: bool tensors are not summed; convert to an integer dtype");
    } else {
      cumsum_rows_kernel<T><<<blocks_for_rows(in.size(0)), kThreads, 0, on.stream>>>(
          device_ptr<const T>(in), device_ptr<T>(out), in.size(0), in.size(1));
      ZG_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace zg::cuda
