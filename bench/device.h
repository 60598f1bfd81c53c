// The device a bench runs on: parsed from its --device flag (cuda, cuda:N or cpu) with
// a clear error where this build or machine cannot run it, and described for its output
// ("cuda:0, NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)").
#pragma once

#include <string>

#ifdef ZG_WITH_CUDA
#include "cuda/device.h"
#endif
#include "tensor/device.h"
#include "tensor/error.h"

namespace zg::bench {

inline Device parse_device(const std::string& program, const std::string& arg) {
  const Device device(arg);
  ZG_CHECK(device.type != DeviceType::meta, program, ": --device must be cuda or cpu, got '", arg, "'");
#ifdef ZG_WITH_CUDA
  ZG_CHECK(device.type == DeviceType::cpu || device.index < cuda::device_count(), program, ": --device ", arg,
           " needs a GPU, and ", cuda::device_count(), " are visible; --device cpu runs on the CPU");
#else
  ZG_CHECK(device.type == DeviceType::cpu, program, ": --device ", arg,
           " needs a build with CUDA (this one has none); --device cpu runs on the CPU");
#endif
  return device;
}

inline std::string describe_device(Device device) {
#ifdef ZG_WITH_CUDA
  if (device.type == DeviceType::cuda) return device.str() + ", " + cuda::device_description(device.index);
#endif
  return device.str();
}

}  // namespace zg::bench
