// Row reductions over a contiguous [M, R] matrix. Floating-point sums
// accumulate in f64, so the CPU is the accurate reference the GPU is checked
// against. max/min propagate NaN; argmax/argmin return the first extreme index.
// Rows are shared by the worker threads; a long row's sums (a gradient norm over a
// whole shard) are taken in fixed blocks added in order, so the result does not depend
// on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"
#include "tensor/cpu/vectorized.h"

namespace zg::cpu {

namespace {

template <class T>
bool is_nan(T v) {
  if constexpr (is_float_v<T>) return std::isnan(static_cast<compute_t<T>>(v));
  else return false;
}

// Index of the element that `better(candidate, best)` prefers; a NaN wins at once.
template <class T, class Better>
int64_t extreme_index(const T* row, int64_t length, Better better) {
  int64_t best = 0;
  for (int64_t j = 0; j < length; ++j) {
    if (is_nan(row[j])) return j;
    if (better(compute_t<T>(row[j]), compute_t<T>(row[best]))) best = j;
  }
  return best;
}

// sum_j row[j], or (squares) sum_j row[j]^2, in Acc over a row: one pass, or (a long row)
// fixed blocks summed on the worker threads, then added in block order. f32 rows take the
// vectorised f64 sum.
template <class Acc, class T>
Acc row_sum(const T* row, int64_t length, bool squares) {
  const auto sum = [&](int64_t begin, int64_t end) -> Acc {
    if constexpr (std::is_same_v<T, float>) {
      return vector_kernels().sum_f64(row + begin, end - begin, squares);
    } else {
      Acc total = 0;
      for (int64_t j = begin; j < end; ++j) {
        const auto x = static_cast<Acc>(compute_t<T>(row[j]));
        total = wrapping_add(total, squares ? x * x : x);
      }
      return total;
    }
  };
  constexpr int64_t kBlock = int64_t{1} << 16;
  if (length <= kBlock) return sum(0, length);
  std::vector<Acc> partial(static_cast<size_t>((length + kBlock - 1) / kBlock));
  parallel_for(static_cast<int64_t>(partial.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) partial[b] = sum(b * kBlock, std::min(length, (b + 1) * kBlock));
  });
  Acc total = 0;
  for (const Acc p : partial) total = wrapping_add(total, p);
  return total;
}

}  // namespace

void CpuBackend::reduce(ReduceOp op, const Tensor& in, const Tensor& out) {
  const int64_t rows = in.size(0), length = in.size(1);
  dispatch(in.dtype(), [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using Acc = std::conditional_t<is_float_v<T>, double, int64_t>;
      const T* x = in.data<T>();
      for_each_row(rows, length, [&](int64_t i) {
        const T* row = x + i * length;
        auto greater = [](auto a, auto b) { return a > b; };
        auto less = [](auto a, auto b) { return a < b; };
        switch (op) {
          case ReduceOp::sum:
          case ReduceOp::mean: {
            const Acc total = row_sum<Acc>(row, length, false);
            const double value = op == ReduceOp::mean ? static_cast<double>(total) / static_cast<double>(length)
                                                      : static_cast<double>(total);
            if constexpr (is_float_v<T>) out.data<T>()[i] = convert<T>(value);
            else out.data<T>()[i] = static_cast<T>(total);
            break;
          }
          case ReduceOp::max: out.data<T>()[i] = row[extreme_index(row, length, greater)]; break;
          case ReduceOp::min: out.data<T>()[i] = row[extreme_index(row, length, less)]; break;
          case ReduceOp::argmax: out.data<int64_t>()[i] = extreme_index(row, length, greater); break;
          case ReduceOp::argmin: out.data<int64_t>()[i] = extreme_index(row, length, less); break;
          case ReduceOp::sum_of_squares: {
            const double total = row_sum<double>(row, length, true);
            dispatch(out.dtype(), [&]<class S>() { out.data<S>()[i] = convert<S>(total); });
            break;
          }
        }
      });
    } else {
      fail("reduce: bool tensors are summed as i64 by the front-end");
    }
  });
}

// linear()'s parameter gradients: grad_weight = grad^T x by the GEMM; grad_bias[c] = sum over
// rows of grad[:, c], read in place by blocks of channels (each summed over the rows in
// order, in f64, as reduce() sums a row) -- the default first copies grad^T out whole.
// Blocks of 256 channels or more: each row's part is a run the prefetcher follows.
void CpuBackend::linear_weight_grad(const Tensor& grad, const Tensor& x, const Tensor& grad_weight,
                                    const Tensor& grad_bias) {
  if (!grad_bias.defined() || !grad.is_contiguous()) return Backend::linear_weight_grad(grad, x, grad_weight, grad_bias);
  Backend::linear_weight_grad(grad, x, grad_weight, Tensor());  // the GEMM alone
  const int64_t rows = grad.size(0), channels = grad.size(1);
  with_float(grad.dtype(), "linear_weight_grad", [&]<class T>() {
    parallel_for(channels, std::max<int64_t>(64, row_grain(rows)), [&](int64_t c0, int64_t c1) {  // 256-byte runs
      std::vector<double> total(static_cast<size_t>(c1 - c0));
      for (int64_t i = 0; i < rows; ++i) {
        const T* g = grad.data<T>() + i * channels + c0;
        if constexpr (std::is_same_v<T, float>) vector_kernels().add_row_f64(g, c1 - c0, total.data());
        else
          for (int64_t c = 0; c < c1 - c0; ++c) total[c] += static_cast<double>(compute_t<T>(g[c]));
      }
      for (int64_t c = c0; c < c1; ++c) grad_bias.data<T>()[c] = convert<T>(total[c - c0]);
    });
  });
}

// A stable sort of each row's positions by value; NaN counts as above +inf (PyTorch's order).
void CpuBackend::sort_rows(const Tensor& in, bool descending, const Tensor& indices) {
  ZG_CHECK(in.dim() == 2 && in.is_contiguous() && indices.dtype() == DType::i64 && indices.is_contiguous() &&
               indices.shape() == in.shape(),
           "sort_rows: expected a contiguous [M, R] input and i64 indices of its shape, got ", describe(in), " and ",
           describe(indices));
  const int64_t length = in.size(1);
  dispatch(in.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("sort_rows: bool tensors are not sorted; convert to an integer dtype");
    } else {
      for_each_row(in.size(0), length, [&](int64_t i) {
        const T* row = in.data<T>() + i * length;
        int64_t* order = indices.data<int64_t>() + i * length;
        for (int64_t j = 0; j < length; ++j) order[j] = j;
        const auto below = [&](int64_t a, int64_t b) {  // row[a] < row[b], NaN the largest
          const auto x = static_cast<compute_t<T>>(row[a]), y = static_cast<compute_t<T>>(row[b]);
          if (is_nan(row[a])) return false;
          return is_nan(row[b]) || x < y;
        };
        if (descending) std::stable_sort(order, order + length, [&](int64_t a, int64_t b) { return below(b, a); });
        else std::stable_sort(order, order + length, below);
      });
    }
  });
}

// Each row's prefix sums in order, floats in f64 (rounded once an element), integers wrapping.
void CpuBackend::cumsum_rows(const Tensor& in, const Tensor& out) {
  ZG_CHECK(in.dim() == 2 && in.is_contiguous() && out.is_contiguous() && out.shape() == in.shape() &&
               out.dtype() == in.dtype(),
           "cumsum_rows: expected a contiguous [M, R] input and an output of its shape and dtype, got ", describe(in),
           " and ", describe(out));
  const int64_t length = in.size(1);
  dispatch(in.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("cumsum_rows: bool tensors are not summed; convert to an integer dtype");
    } else {
      using Acc = std::conditional_t<is_float_v<T>, double, T>;
      for_each_row(in.size(0), length, [&](int64_t i) {
        const T* row = in.data<T>() + i * length;
        T* prefix = out.data<T>() + i * length;
        Acc total = 0;
        for (int64_t j = 0; j < length; ++j) {
          total = wrapping_add(total, static_cast<Acc>(compute_t<T>(row[j])));
          prefix[j] = convert<T>(total);
        }
      });
    }
  });
}

}  // namespace zg::cpu
