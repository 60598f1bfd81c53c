// Every CUDA runtime status is checked and turned into a zg::Error that names
// the call, the error and where it happened.
#pragma once

#include <cuda_runtime.h>

#include "tensor/error.h"

namespace zg::cuda {

inline void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess)
    fail(call, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ") at ", file, ":", line);
}

}  // namespace zg::cuda

#define ZG_CUDA_CHECK(call) ::zg::cuda::check((call), #call, __FILE__, __LINE__)
