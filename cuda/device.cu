#include <cstdio>
#include <mutex>

#include "cuda/check.h"
#include "cuda/device.h"
#include "tensor/memory.h"

namespace zg::cuda {

// 0 wherever the runtime reaches no GPU -- no device, no driver, the toolkit's stub
// libcuda of a build container -- so CPU work goes on (require_device names the reason
// when a GPU is asked for). A driver that is there but older than this build's runtime
// is said once on stderr: on a machine with GPUs, every GPU test would otherwise skip
// without a word.
int device_count() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess) return count;
  cudaGetLastError();  // clear the error so later calls do not see it
  int driver = 0;
  if (status == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0) {
    static std::once_flag said;
    std::call_once(said, [driver] {
      std::fprintf(stderr,
                   "zerograd: the NVIDIA driver supports CUDA %d.%d, older than this build's runtime (%d.%d): "
                   "its GPUs are not used\n",
                   driver / 1000, driver % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    });
  }
  return 0;
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
