// Batched GEMM through Eigen. Each matrix is mapped in place: row-major or column-major
// views (a transposed operand) go to Eigen's kernel as they are; only a view with no
// unit stride is copied first. f16/bf16 matrices are widened to f32, multiplied with f32
// accumulation, and rounded back, as tensor cores do. Eigen runs one thread (no OpenMP),
// so the rows of a large product are shared by the backend's worker threads.
#include <Eigen/Core>
#include <vector>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"

namespace zg::cpu {

namespace {

template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using ColMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
using DynamicStride = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;

// Calls fn with rows [row, row + rows) of matrix `batch` of a [B, R, C] tensor, as an Eigen
// view of its own layout: row-major, column-major, or (no unit stride) a general one.
template <class T, class Fn>
void with_matrix(const Tensor& t, int64_t batch, int64_t row, int64_t rows, Fn&& fn) {
  const auto& s = t.strides();
  const T* base = static_cast<const T*>(t.data_ptr()) + batch * s[0] + row * s[1];
  const int64_t cols = t.size(2);
  if (s[2] == 1 || cols == 1)
    fn(Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>(base, rows, cols, Eigen::OuterStride<>(s[1])));
  else if (s[1] == 1 || rows == 1)
    fn(Eigen::Map<const ColMatrix<T>, 0, Eigen::OuterStride<>>(base, rows, cols, Eigen::OuterStride<>(s[2])));
  else
    fn(Eigen::Map<const Matrix<T>, 0, DynamicStride>(base, rows, cols, DynamicStride(s[1], s[2])));
}

// Matrix `batch` of a [B, R, C] f16/bf16 tensor, widened to f32.
template <class T>
Matrix<float> widened(const Tensor& t, int64_t batch) {
  const auto& s = t.strides();
  const T* base = static_cast<const T*>(t.data_ptr()) + batch * s[0];
  Matrix<float> m(t.size(1), t.size(2));
  for (int64_t r = 0; r < m.rows(); ++r)
    for (int64_t c = 0; c < m.cols(); ++c) m(r, c) = static_cast<float>(base[r * s[1] + c * s[2]]);
  return m;
}

}  // namespace

void CpuBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t batches = out.size(0), m = out.size(1), n = out.size(2);
  dispatch(out.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
      // Rows split among the threads when a matrix is worth it (a block of 32 rows or more).
      const int64_t k = a.size(2), grain = std::max<int64_t>(32, (int64_t(1) << 18) / std::max<int64_t>(1, n * k));
      for (int64_t i = 0; i < batches; ++i) {
        parallel_for(m, grain, [&](int64_t r0, int64_t r1) {
          Eigen::Map<Matrix<T>> c(out.data<T>() + i * m * n + r0 * n, r1 - r0, n);
          with_matrix<T>(a, i, r0, r1 - r0, [&](const auto& A) {
            with_matrix<T>(b, i, 0, k, [&](const auto& B) { c.noalias() = A * B; });
          });
        });
      }
    } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      Matrix<float> c;
      for (int64_t i = 0; i < batches; ++i) {
        c.noalias() = widened<T>(a, i) * widened<T>(b, i);
        T* y = out.data<T>() + i * m * n;
        for (int64_t j = 0; j < m * n; ++j) y[j] = T(c.data()[j]);
      }
    } else {
      fail("matmul: not defined for ", name(out.dtype()));
    }
  });
}

}  // namespace zg::cpu
