// Sorting each row of a matrix: CUB's segmented radix sort of (value, position) pairs,
// a segment a row. Radix sort is stable and orders floats by their bits made monotone:
// +NaN above +inf, but a NaN with its sign bit set below -inf, NaN payloads among
// themselves and -0 below +0. The contract (Backend::sort_rows, the CPU's comparison) ties
// every NaN above +inf and -0 with +0: float keys are sorted as a canonical copy, each NaN
// the one +NaN and each zero +0, so that ties keep their order. Its scratch is `workspace`.
// One row (a 1-D sort, topk or multinomial over a vocabulary) takes the whole-device radix
// sort: the segmented one gives each segment a single thread block.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <climits>

#include "cuda/backend.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

// positions[i] = i mod length: each row's own column numbers, the values sorted along.
__global__ void column_kernel(int64_t* positions, int64_t n, int64_t length) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) positions[i] = i % length;
}

// offsets[r] = r * length for r <= rows: where each segment begins (and the last ends).
__global__ void row_offsets_kernel(int64_t* offsets, int64_t rows, int64_t length) {
  for (int64_t r = grid_index(); r <= rows; r += grid_stride()) offsets[r] = r * length;
}

// keys[i] = in[i], with every NaN the canonical +NaN and -0 as +0.
template <class T>
__global__ void canonical_keys_kernel(const T* in, T* keys, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    const auto v = widen(in[i]);
    keys[i] = isnan(v) ? convert<T>(NAN) : v == decltype(v)(0) ? convert<T>(0.0f) : in[i];
  }
}

}  // namespace

void CudaBackend::sort_rows(const Tensor& in, bool descending, const Tensor& indices) {
  ZG_CHECK(in.dim() == 2 && in.is_contiguous() && indices.dtype() == DType::i64 && indices.is_contiguous() &&
               indices.shape() == in.shape(),
           "sort_rows: expected a contiguous [M, R] input and i64 indices of its shape, got ", describe(in), " and ",
           describe(indices));
  const int64_t rows = in.size(0), length = in.size(1), n = in.numel();
  if (n == 0) return;
  ZG_CHECK(n <= INT_MAX, "sort_rows: ", n, " elements are more than one sort takes");
  OnDevice on(in.device());
  MemoryScope scope(MemoryCategory::workspace);
  dispatch_device(in.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("sort_rows: bool tensors are not sorted; convert to an integer dtype");
    } else {
      const TensorOptions i64 = TensorOptions(DType::i64).device(on.device);
      const Tensor positions = empty({n}, i64), offsets = empty({rows + 1}, i64);
      const Tensor sorted_values = empty({n}, TensorOptions(in.dtype()).device(on.device));
      Tensor canonical = in;
      if constexpr (is_float_v<T>) {
        canonical = empty({n}, TensorOptions(in.dtype()).device(on.device));
        canonical_keys_kernel<<<blocks_for(n), kThreads, 0, on.stream>>>(device_ptr<const T>(in),
                                                                        device_ptr<T>(canonical), n);
        ZG_CUDA_CHECK_LAUNCH();
      }
      column_kernel<<<blocks_for(n), kThreads, 0, on.stream>>>(device_ptr<int64_t>(positions), n, length);
      ZG_CUDA_CHECK_LAUNCH();
      row_offsets_kernel<<<blocks_for(rows + 1), kThreads, 0, on.stream>>>(device_ptr<int64_t>(offsets), rows, length);
      ZG_CUDA_CHECK_LAUNCH();
      const int64_t* begins = device_ptr<const int64_t>(offsets);
      const auto sort = [&](void* temp, size_t& temp_bytes) {
        const T* keys = device_ptr<const T>(canonical);
        T* sorted_keys = device_ptr<T>(sorted_values);
        const int64_t* values = device_ptr<const int64_t>(positions);
        int64_t* sorted = device_ptr<int64_t>(indices);
        const int items = static_cast<int>(n), segments = static_cast<int>(rows), bits = static_cast<int>(sizeof(T) * 8);
        if (segments == 1 && descending)
          ZG_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(temp, temp_bytes, keys, sorted_keys, values, sorted,
                                                                  items, 0, bits, on.stream));
        else if (segments == 1)
          ZG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys, values, sorted, items, 0,
                                                        bits, on.stream));
        else if (descending)
          ZG_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(temp, temp_bytes, keys, sorted_keys, values, sorted,
                                                                            items, segments, begins, begins + 1, 0, bits,
                                                                            on.stream));
        else
          ZG_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys, values, sorted, items,
                                                                 segments, begins, begins + 1, 0, bits, on.stream));
      };
      size_t temp_bytes = 0;
      sort(nullptr, temp_bytes);
      const Tensor temp = empty({static_cast<int64_t>(std::max<size_t>(temp_bytes, 1))},
                                TensorOptions(DType::boolean).device(on.device));
      sort(temp.data_ptr(), temp_bytes);
    }
  });
}

}  // namespace zg::cuda
