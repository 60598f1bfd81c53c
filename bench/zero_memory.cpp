// zero_memory: per-rank memory and traffic of DDP and ZeRO-1/2/3 for a GPT, next
// to the ZeRO paper's formulas (Rajbhandari et al. 2020, fig. 1 and section 7):
//   model states  stage 0: 16Ψ   1: 4Ψ + 12Ψ/N   2: 2Ψ + 14Ψ/N   3: 16Ψ/N    (bytes, bf16 + fp32 Adam)
//   traffic       stages 0-2: 2Ψ elements per step, stage 3: 3Ψ, each element 2 bytes,
//                 counted as a ring moves data ((N-1)/N per reduce-scatter or all-gather).
//
// --device meta (default): a dry run of rank 0 with a fake group -- real code paths,
// counted bytes, nothing allocated -- so 7.5B parameters at N = 64 take a second. Its
// activations are a GPU's: attention keeps flash attention's row statistics.
// --device cpu | cuda: N ranks as threads of this process, real training steps: on
// the CPU or one GPU through the local group (ranks sharing the GPU, each with its
// own allocator and streams); with at least N GPUs through the nccl group, rank r on
// cuda:r (--group picks). --device auto: cuda when this build has a usable GPU, else
// cpu (what scripts/quickstart.sh runs).
//
//   build/bench/zero_memory --model 7.5b --world-size 64 --stage all
//   build/bench/zero_memory --model tiny --world-size 4 --device cpu --json
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#ifdef ZG_WITH_NCCL
#include "cuda/device.h"
#include "dist/comm/nccl_group.h"
#endif
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/gpt.h"
#include "tensor/deferred.h"
#include "zerograd.h"

using namespace zg;

namespace {

struct Preset {
  const char* name;
  nn::GPTConfig config;
};

nn::GPTConfig gpt(int64_t layers, int64_t heads, int64_t embd, int64_t vocab = 50257, int64_t block = 1024) {
  nn::GPTConfig c;
  c.n_layer = layers, c.n_head = heads, c.n_embd = embd, c.vocab_size = vocab, c.block_size = block;
  return c;
}

// GPT-2 sizes, and a 7.5B shape for the ZeRO paper's example (Ψ = 7.5B: 36 layers of
// width 4096 with a 60,000-token vocabulary come to 7,499,636,736 parameters).
const std::vector<Preset> kPresets = {{"tiny", gpt(2, 2, 32, 64, 64)},        {"124m", gpt(12, 12, 768)},
                                      {"350m", gpt(24, 16, 1024)},            {"1.5b", gpt(48, 25, 1600)},
                                      {"7.5b", gpt(36, 32, 4096, 60000, 1024)}};

struct Record {
  std::string group;  // the process group's kind
  int stage = 0, world_size = 1, rank = 0;
  int64_t params = 0, parameter = 0, gradient = 0, optimizer_state = 0, activation = 0, communication = 0,
          peak_allocated = 0, reserved = 0, sent_per_step = 0, formula_states = 0, formula_sent = 0,
          construction_peak = 0;  // the most this rank held while the sharded model was built
};

// The paper's formulas, read off the placement policy: each role's bytes per parameter
// (2 compute, 2 gradient, 12 master + Adam), divided by N where the role is sharded.
int64_t formula_states(int stage, int64_t psi, int n) {
  const dist::Placement placement = dist::Placement::for_stage(stage);
  const auto bytes = [&](const dist::RolePlacement& role, int64_t per_param) {
    return role.layout == dist::Layout::sharded ? per_param * psi / n : per_param * psi;
  };
  return bytes(placement.compute, 2) + bytes(placement.gradients, 2) + bytes(placement.optimizer_state, 12);
}

// Elements sent per step: gradients reduced once (2Ψ: a reduce-scatter and an all-gather,
// or an all-reduce), and at ZeRO-3 the weights gathered twice instead of once (3Ψ).
int64_t formula_sent(int stage, int64_t psi, int n) {
  const double elements = dist::Placement::for_stage(stage).gathers_parameters() ? 3.0 * psi : 2.0 * psi;
  return static_cast<int64_t>(elements * 2 * (n - 1) / n);
}

// The host memory this process can still take: Linux's MemAvailable estimate, or less
// where a cgroup (a container's limit) allows less.
int64_t available_host_bytes() {
  int64_t available = int64_t(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.starts_with("MemAvailable:")) available = std::stoll(line.substr(13)) * 1024;
  int64_t limit = 0, used = 0;
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), current_file("/sys/fs/cgroup/memory.current");
  if (max_file >> limit && current_file >> used) available = std::min(available, limit - used);  // "max": no limit
  return available;
}

// Refuses a real CPU run that cannot fit, before it starts: every rank (a thread of
// this process) keeps its model states (the formula). Without this, a model too big
// for the machine initialised for minutes before the kernel killed the process.
void check_host_memory(const Preset& preset, const std::vector<int>& stages, int world) {
  const int64_t psi = nn::GPT(preset.config, kMeta).num_parameters();
  int64_t states = 0;
  for (int stage : stages) states = std::max(states, formula_states(stage, psi, world));
  const int64_t available = available_host_bytes();
  ZG_CHECK(states <= available / world, "zero_memory: ", world, " ranks of the ", preset.name,
           " model on the cpu need at least ", format_bytes(states), " of host memory each (their model states); ",
           format_bytes(available), " is available. --device meta gives the figures without allocating them");
}

// One training step on this rank; returns the record read after the step.
Record measure(const nn::GPTConfig& config, int stage, int steps, int64_t batch, int64_t seq, Device device,
               dist::ProcessGroup& group) {
  manual_seed(1);
  // Built already sharded: constructed without memory, each rank materialising its units.
  std::optional<nn::GPT> deferred;
  {
    DeferredInit nothing_allocated;
    deferred.emplace(config, TensorOptions(DType::f32).device(device));
  }
  nn::GPT& model = *deferred;
  Context& context = Context::current();
  context.allocator(device)->reset_peaks();
  dist::ShardedModel sharded(model, group, {.stage = stage, .compute_dtype = DType::bf16, .max_grad_norm = 1.0});
  const int64_t construction_peak = context.memory_stats(device).peak_total;
  context.allocator(device)->reset_peaks();
  const TensorOptions ids = TensorOptions(DType::i64).device(device);
  const Tensor x = zeros({batch, seq}, ids), y = zeros({batch, seq}, ids);
  Record r{.group = group.kind(), .stage = stage, .world_size = group.size(), .rank = group.rank(),
           .params = sharded.num_parameters(), .construction_peak = construction_peak};
  for (int s = 0; s < steps; ++s) {
    group.reset_bytes_sent();
    sharded.zero_grad();
    {
      MemoryScope scope(MemoryCategory::activation);
      const Tensor loss = model.forward(x, y).loss;  // the logits go: backward writes their gradient over them
      loss.backward();
    }
    // Model states after backward, before the step (what the formulas describe).
    const MemoryStats after_backward = context.memory_stats(device);
    r.parameter = after_backward[MemoryCategory::parameter];
    r.gradient = after_backward[MemoryCategory::gradient];
    r.optimizer_state = after_backward[MemoryCategory::optimizer_state];
    sharded.step(1e-4);
    r.sent_per_step = group.bytes_sent();
  }
  const MemoryStats s = context.memory_stats(device);
  r.activation = s.peak_of(MemoryCategory::activation);
  r.communication = s.peak_of(MemoryCategory::communication);
  r.peak_allocated = s.peak_total;
  r.reserved = s.peak_reserved;
  r.formula_states = formula_states(stage, r.params, r.world_size);
  r.formula_sent = formula_sent(stage, r.params, r.world_size);
  return r;
}

bool cuda_usable() {
  try {
    zeros({1}, kCUDA);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Tables print in GB (1e9 bytes), or MB for models whose 16Ψ is under a GB.
double g_unit = 1e9;
double gb(int64_t bytes) { return static_cast<double>(bytes) / g_unit; }

void usage() {
  std::printf(
      "usage: zero_memory [--model tiny|124m|350m|1.5b|7.5b] [--world-size N] [--stage 0|1|2|3|all]\n"
      "                   [--device meta|cpu|cuda|auto] [--group auto|local|nccl] [--steps K] [--batch B]\n"
      "                   [--seq T] [--json]\n"
      "Per-rank memory by category and bytes sent per step for DDP and ZeRO-1/2/3, next to the ZeRO\n"
      "paper's formulas. meta (default): rank 0 of N with a fake group, nothing allocated, activations\n"
      "as a GPU keeps them (flash attention);\n"
      "cpu / cuda: N ranks as threads, real steps, through the local group (sharing one GPU) or, with\n"
      "N GPUs, nccl (--group auto picks nccl then); --device auto: cuda if usable, else cpu.\n"
      "--model defaults to 124m (tiny on the cpu).\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name, stage_arg = "all", device_arg = "meta", group_arg = "auto";
  int world = 4, steps = 1;
  int64_t batch = 1, seq = 0;
  bool json = false;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        ZG_CHECK(i + 1 < argc, "zero_memory: ", a, " needs a value");
        return argv[++i];
      };
      auto number = [&](int64_t least, int64_t most) -> int64_t {
        const std::string v = value();
        int64_t n = 0;
        ZG_CHECK(parse_number(v, n) && n >= least && n <= most, "zero_memory: ", a, " needs a whole number in [",
                 least, ", ", most, "], got '", v, "'");
        return n;
      };
      if (a == "--model") model_name = value();
      else if (a == "--world-size") world = static_cast<int>(number(1, 1 << 20));
      else if (a == "--stage") stage_arg = value();
      else if (a == "--device") device_arg = value();
      else if (a == "--group") group_arg = value();
      else if (a == "--steps") steps = static_cast<int>(number(1, 1 << 20));
      else if (a == "--batch") batch = number(1, INT64_MAX);
      else if (a == "--seq") seq = number(1, INT64_MAX);
      else if (a == "--json") json = true;
      else {
        usage();
        return a == "--help" ? 0 : 2;
      }
    }
    // auto: the GPU when this build has a usable one (N ranks sharing it), else the CPU.
    if (device_arg == "auto") device_arg = cuda_usable() ? "cuda" : "cpu";
    // Without --model: GPT-2 124M, or the tiny GPT for real steps on the CPU.
    if (model_name.empty()) model_name = device_arg == "cpu" ? "tiny" : "124m";
    const Preset* preset = nullptr;
    for (const Preset& p : kPresets)
      if (model_name == p.name) preset = &p;
    ZG_CHECK(preset != nullptr, "zero_memory: unknown --model ", model_name, " (tiny, 124m, 350m, 1.5b, 7.5b)");
    ZG_CHECK(world >= 1 && steps >= 1 && batch >= 1, "zero_memory: --world-size, --steps and --batch must be at least 1");
    std::vector<int> stages;
    if (stage_arg == "all") stages = {0, 1, 2, 3};
    else if (stage_arg.size() == 1 && stage_arg[0] >= '0' && stage_arg[0] <= '3') stages = {stage_arg[0] - '0'};
    else fail("zero_memory: --stage must be 0, 1, 2, 3 or all, got '", stage_arg, "'");
    const Device device(device_arg);
    ZG_CHECK(group_arg == "auto" || group_arg == "local" || group_arg == "nccl",
             "zero_memory: --group must be auto, local or nccl, got '", group_arg, "'");
    ZG_CHECK(device.type != DeviceType::meta || group_arg == "auto", "zero_memory: --device meta runs rank 0 of a "
             "fake group (a dry run), not --group ", group_arg, "; leave --group out");
    bool use_nccl = false;
#ifdef ZG_WITH_NCCL
    const bool enough_gpus = device.type == DeviceType::cuda && cuda::device_count() >= world;
    use_nccl = group_arg == "nccl" || (group_arg == "auto" && enough_gpus);
    ZG_CHECK(!use_nccl || enough_gpus, "zero_memory: --group nccl needs --device cuda and ", world,
             " GPUs (one per rank), found ", device.type == DeviceType::cuda ? cuda::device_count() : 0);
#else
    ZG_CHECK(group_arg != "nccl", "zero_memory: --group nccl needs a build with CUDA");
#endif
    if (seq <= 0) seq = std::min<int64_t>(preset->config.block_size, 1024);
    if (device.type == DeviceType::cpu) check_host_memory(*preset, stages, world);

    std::vector<Record> records;
    std::mutex records_mutex;
    for (int stage : stages) {
      if (device.type == DeviceType::meta) {
        Context rank0(0);
        ContextGuard guard(rank0);
        dist::FakeGroup group(0, world);
        records.push_back(measure(preset->config, stage, steps, batch, seq, device, group));
      } else {
        dist::run_local(world, [&](dist::ProcessGroup& group) {
          Record r;
          if (!use_nccl) {
            r = measure(preset->config, stage, steps, batch, seq, device, group);
          } else {
#ifdef ZG_WITH_NCCL
            // The local group bootstraps NCCL (the unique id); rank r runs on cuda:r.
            const Device mine(DeviceType::cuda, group.rank());
            const auto nccl = dist::NcclGroup::bootstrap(group, mine);
            r = measure(preset->config, stage, steps, batch, seq, mine, *nccl);
#endif
          }
          std::lock_guard lock(records_mutex);
          records.push_back(r);
        });
      }
    }
    std::sort(records.begin(), records.end(),
              [](const Record& a, const Record& b) { return a.stage != b.stage ? a.stage < b.stage : a.rank < b.rank; });

    if (json) {
      std::printf("[\n");
      for (size_t i = 0; i < records.size(); ++i) {
        const Record& r = records[i];
        std::printf("  {\"model\": \"%s\", \"device\": \"%s\", \"group\": \"%s\", \"stage\": %d, \"world_size\": %d, \"rank\": %d, "
                    "\"params\": %lld, \"parameter\": %lld, \"gradient\": %lld, \"optimizer_state\": %lld, "
                    "\"activation\": %lld, \"communication\": %lld, \"peak_allocated\": %lld, \"reserved\": %lld, "
                    "\"sent_per_step\": %lld, \"formula_model_states\": %lld, \"formula_sent_per_step\": %lld, "
                    "\"construction_peak\": %lld}%s\n",
                    model_name.c_str(), device.str().c_str(), r.group.c_str(), r.stage, r.world_size, r.rank,
                    (long long)r.params, (long long)r.parameter, (long long)r.gradient, (long long)r.optimizer_state,
                    (long long)r.activation, (long long)r.communication, (long long)r.peak_allocated,
                    (long long)r.reserved, (long long)r.sent_per_step, (long long)r.formula_states,
                    (long long)r.formula_sent, (long long)r.construction_peak, i + 1 < records.size() ? "," : "");
      }
      std::printf("]\n");
      return 0;
    }
    std::printf("GPT %s: Ψ = %lld parameters, N = %d, %s, %s group, batch %lld x %lld tokens, bf16 compute + fp32 AdamW\n",
                model_name.c_str(), (long long)records.front().params, world, device.str().c_str(),
                records.front().group.c_str(), (long long)batch, (long long)seq);
    if (16 * records.front().params < 1'000'000'000) g_unit = 1e6;
    std::printf("sizes in %s; model states = parameter + gradient + optimizer_state after backward; build = the\n"
                "peak while the model was built (deferred, then materialised shard by shard)\n\n",
                g_unit == 1e9 ? "GB (1e9 bytes)" : "MB (1e6 bytes)");
    std::printf("%5s %4s %9s %9s %9s %12s %9s %11s %9s %9s %11s %9s %9s\n", "stage", "rank", "param", "grad",
                "optim", "model states", "formula", "activation", "comm", "peak", "sent/step", "formula", "build");
    for (const Record& r : records)
      std::printf("%5d %4d %9.3f %9.3f %9.3f %12.3f %9.3f %11.3f %9.3f %9.3f %11.3f %9.3f %9.3f\n", r.stage, r.rank,
                  gb(r.parameter), gb(r.gradient), gb(r.optimizer_state),
                  gb(r.parameter + r.gradient + r.optimizer_state), gb(r.formula_states), gb(r.activation),
                  gb(r.communication), gb(r.peak_allocated), gb(r.sent_per_step), gb(r.formula_sent),
                  gb(r.construction_peak));
    // Each unit's buffers are padded to a multiple of N: next to Ψ / N that is visible
    // only when N is close to a unit's size.
    double above = 0;
    for (const Record& r : records)
      above = std::max(above, static_cast<double>(r.parameter + r.gradient + r.optimizer_state) /
                                      static_cast<double>(std::max<int64_t>(r.formula_states, 1)) - 1);
    if (above > 0.01)
      std::printf("\nmodel states are up to %.1f%% above the formula: each unit's buffers are padded to a multiple "
                  "of N = %d\n", 100 * above, world);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
