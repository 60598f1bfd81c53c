// Every CUDA runtime, cuBLAS / cuBLASLt, cuDNN and NCCL status is checked and
// turned into a zg::Error that names the call, the error and where it happened.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>

#include "tensor/error.h"

namespace zg::cuda {

// A failed call also leaves its error as the thread's "last error"; it is cleared here,
// so the next launch check does not report it again against an unrelated kernel.
inline void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  cudaGetLastError();
  fail(call, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ") at ", file, ":", line);
}

// The libraries' statuses (cuBLASLt shares cublasStatus_t); defined in check.cu.
void check(cublasStatus_t status, const char* call, const char* file, int line);
void check(cudnnStatus_t status, const char* call, const char* file, int line);
void check(ncclResult_t status, const char* call, const char* file, int line);

}  // namespace zg::cuda

#define ZG_CUDA_CHECK(call) ::zg::cuda::check((call), #call, __FILE__, __LINE__)
#define ZG_CUBLAS_CHECK(call) ::zg::cuda::check(static_cast<cublasStatus_t>(call), #call, __FILE__, __LINE__)
#define ZG_CUDNN_CHECK(call) ::zg::cuda::check(static_cast<cudnnStatus_t>(call), #call, __FILE__, __LINE__)
#define ZG_NCCL_CHECK(call) ::zg::cuda::check(static_cast<ncclResult_t>(call), #call, __FILE__, __LINE__)
