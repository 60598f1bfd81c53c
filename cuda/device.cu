#include "cuda/check.h"
#include "cuda/device.h"
#include "tensor/memory.h"

namespace zg::cuda {

int device_count() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // clear the error so later calls do not see it
    return 0;
  }
  ZG_CUDA_CHECK(status);
  return count;
}

void check_device(int index) {
  const int count = device_count();
  ZG_CHECK(index >= 0 && index < count, "cuda: device ", index, " does not exist (", count, " GPUs visible)");
}

std::string device_description(int index) {
  check_device(index);
  cudaDeviceProp prop{};
  ZG_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         format_bytes(static_cast<int64_t>(prop.totalGlobalMem)) + ")";
}

}  // namespace zg::cuda
