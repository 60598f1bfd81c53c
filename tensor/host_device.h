// ZG_HOST_DEVICE marks a small function that compiles for the CPU and, under nvcc, for
// a CUDA kernel too -- how the CPU and GPU backends share one definition of the math
// (tensor/philox.h, tensor/int_math.h).
#pragma once

#if defined(__CUDACC__)
#define ZG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ZG_HOST_DEVICE inline
#endif
