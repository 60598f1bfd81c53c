// The CPU backend: plain loops over strided views (tensor/cpu/loops.h), a GEMM of its own
// for f32 (gemm.inc; Eigen for f64), and f16/bf16 computed in f32. Its methods are spread over the files
// of this folder, one family of kernels each.
#pragma once

#include "tensor/backend.h"

namespace zg::cpu {

// The host pool without a GPU: ordinary memory, its freed large blocks cached (tensor/block_cache.h).
std::shared_ptr<Allocator> make_host_pool();

class CpuBackend final : public Backend {
 public:
  std::shared_ptr<Allocator> make_allocator(Device device) override;
  void fill(const Tensor& out, double value) override;
  void fill_random(const Tensor& out, const RandomSpec& spec) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void unary(UnaryOp op, const Tensor& in, const Tensor& out) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void reduce(ReduceOp op, const Tensor& in, const Tensor& out) override;
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act, const Tensor& out,
              const Tensor& pre) override;
  void linear_weight_grad(const Tensor& grad, const Tensor& x, const Tensor& grad_weight,
                          const Tensor& grad_bias) override;
  void softmax(const Tensor& in, bool log, const Tensor& out) override;
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                  const Tensor& mean, const Tensor& rstd) override;
  void layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                           const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight,
                           const Tensor& grad_bias) override;
  void embedding(const Tensor& weight, const Tensor& indices, const Tensor& out) override;
  void adamw(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& compute,
             const AdamWStep& step) override;
  void embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) override;
  void quantize_blocks(const Tensor& in, int bits, int64_t block, int64_t segment, const Tensor& q,
                       const Tensor& scales) override;
  void dequantize_blocks(const Tensor& q, const Tensor& scales, int bits, int64_t block, int64_t segment,
                       const Tensor& out) override;
  void sort_rows(const Tensor& in, bool descending, const Tensor& indices) override;
  void cumsum_rows(const Tensor& in, const Tensor& out) override;
  void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, const Tensor& loss) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& target, int64_t ignore_index, const Tensor& loss,
                              const Tensor& grad_loss, const Tensor& grad_logits) override;
  bool attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale, const Tensor& out,
                 const Tensor& stats) override;  // f32 (vectorized.inc)
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& stats,
                          const Tensor& grad_out, bool causal, double scale, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv) override;
};

}  // namespace zg::cpu
