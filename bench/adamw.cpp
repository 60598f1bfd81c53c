// adamw: the fused AdamW update (Backend::adamw) against the device's own copy
// bandwidth, measured in the same run. Per parameter the update moves
//   read  grad (bf16, 2 B) + master, m, v (f32, 12 B)
//   write master, m, v (12 B) + the bf16 compute copy (2 B)           = 28 B
// or, with --grad f32 (f32 training: the master is the parameter, as DeepSpeedCPUAdam's
// fp32 step), read grad, master, m, v (16 B) and write master, m, v (12 B): 28 B too.
// so its bandwidth is 28 n / time; the reference is a device-to-device copy of a
// buffer of 14 n bytes (cudaMemcpyAsync; memcpy on the CPU), which moves 28 n bytes
// too. The bar: AdamW at >= 80% of the copy's bandwidth.
//
//   build/bench/adamw --params 100000000            (cuda:0)
//   build/bench/adamw --device cpu --params 1000000 --json
//   build/bench/adamw --device cpu --params 10000000 --grad f32       (bench/deepspeed_adam.py's case)
#include <cstdio>
#include <cstring>
#include <string>

#ifdef ZG_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/stream.h"
#endif
#include "bench/args.h"
#include "bench/device.h"
#include "bench/timing.h"
#include "tensor/backend.h"
#include "tensor/cpu/isa.h"
#include "zerograd.h"

using namespace zg;

namespace {

constexpr int64_t kBytesPerParameter = 28;

void usage() {
  std::printf(
      "usage: adamw [--device cuda|cpu] [--params N] [--iters K] [--grad bf16|f32] [--json]\n"
      "GB/s of the fused AdamW update over N parameters (bf16 grads and compute copy, f32 master,\n"
      "m, v; or f32 grads and no copy: 28 bytes moved a parameter either way) and of a\n"
      "device-to-device copy moving as many bytes.\n"
      "Defaults: --device cuda, --params 100000000 (1000000 on the cpu), --iters 20.\n");
}

// dst <- src (both contiguous, same size): the device's plain copy, the reference.
void raw_copy(const Tensor& src, const Tensor& dst) {
#ifdef ZG_WITH_CUDA
  if (src.device().type == DeviceType::cuda) {
    cuda::DeviceGuard guard(src.device().index);
    ZG_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(src.nbytes()),
                                  cudaMemcpyDeviceToDevice, cuda::current_stream(src.device())));
    return;
  }
#endif
  std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(src.nbytes()));
}

int run(int argc, char** argv) {
  std::string device_arg = "cuda", grad_arg = "bf16";
  int64_t params = 0, iters = 20;
  bool json = false;
  bench::Args args("adamw", argc, argv);
  while (!args.done()) {
    const std::string flag = args.next();
    if (flag == "--help") return usage(), 0;
    else if (flag == "--device") device_arg = args.value(flag);
    else if (flag == "--params") params = args.count(flag);
    else if (flag == "--iters") iters = args.count(flag);
    else if (flag == "--grad") grad_arg = args.value(flag);
    else if (flag == "--json") json = true;
    else fail("adamw: unknown flag ", flag, " (see --help)");
  }
  const Device device = bench::parse_device("adamw", device_arg);
  if (params == 0) params = device.type == DeviceType::cpu ? 1'000'000 : 100'000'000;

  const TensorOptions f32 = TensorOptions(DType::f32).device(device), bf16 = TensorOptions(DType::bf16).device(device);
  const Tensor master = randn({params}, f32), m = zeros({params}, f32), v = zeros({params}, f32);
  ZG_CHECK(grad_arg == "bf16" || grad_arg == "f32", "adamw: --grad must be bf16 or f32, got ", grad_arg);
  const bool f32_training = grad_arg == "f32";
  const Tensor grad = randn({params}, f32_training ? f32 : bf16);
  const Tensor compute = f32_training ? Tensor() : empty({params}, bf16);
  const Tensor copy_src = zeros({params * kBytesPerParameter / 2}, TensorOptions(DType::boolean).device(device));
  const Tensor copy_dst = empty_like(copy_src);
  AdamWStep step;  // GPT-2's settings; the step count only changes the bias corrections
  step.lr = 1e-4, step.beta2 = 0.95, step.weight_decay = 0.1;
  auto update = [&] {
    ++step.step;
    backend(device).adamw(master, grad, m, v, compute, step);
  };
  auto copy = [&] { raw_copy(copy_src, copy_dst); };
  for (int i = 0; i < 3; ++i) update(), copy();  // warm-up
  const double adamw_ms = bench::ms_per_call(update, iters, device);
  const double copy_ms = bench::ms_per_call(copy, iters, device);
  const double bytes = static_cast<double>(params * kBytesPerParameter);
  const double adamw_gbps = bytes / (adamw_ms * 1e6), copy_gbps = bytes / (copy_ms * 1e6);
  // On the CPU, which vector loop ran (tensor/cpu/adamw.cpp; ZG_CPU_ISA caps it).
  const std::string loop = device.type == DeviceType::cpu ? cpu::name(cpu::cpu_isa()) : "cuda";
  if (json) {
    std::printf("{\"device\": \"%s\", \"loop\": \"%s\", \"grad\": \"%s\", \"params\": %lld, \"iters\": %lld, \"adamw_ms\": %.6g, \"adamw_gbps\": %.6g, "
                "\"copy_ms\": %.6g, \"copy_gbps\": %.6g, \"ratio\": %.6g}\n",
                bench::describe_device(device).c_str(), loop.c_str(), grad_arg.c_str(), static_cast<long long>(params),
                static_cast<long long>(iters), adamw_ms, adamw_gbps, copy_ms, copy_gbps, adamw_gbps / copy_gbps);
    return 0;
  }
  std::printf("fused AdamW over %lld parameters on %s (%s loop), %s gradients (%lld timed calls each)\n",
              static_cast<long long>(params), bench::describe_device(device).c_str(), loop.c_str(), grad_arg.c_str(),
              static_cast<long long>(iters));
  std::printf("  adamw  %9.3f ms  %8.1f GB/s   (28 bytes a parameter)\n", adamw_ms, adamw_gbps);
  std::printf("  copy   %9.3f ms  %8.1f GB/s   (the same bytes, device to device)\n", copy_ms, copy_gbps);
  std::printf("  adamw / copy = %.1f%% of the copy's bandwidth\n", 100.0 * adamw_gbps / copy_gbps);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
