// Whether the CUDA backend's fused attention (cuDNN's flash attention, cuda/attention.cu)
// takes a call, and if not, why.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/tensor.h"

namespace zg::cuda {

// Why Backend::attention on the GPU declines these operands -- leaving them to the
// composite of matmul and softmax -- or "" when cuDNN's fused kernels take them, the
// backward included when q, k or v requires grad. Arguments as for Backend::attention
// (out only lends its layout). It checks, builds and caches exactly as a call does, so
// its answer is the call's: the dtype, a layout the kernels cannot read, or cuDNN's own
// message when it has no engine for the graph.
std::string fused_attention_unsupported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                        bool causal, double scale);

// How many layouts `device`'s graph cache holds, built or declined: a forward or
// backward graph is built once per layout, so after warm-up a training step adds none.
struct AttentionGraphCount {
  int64_t forward = 0, backward = 0;
};
AttentionGraphCount fused_attention_graphs(Device device);

}  // namespace zg::cuda
