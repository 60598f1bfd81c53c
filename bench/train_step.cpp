// train_step: the speed of one GPT training step -- forward, backward, global-norm
// clipping and a fused AdamW update with fp32 master weights -- and its peak memory
// by category, next to what bench/torch_reference.py measures for the same model,
// batch and optimizer in PyTorch (run both in one session on one GPU).
//
// The model trains through a ShardedModel over a group of one (the library's one
// training path). The step issues its kernels and returns: the norm and the clipping
// coefficient stay on the device (ShardedModel::step_on_device) and each step's loss is
// kept there until the timing is over, so nothing waits for the GPU inside the timed loop.
//
//   tokens/s = steps * batch * seq / seconds
//   MFU      = tokens/s * flops_per_token / peak flop/s, with (PaLM, appendix B)
//              flops_per_token = 6 Ψ + 12 L C T   (Ψ parameters, L layers, C width, T sequence)
//
// Both programs start from the same weights and tokens: `--write-init FILE` writes
// them (GPT-2 initialisation from --seed, and a [batch, seq + 1] token block), and
// `--init FILE` in either program reads them; every step trains on that one block.
//
//   build/bench/train_step --model 124m --device cuda --write-init /tmp/init.safetensors
//   python3 bench/torch_reference.py --init /tmp/init.safetensors --mode eager
//   build/bench/train_step --device cpu --model tiny --dtype f32 --steps 20 --json
//   build/bench/train_step --model 1.5b --batch 8 --offload optimizer --checkpointing   (ZeRO-Offload on one GPU)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/args.h"
#include "bench/device.h"
#include "bench/offload_schedule.h"
#ifdef ZG_WITH_CUDA
#include "cuda/stream.h"
#endif
#include "nn/gpt.h"
#include "nn/serialize.h"
#include "dist/comm/fake_group.h"
#include "dist/zero/sharded_model.h"
#include "tensor/backend.h"
#include "zerograd.h"

using namespace zg;

namespace {

// How often the host has waited for the GPU so far (cuda::host_waits); the CPU never waits.
int64_t host_waits() {
#ifdef ZG_WITH_CUDA
  return cuda::host_waits();
#else
  return 0;
#endif
}

struct Flags {
  std::string model = "124m", device = "cuda", dtype = "bf16", init, write_init, offload = "none";
  int64_t batch = 16, seq = 1024, steps = 20, warmup = 3;
  int stage = -1;  // -1: the least stage --offload goes with (0 without)
  bool checkpointing = false;
  double lr = 6e-4, peak_tflops = 0;  // 0: from the device name
  uint64_t seed = 1337;
  bool json = false;
  bench::OffloadSchedule schedule = bench::OffloadSchedule::after_backward;  // --offload-schedule
};

// GPT-2 124M as in the issue and llm.c: the vocabulary of 50257 padded to 50304 (a
// multiple of 128) so the LM head's GEMMs take the fast path; tokens stay < 50257.
struct Preset {
  const char* name;
  int64_t layers, heads, embd, vocab, block, tokens;  // tokens: ids drawn from [0, tokens)
};
// "tiny" and "small" (4 layers of 256) are the CPU comparison's (bench/cpu_vs_torch.py);
// "6.7b" is GPT-3 6.7B's shape, the largest whose 14 bytes a parameter of offloaded state
// fit a 128 GiB host (bench/zero_memory --largest-on).
const Preset kPresets[] = {{"tiny", 2, 2, 64, 512, 64, 500}, {"small", 4, 4, 256, 512, 64, 500},
                           {"124m", 12, 12, 768, 50304, 1024, 50257}, {"350m", 24, 16, 1024, 50304, 1024, 50257},
                           {"1.5b", 48, 25, 1600, 50304, 1024, 50257}, {"6.7b", 32, 32, 4096, 50304, 1024, 50257}};

void usage() {
  std::printf(
      "usage: train_step [--model tiny|small|124m|350m|1.5b|6.7b] [--device cuda|cpu] [--dtype bf16|f32] [--batch B]\n"
      "                  [--seq T] [--steps K] [--warmup W] [--lr X] [--seed S] [--init FILE] [--write-init FILE]\n"
      "                  [--stage 0-3] [--offload none|optimizer|optimizer+params] [--checkpointing]\n"
      "                  [--offload-schedule after-backward|in-backward|delayed] [--peak-tflops X] [--json]\n"
      "  K steps are trained and printed; the first W of them are left out of the timing.\n"
      "  --stage: the ZeRO stage of the group of one (default 0; 1 with --offload optimizer, 3 with\n"
      "  optimizer+params); --checkpointing recomputes each block's activations in backward.\n"
      "  --offload-schedule: when the CPU AdamW runs -- after the backward (default), each unit's on a\n"
      "  host thread as its gradient lands (step_in_backward; no clipping), or delayed a step (the DPU).\n");
}

bool parse(int argc, char** argv, Flags& f) {
  bench::Args args("train_step", argc, argv);
  while (!args.done()) {
    const std::string a = args.next();
    if (a == "--help") return false;
    else if (a == "--model") f.model = args.value(a);
    else if (a == "--device") f.device = args.value(a);
    else if (a == "--dtype") f.dtype = args.value(a);
    else if (a == "--batch") f.batch = args.count(a);
    else if (a == "--seq") f.seq = args.count(a);
    else if (a == "--steps") f.steps = args.count(a);
    else if (a == "--warmup") {
      const double steps = args.number(a);
      ZG_CHECK(steps >= 0 && steps == std::floor(steps) && steps < 0x1p62, "train_step: --warmup needs a whole number "
               ">= 0, got ", steps);
      f.warmup = static_cast<int64_t>(steps);
    }
    else if (a == "--lr") f.lr = args.number(a);
    else if (a == "--seed") f.seed = static_cast<uint64_t>(args.count(a));
    else if (a == "--init") f.init = args.value(a);
    else if (a == "--write-init") f.write_init = args.value(a);
    else if (a == "--peak-tflops") {
      f.peak_tflops = args.number(a);
      ZG_CHECK(f.peak_tflops > 0, "train_step: --peak-tflops needs a positive number, got ", f.peak_tflops);
    }
    else if (a == "--json") f.json = true;
    else if (a == "--stage") {
      const std::string stage = args.value(a);
      int64_t n = 0;
      ZG_CHECK(parse_number(stage, n) && n >= 0 && n <= 1024, "train_step: --stage needs a whole number in [0, 1024], "
               "got '", stage, "'");
      f.stage = static_cast<int>(n);
    }
    else if (a == "--offload") f.offload = args.value(a);
    else if (a == "--offload-schedule") f.schedule = bench::parse_offload_schedule(args.value(a), "train_step");
    else if (a == "--checkpointing") f.checkpointing = true;
    else fail("train_step: unknown flag ", a, " (see --help)");
  }
  ZG_CHECK(f.steps > f.warmup && f.warmup >= 0, "train_step: need --steps > --warmup >= 0, got --steps ", f.steps,
           " --warmup ", f.warmup);
  return true;
}

const Preset& preset_named(const std::string& name) {
  for (const Preset& p : kPresets)
    if (name == p.name) return p;
  fail("train_step: unknown --model ", name, " (tiny, small, 124m, 350m, 1.5b, 6.7b)");
}

// Dense bf16 tensor-core peak of the GPUs this bench is meant for; 0 when unknown
// (then MFU is not printed unless --peak-tflops gives it).
double peak_tflops_of(const std::string& description) {
  if (description.find("H100") != std::string::npos && description.find("PCIe") != std::string::npos) return 756.0;
  if (description.find("H100") != std::string::npos || description.find("H200") != std::string::npos) return 989.4;
  return 0.0;
}

int run(const Flags& f) {
  const Preset& p = preset_named(f.model);
  const DType compute = f.dtype == "bf16" ? DType::bf16 : f.dtype == "f32" ? DType::f32
                        : throw Error("train_step: --dtype must be bf16 or f32, got " + f.dtype);
  const Device device = bench::parse_device("train_step", f.device);
  nn::GPTConfig config;
  config.n_layer = p.layers, config.n_head = p.heads, config.n_embd = p.embd;
  config.vocab_size = p.vocab, config.block_size = std::max(p.block, f.seq);
  config.activation_checkpointing = f.checkpointing;

  // Weights and the token block: from --init, or GPT-2's initialisation and Philox draws.
  manual_seed(f.seed);
  nn::GPT model(config, TensorOptions(DType::f32).device(device));
  Tensor tokens;
  if (!f.init.empty()) {
    const nn::LoadedState loaded = nn::load_state(model, f.init, /*strict=*/false);  // the file holds the tokens too
    ZG_CHECK(loaded.missing.empty(), "train_step: ", f.init, " has no tensor '",
             loaded.missing.empty() ? "" : loaded.missing.front(), "' of the model");
    tokens = SafetensorsFile(f.init).read("tokens");
    ZG_CHECK(tokens.shape() == Shape({f.batch, f.seq + 1}), "train_step: ", f.init, " holds tokens ",
             describe(tokens), ", but --batch ", f.batch, " --seq ", f.seq, " need [", f.batch, ", ", f.seq + 1, "]");
  } else {
    tokens = (rand({f.batch, f.seq + 1}) * static_cast<double>(p.tokens)).to(DType::i64);  // truncation: [0, tokens)
  }
  if (!f.write_init.empty()) {
    std::vector<std::pair<std::string, Tensor>> state;
    for (const auto& [name, t] : model.named_parameters()) state.emplace_back(name, t);
    state.emplace_back("tokens", tokens);
    save_safetensors(f.write_init, state,
                     {{"n_layer", std::to_string(p.layers)}, {"n_head", std::to_string(p.heads)},
                      {"n_embd", std::to_string(p.embd)}, {"vocab_size", std::to_string(p.vocab)},
                      {"block_size", std::to_string(config.block_size)}, {"batch", std::to_string(f.batch)},
                      {"seq", std::to_string(f.seq)}, {"lr", std::to_string(f.lr)}});
  }
  tokens = tokens.to(device);
  const Tensor inputs = tokens.narrow(1, 0, f.seq).contiguous(), targets = tokens.narrow(1, 1, f.seq).contiguous();

  // bf16 weights the model computes with, fp32 master and Adam moments (16 bytes a parameter),
  // the last 12 in host memory with --offload; without --stage, at the least stage ZeroConfig
  // accepts with it (at N = 1 every stage holds what DDP holds).
  const dist::Offload offload = dist::parse_offload(f.offload);
  dist::SingleRank one;
  dist::ZeroConfig zero = bench::with_schedule({.stage = std::max(f.stage, 0), .compute_dtype = compute,
                                                .adamw = {0.9, 0.95, 1e-8, 0.1}, .max_grad_norm = 1.0,
                                                .offload = offload},
                                               f.schedule);
  while (f.stage < 0 && zero.stage < 3 && !zero.problem(one.size()).empty()) ++zero.stage;
  const std::string wrong = zero.problem(one.size());
  ZG_CHECK(wrong.empty(), "train_step: ", wrong);
  dist::ShardedModel trainer(model, one, zero);

  std::vector<Tensor> losses;  // kept on the device until the timing is over
  const bool in_backward = f.schedule == bench::OffloadSchedule::in_backward;
  auto step = [&]() {
    trainer.zero_grad();
    if (in_backward) trainer.step_in_backward(f.lr);
    {
      MemoryScope scope(MemoryCategory::activation);
      Tensor loss = model.forward(inputs, targets).loss;
      loss.backward();
      losses.push_back(loss.detach());
    }
    // The host's schedules finish on the host; the clipping coefficient otherwise stays on the GPU.
    if (f.schedule == bench::OffloadSchedule::after_backward) trainer.step_on_device(f.lr);
    else trainer.step(f.lr);
  };
  for (int64_t s = 0; s < f.warmup; ++s) step();
  backend(device).synchronize(device);
  Context::current().allocator(device)->reset_peaks();
  Context::current().host_allocator()->reset_peaks();  // offload's pool, in host memory
  const int64_t waits_before = host_waits();
  // The first timed step starts on an idle GPU, so the time until step() returns is the
  // host's alone: what issuing one step's kernels costs. Well below the GPU's time per
  // step, the host keeps ahead and the GPU never waits for it: a CUDA graph, which saves
  // host time only, would gain nothing. (On the CPU the step runs as it is issued.)
  const auto start = std::chrono::steady_clock::now();
  step();
  const double issue_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int64_t s = f.warmup + 1; s < f.steps; ++s) step();
  const int64_t waits_in_steps = host_waits() - waits_before;  // 0: the steps only issue work
  backend(device).synchronize(device);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const int64_t timed = f.steps - f.warmup, psi = model.num_parameters();
  const double tokens_per_s = static_cast<double>(timed * f.batch * f.seq) / seconds;
  const double flops_per_token = 6.0 * static_cast<double>(psi) + 12.0 * static_cast<double>(p.layers * p.embd * f.seq);
  const std::string description = bench::describe_device(device);
  const double peak = f.peak_tflops > 0 ? f.peak_tflops : peak_tflops_of(description);
  const double mfu = peak > 0 ? tokens_per_s * flops_per_token / (peak * 1e12) : 0.0;
  const MemoryStats mem = memory_stats(device), host = host_memory_stats();
  std::vector<double> loss_values;
  for (const Tensor& l : losses) loss_values.push_back(l.item<double>());

  if (f.json) {
    std::printf("{\"impl\": \"zerograd\", \"model\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", \"batch\": %lld, "
                "\"seq\": %lld, \"stage\": %lld, \"offload\": \"%s\", \"offload_schedule\": \"%s\", \"checkpointing\": %s, \"params\": %lld, \"steps\": %lld, \"timed_steps\": %lld, \"ms_per_step\": %.3f, "
                "\"tokens_per_s\": %.1f, \"flops_per_token\": %.0f, \"mfu\": %.4f, \"peak_allocated\": %lld, "
                "\"peak_parameter\": %lld, \"peak_gradient\": %lld, \"peak_optimizer_state\": %lld, "
                "\"peak_activation\": %lld, \"reserved\": %lld, \"host_peak\": %lld, \"host_waits_in_steps\": %lld, \"host_issue_ms\": %.3f, "
                "\"losses\": [",
                f.model.c_str(), description.c_str(), f.dtype.c_str(), static_cast<long long>(f.batch),
                static_cast<long long>(f.seq), static_cast<long long>(zero.stage), f.offload.c_str(),
                bench::name(f.schedule), f.checkpointing ? "true" : "false", static_cast<long long>(psi), static_cast<long long>(f.steps),
                static_cast<long long>(timed), 1e3 * seconds / static_cast<double>(timed), tokens_per_s,
                flops_per_token, mfu, static_cast<long long>(mem.peak_total),
                static_cast<long long>(mem.peak_of(MemoryCategory::parameter)),
                static_cast<long long>(mem.peak_of(MemoryCategory::gradient)),
                static_cast<long long>(mem.peak_of(MemoryCategory::optimizer_state)),
                static_cast<long long>(mem.peak_of(MemoryCategory::activation)),
                static_cast<long long>(mem.peak_reserved), static_cast<long long>(host.peak_total),
                static_cast<long long>(waits_in_steps), 1e3 * issue_seconds);
    for (size_t i = 0; i < loss_values.size(); ++i) std::printf("%s%.6f", i ? ", " : "", loss_values[i]);
    std::printf("]}\n");
    return 0;
  }
  auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
  std::printf("zerograd train_step: GPT %s (%lld parameters), batch %lld x %lld tokens, %s compute, on %s; %s%s\n",
              f.model.c_str(), static_cast<long long>(psi), static_cast<long long>(f.batch),
              static_cast<long long>(f.seq), f.dtype.c_str(), description.c_str(), trainer.describe().c_str(),
              f.checkpointing ? ", activation checkpointing" : "");
  for (size_t i = 0; i < loss_values.size(); ++i)
    std::printf("step %3zu  loss %.6f%s\n", i + 1, loss_values[i], static_cast<int64_t>(i) < f.warmup ? "  (warm-up)" : "");
  std::printf("%.2f ms/step, %.0f tokens/s over %lld timed steps (the host waited for the GPU %lld times in them)\n",
              1e3 * seconds / static_cast<double>(timed), tokens_per_s, static_cast<long long>(timed),
              static_cast<long long>(waits_in_steps));
  std::printf("the host issued the first timed step in %.2f ms%s\n", 1e3 * issue_seconds,
              device.type == DeviceType::cuda ? " (its own time: the GPU was idle when it began)" : "");
  std::printf("flops/token = 6*%lld + 12*%lld*%lld*%lld = %.4g", static_cast<long long>(psi),
              static_cast<long long>(p.layers), static_cast<long long>(p.embd), static_cast<long long>(f.seq),
              flops_per_token);
  if (peak > 0) std::printf("; MFU %.1f%% of %.1f TFLOP/s", 100.0 * mfu, peak);
  std::printf("\npeak memory (MiB): parameter %.1f, gradient %.1f, optimizer_state %.1f, activation %.1f; "
              "peak allocated %.1f, reserved %.1f\n",
              mib(mem.peak_of(MemoryCategory::parameter)), mib(mem.peak_of(MemoryCategory::gradient)),
              mib(mem.peak_of(MemoryCategory::optimizer_state)), mib(mem.peak_of(MemoryCategory::activation)),
              mib(mem.peak_total), mib(mem.peak_reserved));
  if (offload != dist::Offload::none) {
    std::printf("the CPU AdamW ran %s\n", bench::name(f.schedule));
    std::printf("host (offloaded) peak %.1f MiB: parameter %.1f, gradient %.1f, optimizer_state %.1f\n",
                mib(host.peak_total), mib(host.peak_of(MemoryCategory::parameter)),
                mib(host.peak_of(MemoryCategory::gradient)), mib(host.peak_of(MemoryCategory::optimizer_state)));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags;
    if (!parse(argc, argv, flags)) {
      usage();
      return 0;
    }
    return run(flags);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
