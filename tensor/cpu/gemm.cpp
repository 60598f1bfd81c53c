// Batched GEMM through Eigen. Each matrix is mapped in place with its strides
// (row- or column-major views need no copy); f16/bf16 matrices are widened to
// f32, multiplied with f32 accumulation, and rounded back, as tensor cores do.
#include <Eigen/Core>
#include <vector>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"

namespace zg::cpu {

namespace {

template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using DynamicStride = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
template <class T>
using StridedMatrix = Eigen::Map<const Matrix<T>, 0, DynamicStride>;

// Matrix `batch` of a [B, R, C] tensor, as a strided Eigen view.
template <class T>
StridedMatrix<T> matrix(const Tensor& t, int64_t batch) {
  const auto& s = t.strides();
  return StridedMatrix<T>(static_cast<const T*>(t.data_ptr()) + batch * s[0], t.size(1), t.size(2),
                          DynamicStride(s[1], s[2]));
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
      for (int64_t i = 0; i < batches; ++i) {
        Eigen::Map<Matrix<T>> c(out.data<T>() + i * m * n, m, n);
        c.noalias() = matrix<T>(a, i) * matrix<T>(b, i);
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
