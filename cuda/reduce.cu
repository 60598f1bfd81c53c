// Row reductions over a contiguous [M, R] matrix: one block per row, each thread
// folding a strided part of the row, then a tree over the block. Few long rows (a
// gradient norm is one row of every parameter) would leave most of the GPU idle, so
// sums over such rows are split: many blocks fold one chunk each, a second pass adds
// the chunks in order (deterministic, no atomics). Floating-point
// sums accumulate in f64 (as on the CPU, which is the reference), integer sums in
// i64. max/min propagate NaN; argmax/argmin return the first extreme index.
#include <cmath>

#include "cuda/backend.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

template <class T>
using sum_t = std::conditional_t<is_float_v<T>, double, int64_t>;

enum class SumKind { sum, mean, squares };

// out[row] = sum_j x[row, j]        (sum; for integers also what mean returns, as on the CPU)
//          = sum_j x[row, j] / R    (mean, floating point)
//          = sum_j x[row, j]^2      (squares; Out is f32 or f64)
template <SumKind Kind, class T, class Out>
__global__ void row_sum_kernel(const T* x, Out* out, int64_t rows, int64_t length) {
  using Acc = sum_t<T>;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* line = x + row * length;
    Acc total = 0;
    for (int64_t j = threadIdx.x; j < length; j += kThreads) {
      const Acc v = static_cast<Acc>(widen(line[j]));
      total += Kind == SumKind::squares ? v * v : v;
    }
    total = block_reduce(total, Add{});
    if (threadIdx.x == 0) {
      if constexpr (Kind == SumKind::mean && is_float_v<T>)
        out[row] = convert<Out>(total / static_cast<double>(length));
      else
        out[row] = convert<Out>(total);
    }
  }
}

// Split sums, pass 1: block (s, r) folds chunk s of row r into partial[r, s]
// (squared first for SumKind::squares), chunks of chunk_length elements.
template <SumKind Kind, class T>
__global__ void row_partial_sum_kernel(const T* x, sum_t<T>* partial, int64_t rows, int64_t length,
                                       int64_t chunk_length) {
  using Acc = sum_t<T>;
  const int64_t split = blockIdx.x, splits = gridDim.x;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* line = x + row * length;
    const int64_t begin = split * chunk_length;
    const int64_t end = begin + chunk_length < length ? begin + chunk_length : length;
    Acc total = 0;
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
      const Acc v = static_cast<Acc>(widen(line[j]));
      total += Kind == SumKind::squares ? v * v : v;
    }
    total = block_reduce(total, Add{});
    if (threadIdx.x == 0) partial[row * splits + split] = total;
  }
}

// out[r] = sum_{j < length} x[r, j] (squared first for squares; divided by mean_of for a
// floating mean), one thread a row, in order. For rows too short to share a block -- a
// broadcast's gradient summed over the batch, 786k rows of 16 for GPT-2's position
// embedding, where a block a row spent its time in the barriers of a tree over 16
// values -- and for pass 2 of the split sums (x = the partial sums, squared already).
template <SumKind Kind, class T, class Out>
__global__ void thread_row_sum_kernel(const T* x, Out* out, int64_t rows, int64_t length, int64_t mean_of) {
  using Acc = sum_t<T>;
  for (int64_t row = grid_index(); row < rows; row += grid_stride()) {
    Acc total = 0;
    for (int64_t j = 0; j < length; ++j) {
      const Acc v = static_cast<Acc>(widen(x[row * length + j]));
      total += Kind == SumKind::squares ? v * v : v;
    }
    if constexpr (Kind == SumKind::mean && std::is_floating_point_v<Acc>)
      out[row] = convert<Out>(total / static_cast<double>(mean_of));
    else
      out[row] = convert<Out>(total);
  }
}

// Launches the sum of each row into out: one thread per row for short rows, one block
// per row, or, when the rows are too few to fill the GPU and long enough to share,
// `splits` blocks per row and a finish.
template <SumKind Kind, class T, class Out>
void row_sum(const Tensor& in, Out* out, cudaStream_t stream) {
  const int64_t rows = in.size(0), length = in.size(1);
  constexpr int64_t kTargetBlocks = 1024, kMinChunk = 16 * kThreads;  // >= 16 elements a thread
  constexpr int64_t kShortRow = kThreads / 4;                          // a block would idle 3/4 of its threads
  const int64_t splits =
      std::max<int64_t>(1, std::min(kTargetBlocks / std::max<int64_t>(rows, 1), length / kMinChunk));
  const T* x = device_ptr<const T>(in);
  if (length <= kShortRow) {
    thread_row_sum_kernel<Kind, T, Out><<<blocks_for(rows), kThreads, 0, stream>>>(x, out, rows, length, length);
    ZG_CUDA_CHECK_LAUNCH();
    return;
  }
  if (splits == 1) {
    row_sum_kernel<Kind, T, Out><<<blocks_for_rows(rows), kThreads, 0, stream>>>(x, out, rows, length);
    ZG_CUDA_CHECK_LAUNCH();
    return;
  }
  using Acc = sum_t<T>;
  const int64_t chunk_length = (length + splits - 1) / splits;
  const Tensor partial =
      Tensor::empty({rows * splits}, TensorOptions(std::is_floating_point_v<Acc> ? DType::f64 : DType::i64).device(in.device()));
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  row_partial_sum_kernel<Kind, T><<<grid, kThreads, 0, stream>>>(x, device_ptr<Acc>(partial), rows, length, chunk_length);
  ZG_CUDA_CHECK_LAUNCH();
  constexpr SumKind finish = Kind == SumKind::squares ? SumKind::sum : Kind;  // the partials are squared already
  thread_row_sum_kernel<finish, Acc, Out><<<blocks_for(rows), kThreads, 0, stream>>>(device_ptr<const Acc>(partial),
                                                                                   out, rows, splits, length);
  ZG_CUDA_CHECK_LAUNCH();
}

// The preferred of two candidates (value, index) of a row: an empty one (index < 0)
// never wins, a NaN always does, then the larger (Max) or smaller value, then the
// smaller index -- which is what a left-to-right scan keeping the first extreme gives.
template <class Acc>
struct Candidate {
  Acc value;
  int64_t index;
};
template <bool Max, class Acc>
struct Prefer {
  __device__ Candidate<Acc> operator()(const Candidate<Acc>& a, const Candidate<Acc>& b) const {
    if (a.index < 0) return b;
    if (b.index < 0) return a;
    const bool a_nan = a.value != a.value, b_nan = b.value != b.value;  // always false for integers
    if (a_nan || b_nan) {
      if (a_nan && b_nan) return a.index < b.index ? a : b;
      return a_nan ? a : b;
    }
    if (a.value != b.value) return (Max ? a.value > b.value : a.value < b.value) ? a : b;
    return a.index < b.index ? a : b;
  }
};

// Arg = false: out[row] = the extreme value itself (max/min); Arg = true: out[row] = its index (i64).
template <bool Max, bool Arg, class T>
__global__ void row_extreme_kernel(const T* x, void* out, int64_t rows, int64_t length) {
  using Acc = acc_t<T>;
  const Prefer<Max, Acc> prefer;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* line = x + row * length;
    Candidate<Acc> best{Acc(0), -1};
    for (int64_t j = threadIdx.x; j < length; j += kThreads) best = prefer(best, Candidate<Acc>{widen(line[j]), j});
    best = block_reduce(best, prefer);
    if (threadIdx.x == 0) {
      if constexpr (Arg) static_cast<int64_t*>(out)[row] = best.index < 0 ? 0 : best.index;
      else if (best.index >= 0) static_cast<T*>(out)[row] = line[best.index];
    }
  }
}

}  // namespace

void CudaBackend::reduce(ReduceOp op, const Tensor& in, const Tensor& out) {
  ZG_CHECK(in.dim() == 2 && in.is_contiguous(), "reduce: expected a contiguous [M, R] input, got ", describe(in));
  ZG_CHECK(out.is_contiguous() && out.numel() == in.size(0), "reduce: expected a contiguous output of ", in.size(0),
           " elements, got ", describe(out));
  const int64_t rows = in.size(0), length = in.size(1);
  OnDevice on(in.device());
  const unsigned blocks = blocks_for_rows(rows);
  dispatch_device(in.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("reduce: bool tensors are summed as i64 by the front-end");
    } else {
      if (rows == 0) return;
      const T* x = device_ptr<const T>(in);
      auto extreme = [&]<bool Max, bool Arg>() {
        if (Arg) ZG_CHECK(out.dtype() == DType::i64, "reduce: argmax/argmin write i64, got ", describe(out));
        else ZG_CHECK(out.dtype() == in.dtype(), "reduce: max/min write the input's dtype, got ", describe(out));
        row_extreme_kernel<Max, Arg, T><<<blocks, kThreads, 0, on.stream>>>(x, out.data_ptr(), rows, length);
      };
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::mean:
          ZG_CHECK(out.dtype() == in.dtype(), "reduce: sum/mean write the input's dtype, got ", describe(out));
          if (op == ReduceOp::sum) row_sum<SumKind::sum, T>(in, device_ptr<T>(out), on.stream);
          else row_sum<SumKind::mean, T>(in, device_ptr<T>(out), on.stream);
          break;
        case ReduceOp::max: extreme.template operator()<true, false>(); break;
        case ReduceOp::min: extreme.template operator()<false, false>(); break;
        case ReduceOp::argmax: extreme.template operator()<true, true>(); break;
        case ReduceOp::argmin: extreme.template operator()<false, true>(); break;
        case ReduceOp::sum_of_squares:
          if (out.dtype() == DType::f64) row_sum<SumKind::squares, T>(in, device_ptr<double>(out), on.stream);
          else if (out.dtype() == DType::f32) row_sum<SumKind::squares, T>(in, device_ptr<float>(out), on.stream);
          else
            fail("reduce: sum_of_squares writes f32 or f64, got ", describe(out));
          break;
      }
      ZG_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace zg::cuda
