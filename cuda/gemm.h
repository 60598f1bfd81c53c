// What the cuBLAS (gemm.cu) and cuBLASLt (linear.cu) GEMMs share.
#pragma once

#include <cublas_api.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "tensor/tensor.h"

namespace zg::cuda {

// Each GEMM call's workspace, taken from the caching allocator (category `workspace`)
// and given back when the call returns -- safe because the allocator is stream-ordered.
// 32 MiB is what cuBLAS itself would reserve on Hopper.
inline constexpr int64_t kGemmWorkspaceBytes = int64_t{32} << 20;
Tensor gemm_workspace(Device device);

// The cuBLAS element and compute types of a device element type: f64 and f32 in their
// own precision (no TF32), f16/bf16 on tensor cores accumulating in f32.
struct GemmTypes {
  cudaDataType_t data;
  cublasComputeType_t compute;
};
template <class T>
GemmTypes gemm_types() {
  if constexpr (std::is_same_v<T, double>) return {CUDA_R_64F, CUBLAS_COMPUTE_64F};
  else if constexpr (std::is_same_v<T, float>) return {CUDA_R_32F, CUBLAS_COMPUTE_32F};
  else if constexpr (std::is_same_v<T, __half>) return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
  else return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
}

}  // namespace zg::cuda
