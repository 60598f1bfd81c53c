// GPU discovery. A build with CUDA still runs where there is no GPU or no
// driver: device_count() is then 0 and CPU work goes on.
#pragma once

#include <string>

namespace zg::cuda {

int device_count();
// Throws zg::Error naming cuda:`index` and the number of visible GPUs unless it exists.
void check_device(int index);
// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)"; throws zg::Error for a bad index.
std::string device_description(int index);

}  // namespace zg::cuda
