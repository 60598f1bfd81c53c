// The CPU backend's kernels that gain from wide vectors (vectorized.inc: the GEMMs, fused f32
// attention, the GELU pair, the f64 row exponentials, f64 column sums, f32 layer norm), built once per
// instruction set: `portable` for any x86-64 (or other) CPU, `avx2` with AVX2 + FMA where
// the CPU has them (tensor/cpu/isa.h).
// Eigen's kernels are templates instantiated in each build, so the AVX2 build renames
// Eigen's namespace: the two never share a symbol the linker could pick the wrong one of.
// (The zg headers' inline functions both include are emitted by both; the portable object
// is linked first, and the linker keeps the first copy of each.)
#pragma once

#include "tensor/tensor.h"

namespace zg::cpu {

struct VectorKernels {
  void (*matmul)(const Tensor& a, const Tensor& b, const Tensor& out);
  // out [M, N] = x [M, K] weight [N, K]^T + bias [N], all f32, out contiguous.
  void (*linear_f32)(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out);
  bool (*attention)(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale, const Tensor& out,
                    const Tensor& stats);
  void (*attention_backward)(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                             const Tensor& dq, const Tensor& dk, const Tensor& dv);
  // GELU (grad null) or its backward (dx = grad * gelu'(in)) into `out`; all contiguous f32.
  void (*gelu_f32)(const Tensor& in, const Tensor* grad, const Tensor& out);
  // The row exponentials of softmax and cross-entropy, in f64 (nn.cpp):
  // sum_j exp(x_j - a), and x_j = exp((x_j - a) - b) in place.
  double (*sum_exp)(const double* x, int64_t n, double a);
  void (*exp_shifted)(double* x, int64_t n, double a, double b);
  // total[j] += row[j] over n, widened to f64 (column sums, a row at a time).
  void (*add_row_f64)(const float* row, int64_t n, double* total);
  // sum_j x_j, or (squares) sum_j x_j^2, over n floats, in f64 (reduce.cpp's sums).
  double (*sum_f64)(const float* x, int64_t n, bool squares);
  // Layer norm and its backward on contiguous f32 rows [rows, channels], channels a multiple
  // of 4, sums in f64 (nn.cpp's kernels for the other dtypes); w, b, dw, db may be null.
  void (*layer_norm_f32)(const float* x, const float* w, const float* b, int64_t rows, int64_t channels, double eps,
                         float* y, float* mean, float* rstd);
  void (*layer_norm_backward_f32)(const float* g, const float* x, const float* w, const float* mean,
                                  const float* rstd, int64_t rows, int64_t channels, float* dx, float* dw, float* db);
};

namespace portable {
extern const VectorKernels kernels;
}
namespace avx2 {
extern const VectorKernels kernels;  // only on x86-64
}

// The build for the widest ISA this CPU has.
const VectorKernels& vector_kernels();

}  // namespace zg::cpu
