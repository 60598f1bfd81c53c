// The CPU backend's Eigen products (products.inc), built once per instruction set:
// `portable` for any x86-64 (or other) CPU, `avx2` with AVX2 + FMA where the CPU has them
// (tensor/cpu/isa.h). Eigen's kernels are templates instantiated in each build, so the
// AVX2 build renames Eigen's namespace: the two never share a symbol the linker could
// pick the wrong one of. (The zg headers' inline functions both include are emitted by
// both; the portable object is linked first, and the linker keeps the first copy of each.)
#pragma once

#include "tensor/tensor.h"

namespace zg::cpu {

struct Products {
  void (*matmul)(const Tensor& a, const Tensor& b, const Tensor& out);
  bool (*attention)(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale, const Tensor& out,
                    const Tensor& stats);
  void (*attention_backward)(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                             const Tensor& dq, const Tensor& dk, const Tensor& dv);
};

namespace portable {
extern const Products products;
}
namespace avx2 {
extern const Products products;  // only on x86-64
}

}  // namespace zg::cpu
