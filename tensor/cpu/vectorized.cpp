// The backend's methods that vectorized.inc implements go to the build for the widest ISA
// this CPU has.
#include "tensor/cpu/vectorized.h"

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/isa.h"

namespace zg::cpu {

const VectorKernels& vector_kernels() {
#if defined(__x86_64__)
  static const VectorKernels& chosen = cpu_isa() == Isa::portable ? portable::kernels : avx2::kernels;
  return chosen;
#else
  return portable::kernels;
#endif
}

void CpuBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out) { vector_kernels().matmul(a, b, out); }

// f32 with a bias: one GEMM that starts from the bias (Backend::linear adds it in a pass of its own).
void CpuBackend::linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act, const Tensor& out,
                        const Tensor& pre) {
  const Tensor& target = act == Activation::none ? out : pre;
  if (!bias.defined() || x.dtype() != DType::f32 || !target.is_contiguous())
    return Backend::linear(x, weight, bias, act, out, pre);
  vector_kernels().linear_f32(x, weight, bias, target);
  if (act == Activation::gelu) unary(UnaryOp::gelu, pre, out);
}

bool CpuBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                           const Tensor& out, const Tensor& stats) {
  return vector_kernels().attention(q, k, v, causal, scale, out, stats);
}

void CpuBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  vector_kernels().attention_backward(q, k, v, out, stats, grad_out, causal, scale, dq, dk, dv);
}

}  // namespace zg::cpu
