// The CUDA backend: every primitive of tensor/backend.h as CUDA kernels (and
// cuBLAS for GEMM). Its methods are spread over the files of this folder, one
// family of kernels each, as in tensor/cpu/:
//
//   backend.cu        registration, the allocator, "is this GPU there?"
//   copy.cu           fill, copy (strided views, casts, host <-> device)
//   random.cu         fill_random (Philox, bit-identical to the CPU)
//   elementwise.cu    unary, binary, where
//   reduce.cu         row reductions
//   nn.cu             softmax, layer_norm, embedding (+ backward), cross_entropy
//   gemm.cu           matmul through cuBLAS
//   linear.cu         linear layers through cuBLASLt: bias, GELU and bias-gradient epilogues
//   adamw.cu          the fused AdamW update
//   attention.cu      fused attention (and its backward) through cuDNN's SDPA graphs
//   sort.cu           sort_rows (CUB's segmented radix sort)
//   scan.cu           cumsum_rows (CUB's block scan)
//   quantize.cu       quantize_blocks, dequantize_blocks (blockwise int8 / int4, ZeRO++)
//
// Conventions of every method: inputs were validated by the front-end as for the
// CPU; the work is queued on the current rank's compute stream
// (cuda::current_stream) of the output's device and the method returns without
// waiting for it -- except copies to the host, which return once the data is there.
// Temporary buffers come from the rank's caching allocator (Tensor::empty), which
// is stream-ordered, so freeing one right after queueing the work that uses it is safe.
#pragma once

#include "tensor/backend.h"

namespace zg::cuda {

class CudaBackend final : public Backend {
 public:
  std::shared_ptr<Allocator> make_allocator(Device device) override;
  void synchronize(Device device) override;
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
  void add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps,
                      const Tensor& sum, const Tensor& out, const Tensor& mean, const Tensor& rstd) override;
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
                 const Tensor& stats) override;
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& stats,
                          const Tensor& grad_out, bool causal, double scale, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv) override;
};

// Throws unless `device` is a CUDA device this process can see, naming why not
// ("cuda:0 requested but no CUDA device is visible (cudaGetDeviceCount: ...)").
void require_device(Device device);

// The host pool's page-locked allocator (cuda/pinned_allocator.cu); null without a GPU.
std::shared_ptr<Allocator> make_page_locked_allocator();

}  // namespace zg::cuda
