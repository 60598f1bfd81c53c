// The backend's products go to the build of products.inc for the widest ISA this CPU has.
#include "tensor/cpu/products.h"

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/isa.h"

namespace zg::cpu {

namespace {

const Products& products() {
#if defined(__x86_64__)
  static const Products& chosen = cpu_isa() == Isa::portable ? portable::products : avx2::products;
  return chosen;
#else
  return portable::products;
#endif
}

}  // namespace

void CpuBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out) { products().matmul(a, b, out); }

bool CpuBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                           const Tensor& out, const Tensor& stats) {
  return products().attention(q, k, v, causal, scale, out, stats);
}

void CpuBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  products().attention_backward(q, k, v, out, stats, grad_out, causal, scale, dq, dk, dv);
}

}  // namespace zg::cpu
