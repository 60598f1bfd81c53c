// Batched GEMM through cuBLAS (cublasGemmStridedBatchedEx): f32 and f64 in their
// own precision (no TF32), f16/bf16 inputs on tensor cores with f32 accumulation
// and no reduced-precision split-K reductions, rounded once to the output.
//
// Row-major C = A B is, read column-major, C^T = B^T A^T: cuBLAS computes the
// [N, M] column-major product of B^T and A^T straight into our row-major C. A
// row-major operand is its own transpose in column-major memory (op N), a
// column-major one needs op T; batch strides (0 included: a broadcast operand)
// pass through unchanged.
#include <climits>
#include <memory>

#include <cublas_v2.h>

#include "cuda/backend.h"
#include "cuda/gemm.h"
#include "cuda/check.h"
#include "cuda/rank_state.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

// How cuBLAS reads one [B, R, C] operand: row-major (unit column stride) or
// column-major (unit row stride), its leading dimension and batch stride.
struct Operand {
  bool row_major;
  int64_t ld;
  int64_t batch_stride;
};

Operand operand_layout(const Tensor& t, const char* which) {
  const int64_t rows = t.size(1), cols = t.size(2);
  const int64_t sb = t.strides()[0], sr = t.strides()[1], sc = t.strides()[2];
  Operand o{true, 0, sb};
  if (sc == 1 && sr >= std::max<int64_t>(cols, 1)) o = {true, sr, sb};
  else if (sr == 1 && sc >= std::max<int64_t>(rows, 1)) o = {false, sc, sb};
  // One row or one column: the other stride is never used.
  else if (rows == 1) o = sc == 1 ? Operand{true, std::max<int64_t>(cols, 1), sb} : Operand{false, sc, sb};
  else if (cols == 1) o = sr == 1 ? Operand{false, std::max<int64_t>(rows, 1), sb} : Operand{true, sr, sb};
  else
    fail("matmul: operand ", which, " (", describe(t), ", strides ", shape_str(t.strides()),
         ") is neither row- nor column-major");
  ZG_CHECK(o.ld >= 1 && o.ld <= INT_MAX, "matmul: leading dimension ", o.ld, " of operand ", which, " (",
           describe(t), ") is outside what cuBLAS takes");
  return o;
}

}  // namespace

Tensor gemm_workspace(Device device) {
  MemoryScope scope(MemoryCategory::workspace);
  return Tensor::empty({kGemmWorkspaceBytes}, TensorOptions(DType::boolean).device(device));
}

void CudaBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  ZG_CHECK(a.dim() == 3 && b.dim() == 3 && out.dim() == 3 && out.is_contiguous(),
           "matmul: expected a [B, M, K], b [B, K, N] and a contiguous out [B, M, N], got ", describe(a), ", ",
           describe(b), " and ", describe(out));
  ZG_CHECK(a.dtype() == out.dtype() && b.dtype() == out.dtype(), "matmul: dtypes differ: ", describe(a), ", ",
           describe(b), " -> ", describe(out));
  const int64_t batches = out.size(0), m = out.size(1), n = out.size(2), k = a.size(2);
  ZG_CHECK(a.size(0) == batches && b.size(0) == batches && a.size(1) == m && b.size(1) == k && b.size(2) == n,
           "matmul: shapes do not match: ", describe(a), " @ ", describe(b), " -> ", describe(out));
  dispatch_device(out.dtype(), [&]<class T>() {
    if constexpr (!is_float_v<T>) {
      fail("matmul: not defined for ", name(out.dtype()));
    } else {
      if (batches == 0 || m == 0 || n == 0) return;
      if (k == 0) return fill(out, 0.0);  // an empty sum
      for (int64_t size : {batches, m, n, k})
        ZG_CHECK(size <= INT_MAX, "matmul: size ", size, " is larger than cuBLAS takes (", describe(a), " @ ",
                 describe(b), ")");
      const Operand la = operand_layout(a, "a"), lb = operand_layout(b, "b");
      OnDevice on(out.device());
      const Tensor workspace = gemm_workspace(on.device);
      const cublasHandle_t handle = rank_state(on.device).cublas();
      // cublasSetStream resets the workspace, so the workspace is set after it.
      ZG_CUBLAS_CHECK(cublasSetStream(handle, on.stream));
      ZG_CUBLAS_CHECK(cublasSetWorkspace(handle, workspace.data_ptr(), static_cast<size_t>(kGemmWorkspaceBytes)));
      const GemmTypes types = gemm_types<T>();
      using Scale = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const Scale alpha = 1, beta = 0;
      // out^T [N, M] = op(b^T) [N, K] * op(a^T) [K, M], all column-major.
      ZG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          handle, lb.row_major ? CUBLAS_OP_N : CUBLAS_OP_T, la.row_major ? CUBLAS_OP_N : CUBLAS_OP_T,
          static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b.data_ptr(), types.data,
          static_cast<int>(lb.ld), lb.batch_stride, a.data_ptr(), types.data, static_cast<int>(la.ld),
          la.batch_stride, &beta, out.data_ptr(), types.data, static_cast<int>(n), m * n, static_cast<int>(batches),
          types.compute, CUBLAS_GEMM_DEFAULT));
      // The workspace goes back to the (stream-ordered) allocator when we return; the
      // handle still points at it, which is harmless: every call sets a new one first.
    }
  });
}

}  // namespace zg::cuda
