// zero_memory: per-rank memory and traffic of DDP and ZeRO-1/2/3 for a GPT, next
// to the ZeRO paper's formulas (Rajbhandari et al. 2020, fig. 1 and section 7):
//   model states  stage 0: 16Ψ   1: 4Ψ + 12Ψ/N   2: 2Ψ + 14Ψ/N   3: 16Ψ/N    (bytes, bf16 + fp32 Adam)
//   traffic       stages 0-2: 2Ψ elements per step, stage 3: 3Ψ, each element 2 bytes (4 with --compute f32),
//                 counted as a ring moves data ((N-1)/N per reduce-scatter or all-gather).
//
// --offload optimizer | optimizer+params | all (ZeRO-Offload; ZeRO-Infinity's CPU tier)
// moves roles into the rank's host pool, counted in host columns apart from the
// device's; the formulas (ZeRO-Offload paper, Ren et al. 2021, and placement.h): the
// host holds 14Ψ/N (f32 master, m, v and the 16-bit gradient shard; at optimizer+params
// the f32 master doubles as the parameter shard, cast per gather), the device keeps
// the compute weights (2Ψ, or 2Ψ/N at stage 3; none at optimizer+params) and, at stage
// 1, the full gradient (2Ψ).
// --shard-group S (stages 2, 3): hybrid sharding -- shards within groups of S ranks,
// replicas across the N / S groups: model states follow the formulas with S for N,
// traffic splits into the stage's within its group (with S) and the gradient shard's
// all-reduce across the groups, 2 (R-1)/R x Ψ/S elements (R = N / S).
// --largest-on GB: for each offload setting, the largest GPT-3-family model whose dry
// run (one rank, activation checkpointing, batch 1 x 1024) peaks within GB of device memory.
// --simulate: the step-time model (dist/comm/step_model.h) replays each dry run's kernels
// and collectives on a machine of given rates (H100 nodes unless flags say otherwise:
// --tflops, --memory-gbps, --kernel-us, --ranks-per-node, --intra-gbps/-us, --inter-gbps/-us)
// for every N of --world-size (a list: 8,64,1024): step time, compute, exposed communication.
// --calibrate: this machine's rates for those flags (a matrix product, a memory-bound add,
// an empty kernel; under mpirun also the mpi group's latency and bandwidth).
//
// --device meta (default): a dry run of rank 0 with a fake group -- real code paths,
// counted bytes, nothing allocated -- so 7.5B parameters at N = 64 take a second. Its
// activations are a GPU's: attention keeps flash attention's row statistics.
// --device cpu | cuda: N ranks as threads of this process, real training steps: on
// the CPU or one GPU through the local group (ranks sharing the GPU, each with its
// own allocator and streams); with at least N GPUs through the nccl group, rank r on
// cuda:r (--group picks). --device auto: cuda when this build has a usable GPU, else
// cpu (what scripts/quickstart.sh runs). Under mpirun (or srun) each process is one rank
// (CPU tensors over the mpi group; CUDA over NCCL, rank r on its node's GPU r), and rank
// 0 prints every rank's record.
//
//   build/bench/zero_memory --model 7.5b --world-size 64 --stage all
//   build/bench/zero_memory --model tiny --world-size 4 --device cpu --json
//   mpirun -n 4 build/bench/zero_memory --model tiny --device cpu
//   build/bench/zero_memory --model 7.5b --world-size 1 --stage 3 --offload optimizer+params --json
//   build/bench/zero_memory --largest-on 80
//   build/bench/zero_memory --model 7.5b --world-size 64 --stage 3 --shard-group 8
//   build/bench/zero_memory --model 7.5b --stage all --simulate --world-size 8,64,512,4096
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#ifdef ZG_WITH_NCCL
#include "cuda/device.h"
#include "dist/comm/nccl_group.h"
#endif
#include "cuda/simulated_device.h"
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/comm/step_model.h"
#include "dist/zero/sharded_model.h"
#include "nn/gpt.h"
#include "tensor/atomic_file.h"
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
// The GPT-3 paper's shapes (Brown et al. 2020, table 2.1) and a few between them, for
// --largest-on: increasing in size.
const std::vector<Preset> kLadder = {
    {"gpt3-1.3b", gpt(24, 16, 2048)},  {"gpt3-2.7b", gpt(32, 32, 2560)}, {"4b", gpt(36, 24, 3072)},
    {"gpt3-6.7b", gpt(32, 32, 4096)},  {"10b", gpt(48, 32, 4096)},       {"gpt3-13b", gpt(40, 40, 5120)},
    {"20b", gpt(44, 48, 6144)},        {"30b", gpt(48, 56, 7168)},       {"45b", gpt(56, 64, 8192)},
    {"65b", gpt(80, 64, 8192)},        {"100b", gpt(80, 80, 10240)},     {"gpt3-175b", gpt(96, 96, 12288)},
    {"240b", gpt(112, 104, 13312)},    {"340b", gpt(128, 116, 14848)},   {"530b", gpt(105, 160, 20480)}};

struct Record {
  std::string group;  // the process group's kind
  int stage = 0, world_size = 1, rank = 0, shard_group = 0;  // shard_group: S (hybrid), else N
  dist::Offload offload = dist::Offload::none;
  int64_t params = 0, parameter = 0, gradient = 0, optimizer_state = 0, activation = 0, communication = 0,
          peak_allocated = 0, reserved = 0, sent_per_step = 0, formula_states = 0, formula_sent = 0,
          construction_peak = 0,  // the most this rank held while the sharded model was built
          sent_across = 0, formula_sent_across = 0;  // hybrid: of sent_per_step, what went to the other groups
  // The host pool (offload), after backward as the device's; its peak over the steps.
  int64_t host_parameter = 0, host_gradient = 0, host_optimizer_state = 0, host_peak = 0, formula_host = 0;
};

// The formulas, read off the placement policy: each role's bytes per parameter (2
// compute, 2 gradient, 12 master + Adam), divided by N where the role is sharded, on
// the device or (offload) the host. An offloaded gradient keeps only its shard, on the
// host; the device's full one (stage 1) stays. Parameter offload: the master is the shard.
// --accumulate f32 (stages 2, 3): the gradient shard takes 4 bytes a parameter, not 2.
std::optional<DType> g_accumulate;
int g_shard_group = 0;  // --shard-group: 0, the whole group
int64_t g_prefetch_bytes = 0;                 // --prefetch-bytes (ZeRO-3)
std::vector<std::string> g_keep_after_forward;  // --keep-after-forward (ZeRO-3)
DType g_compute = DType::bf16;                  // --compute
bool g_caching = false;                         // --caching (meta)
struct Formula {
  int64_t device = 0, host = 0;
};
// --compute f32: the compute weights are the f32 master (4 + 4 + 8 bytes: no separate copy).
Formula formula_states(int stage, dist::Offload offload, int64_t psi, int n) {
  const int64_t compute = element_size(g_compute), optimizer = compute == 4 ? 8 : 12;
  const int64_t shard_bytes = stage >= 2 && g_accumulate ? element_size(*g_accumulate) : compute;
  const dist::Placement placement = dist::Placement::for_stage(stage, offload);
  const auto bytes = [&](const dist::RolePlacement& role, int64_t per_param) {
    return role.layout == dist::Layout::sharded ? per_param * psi / n : per_param * psi;
  };
  Formula f;
  if (!placement.offloads_parameters()) f.device += bytes(placement.compute, compute);
  if (placement.offloads_optimizer()) {
    f.host += (12 + shard_bytes) * psi / n;
    if (placement.gradients.layout == dist::Layout::full) f.device += 2 * psi;
  } else {
    f.device += bytes(placement.gradients, placement.gradients.layout == dist::Layout::sharded ? shard_bytes : compute) +
                bytes(placement.optimizer_state, optimizer);
  }
  return f;
}

// Elements sent per step within a shard group of n: gradients reduced once (2Ψ: a
// reduce-scatter and an all-gather, or an all-reduce), and at ZeRO-3 the weights gathered
// twice instead of once (3Ψ); each of the compute dtype.
int64_t formula_sent(int stage, int64_t psi, int n) {
  const double elements = dist::Placement::for_stage(stage).gathers_parameters() ? 3.0 * psi : 2.0 * psi;
  return static_cast<int64_t>(elements * static_cast<double>(element_size(g_compute)) * (n - 1) / n);
}
// Hybrid sharding, across r groups of s: the all-reduce of each gradient shard, Ψ/s elements.
int64_t formula_sent_across(int64_t psi, int s, int r) {
  return static_cast<int64_t>(2.0 * (r - 1) / r * static_cast<double>(psi) / s * static_cast<double>(element_size(g_compute)));
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
  for (int stage : stages) states = std::max(states, formula_states(stage, dist::Offload::none, psi, world).device);
  const int64_t available = available_host_bytes();
  ZG_CHECK(states <= available / world, "zero_memory: ", world, " ranks of the ", preset.name,
           " model on the cpu need at least ", format_bytes(states), " of host memory each (their model states); ",
           format_bytes(available), " is available. --device meta gives the figures without allocating them");
}

// --timeline: one recording of every rank's steps (ranks may be threads: rank 0 starts
// and ends it, between barriers).
struct TimelineRun {
  MemoryTimeline timeline;
  std::optional<MemoryTimelineRecording> recording;
};

// Training steps on this rank; returns the record read after the last. With `log`, the
// last step's kernels and collectives are recorded into it (a dry run: --simulate); with
// `run`, every allocation of the steps into its timeline.
Record measure(const nn::GPTConfig& config, int stage, dist::Offload offload, int steps, int64_t batch, int64_t seq,
               Device device, dist::ProcessGroup& group, StepLog* log = nullptr, TimelineRun* run = nullptr) {
  manual_seed(1);
  // Built already sharded: constructed without memory, each rank materialising its units.
  std::optional<nn::GPT> deferred;
  {
    DeferredInit nothing_allocated;
    deferred.emplace(config, TensorOptions(DType::f32).device(device));
  }
  nn::GPT& model = *deferred;
  Context& context = Context::current();
  const Device host = device.type == DeviceType::meta ? kMeta : kCPU;  // where the host pool counts
  context.allocator(device)->reset_peaks();
  dist::ShardedModel sharded(model, group,
                             {.stage = stage, .compute_dtype = g_compute, .max_grad_norm = 1.0,
                              .accumulate_dtype = stage >= 2 ? g_accumulate : std::nullopt, .offload = offload,
                              .keep_after_forward = stage == 3 ? g_keep_after_forward : std::vector<std::string>{},
                              .prefetch_bytes = g_prefetch_bytes, .shard_group_size = g_shard_group});
  dist::ProcessGroup* replicas = sharded.replica_group();  // hybrid sharding's other groups, or null
  const int64_t construction_peak = context.memory_stats(device).peak_total;
  context.allocator(device)->reset_peaks();
  context.host_allocator(host)->reset_peaks();
  if (run) {
    group.barrier();
    if (group.rank() == 0) run->recording.emplace(run->timeline);
    group.barrier();
  }
  const TensorOptions ids = TensorOptions(DType::i64).device(device);
  const Tensor x = zeros({batch, seq}, ids), y = zeros({batch, seq}, ids);
  Record r{.group = group.kind(), .stage = stage, .world_size = group.size(), .rank = group.rank(),
           .shard_group = sharded.shard_group().size(), .offload = offload, .params = sharded.num_parameters(),
           .construction_peak = construction_peak};
  for (int s = 0; s < steps; ++s) {
    std::optional<StepLogScope> recording;
    if (log != nullptr && s == steps - 1) {
      log->clear();
      recording.emplace(*log);
    }
    group.reset_bytes_sent();
    sharded.shard_group().reset_bytes_sent();  // (the group itself, without hybrid sharding)
    if (replicas) replicas->reset_bytes_sent();
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
    const MemoryStats host_after_backward = context.host_memory_stats(host);
    r.host_parameter = host_after_backward[MemoryCategory::parameter];
    r.host_gradient = host_after_backward[MemoryCategory::gradient];
    r.host_optimizer_state = host_after_backward[MemoryCategory::optimizer_state];
    sharded.step(1e-4);
    r.sent_across = replicas ? replicas->bytes_sent() : 0;
    r.sent_per_step = group.bytes_sent() + (replicas ? sharded.shard_group().bytes_sent() + r.sent_across : 0);
  }
  if (run) {
    group.barrier();
    if (group.rank() == 0) run->recording.reset();
  }
  const MemoryStats s = context.memory_stats(device);
  r.activation = s.peak_of(MemoryCategory::activation);
  r.communication = s.peak_of(MemoryCategory::communication);
  r.peak_allocated = s.peak_total;
  r.reserved = s.peak_reserved;
  r.host_peak = context.host_memory_stats(host).peak_total;
  // With hybrid sharding the formulas hold with S for N, plus the traffic across groups.
  const Formula formula = formula_states(stage, offload, r.params, r.shard_group);
  r.formula_states = formula.device;
  r.formula_host = formula.host;
  r.formula_sent_across = formula_sent_across(r.params, r.shard_group, r.world_size / r.shard_group);
  r.formula_sent = formula_sent(stage, r.params, r.shard_group) + r.formula_sent_across;
  return r;
}

// Every rank's records, on every rank: their numbers all-gathered over `host` (a CPU group).
// The group's kind is the one the ranks measured with, the same on all.
std::vector<Record> all_records(dist::ProcessGroup& host, const std::vector<Record>& mine) {
  static constexpr int Record::*kInts[] = {&Record::stage, &Record::world_size, &Record::rank, &Record::shard_group};
  static constexpr int64_t Record::*kInt64s[] = {
      &Record::params, &Record::parameter, &Record::gradient, &Record::optimizer_state, &Record::activation,
      &Record::communication, &Record::peak_allocated, &Record::reserved, &Record::sent_per_step,
      &Record::formula_states, &Record::formula_sent, &Record::construction_peak, &Record::sent_across,
      &Record::formula_sent_across, &Record::host_parameter, &Record::host_gradient, &Record::host_optimizer_state,
      &Record::host_peak, &Record::formula_host};
  constexpr size_t kFields = std::size(kInts) + std::size(kInt64s) + 1;  // + the offload
  std::vector<int64_t> packed;
  for (const Record& r : mine) {
    for (auto field : kInts) packed.push_back(r.*field);
    for (auto field : kInt64s) packed.push_back(r.*field);
    packed.push_back(static_cast<int64_t>(r.offload));
  }
  const Tensor everyone = empty({static_cast<int64_t>(packed.size()) * host.size()}, DType::i64);
  host.all_gather(tensor<int64_t>(packed), everyone);
  const std::vector<int64_t> values = everyone.to_vector<int64_t>();
  std::vector<Record> out;
  for (size_t at = 0; at < values.size(); at += kFields) {
    Record r{.group = mine.front().group};
    size_t i = at;
    for (auto field : kInts) r.*field = static_cast<int>(values[i++]);
    for (auto field : kInt64s) r.*field = values[i++];
    r.offload = static_cast<dist::Offload>(values[i]);
    out.push_back(r);
  }
  return out;
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

// --largest-on: for each offload setting (at the stage that gains most from it), the
// largest model of kLadder whose one-rank dry run peaks within `device_bytes`: ZeRO-3 at
// N = 1 shards nothing but gathers per unit, so its figures are the offloaded ones'.
int largest_trainable(double device_bytes) {
  struct Setting {
    int stage;
    dist::Offload offload;
    const char* paper;  // the device bytes a parameter, as the papers count them
  };
  const Setting settings[] = {{0, dist::Offload::none, "16 (DDP; ZeRO paper)"},
                              {2, dist::Offload::optimizer, "2 (ZeRO-Offload: fp16 weights)"},
                              {3, dist::Offload::optimizer, "2 (weights, a unit gathered at a time)"},
                              {3, dist::Offload::optimizer_and_params, "0 (ZeRO-Infinity: units in use)"}};
  std::printf("The largest GPT whose one-rank step fits %.0f GB of device memory (dry run on meta: bf16 compute,\n"
              "fp32 AdamW, activation checkpointing, batch 1 x 1024 tokens; peak = every byte allocated at once;\n"
              "a + after the name: the last model tried, a larger one may fit)\n\n",
              device_bytes / 1e9);
  std::printf("%-7s %-16s %-11s %8s %12s %12s %9s  %s\n", "stage", "offload", "model", "Ψ (B)", "device peak",
              "host states", "host/Ψ", "device bytes a parameter, paper");
  for (const Setting& setting : settings) {
    const Preset* fits = nullptr;
    Record best;
    for (const Preset& preset : kLadder) {
      nn::GPTConfig config = preset.config;
      config.activation_checkpointing = true;
      Context rank0(0);
      ContextGuard guard(rank0);
      dist::FakeGroup group(0, 1);
      const Record r = measure(config, setting.stage, setting.offload, 1, 1, 1024, kMeta, group);
      if (static_cast<double>(r.peak_allocated) > device_bytes) break;
      fits = &preset;
      best = r;
    }
    const int64_t host = best.host_parameter + best.host_gradient + best.host_optimizer_state;
    if (!fits) {
      std::printf("%-7d %-16s %-11s\n", setting.stage, dist::name(setting.offload), "none fits");
      continue;
    }
    std::printf("%-7d %-16s %-11s %8.1f %9.1f GB %9.1f GB %9.1f  %s\n", setting.stage, dist::name(setting.offload),
                (std::string(fits->name) + (fits == &kLadder.back() ? "+" : "")).c_str(),
                static_cast<double>(best.params) / 1e9, static_cast<double>(best.peak_allocated) / 1e9,
                static_cast<double>(host) / 1e9, static_cast<double>(host) / static_cast<double>(best.params),
                setting.paper);
  }
  return 0;
}

// --simulate: for each N and setting, rank 0's dry run (its second step, recorded)
// replayed by the step-time model.
int simulate(const Preset& preset, const std::vector<std::pair<int, dist::Offload>>& settings,
             const std::vector<int>& worlds, int64_t batch, int64_t seq, const dist::Machine& machine, bool json) {
  for (const auto& [stage, offload] : settings)
    ZG_CHECK(offload == dist::Offload::none, "zero_memory: --simulate models the device's step; offload's host "
             "AdamW and copies are not in the model (leave --offload out)");
  if (!json) {
    std::printf("GPT %s, batch %lld x %lld tokens a rank, bf16 compute + fp32 AdamW; the step-time model "
                "(dist/comm/step_model.h) on\n%s\n\n",
                preset.name, static_cast<long long>(batch), static_cast<long long>(seq), machine.describe().c_str());
    std::printf("%5s %6s %5s %11s %11s %11s %11s %14s\n", "stage", "N", "S", "step ms", "compute ms", "comm ms",
                "exposed ms", "tokens/s");
  } else {
    std::printf("[\n");
  }
  bool first = true;
  for (int world : worlds)
    for (const auto& [stage, offload] : settings) {
      Context rank0(0);
      ContextGuard guard(rank0);
      dist::FakeGroup group(0, world);
      StepLog log;
      const Record r = measure(preset.config, stage, offload, 2, batch, seq, kMeta, group, &log);
      const dist::StepTime t = dist::predict(log, machine);
      const double tokens = static_cast<double>(batch * seq) * world / t.step;
      if (json)
        std::printf("%s  {\"model\": \"%s\", \"stage\": %d, \"world_size\": %d, \"shard_group\": %d, "
                    "\"step_seconds\": %.6g, \"compute_seconds\": %.6g, \"communication_seconds\": %.6g, "
                    "\"exposed_seconds\": %.6g, \"tokens_per_second\": %.6g}",
                    first ? "" : ",\n", preset.name, stage, world, r.shard_group, t.step, t.compute, t.communication,
                    t.exposed, tokens);
      else
        std::printf("%5d %6d %5d %11.2f %11.2f %11.2f %11.2f %14.0f\n", stage, world, r.shard_group, t.step * 1e3,
                    t.compute * 1e3, t.communication * 1e3, t.exposed * 1e3, tokens);
      first = false;
    }
  if (json) std::printf("\n]\n");
  return 0;
}

// Seconds a call of fn takes: the median of `reps` after a warm-up (as a run's steps are
// read: the median, noise included).
template <class Fn>
double seconds_per_call(int reps, Fn&& fn) {
  fn();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + reps / 2, times.end());
  return times[reps / 2];
}

// --calibrate: this machine's rates, as the flags --simulate takes. Compute: a bf16 matrix
// product of the model's MLP shape (rows = batch x seq), a memory-bound add, an empty
// add's cost -- then all three scaled alike so that the model's compute for a one-rank
// step equals a real one-rank step of this model here (what the kernels' FLOPs and bytes
// do not say: unfused CPU kernels, conversions, allocation). Under mpirun (every rank
// measuring at once, as they would train): also the mpi group's latency (an all-reduce
// of one float) and bandwidth (of 4M floats), every rank counted as on one node.
void calibrate(const Preset& preset, int64_t batch, int64_t seq, dist::ProcessGroup* group) {
  dist::Machine rates;
  {
    NoGradGuard no_grad;
    const int64_t rows = batch * seq, width = preset.config.n_embd;
    const TensorOptions bf16 = TensorOptions(DType::bf16);
    const Tensor x = randn({rows, width}).to(DType::bf16), w = randn({width, 4 * width}).to(DType::bf16);
    rates.flops_per_second = 2.0 * rows * width * 4 * width / seconds_per_call(10, [&] { matmul(x, w); });
    const Tensor big = zeros({int64_t(1) << 22}, bf16), one = zeros({1}, bf16);
    rates.memory_bytes_per_second = 3.0 * big.nbytes() / seconds_per_call(10, [&] { big + big; });
    rates.kernel_seconds = seconds_per_call(200, [&] { one + one; });
  }
  // A real one-rank step, and the model's compute for the same step from its dry run.
  double real_step = 0;
  {
    manual_seed(1);
    nn::GPT model(preset.config);
    dist::SingleRank one;
    dist::ShardedModel sharded(model, one, {.compute_dtype = DType::bf16});
    const Tensor ids = zeros({batch, seq}, DType::i64);
    real_step = seconds_per_call(5, [&] {
      sharded.zero_grad();
      model.forward(ids, ids).loss.backward();
      sharded.step(1e-4);
    });
  }
  StepLog log;
  {
    Context rank0(0);
    ContextGuard guard(rank0);
    dist::FakeGroup one(0, 1);
    measure(preset.config, 0, dist::Offload::none, 2, batch, seq, kMeta, one, &log);
  }
  const double scale = real_step / dist::predict(log, rates).compute;
  std::string flags = "--tflops " + std::to_string(rates.flops_per_second / scale / 1e12) + " --memory-gbps " +
                      std::to_string(rates.memory_bytes_per_second / scale / 1e9) + " --kernel-us " +
                      std::to_string(rates.kernel_seconds * scale * 1e6);
  if (group != nullptr && group->size() > 1) {
    const int n = group->size();
    Tensor scalar = zeros({1}), large = zeros({int64_t(1) << 22});
    const double latency = seconds_per_call(200, [&] { group->all_reduce(scalar); }) / (2.0 * (n - 1));
    const double bulk = seconds_per_call(5, [&] { group->all_reduce(large); });
    const double sent = 2.0 * (n - 1) / n * static_cast<double>(large.nbytes());
    flags += " --ranks-per-node " + std::to_string(n) + " --intra-gbps " +
             std::to_string(sent / std::max(bulk - 2.0 * (n - 1) * latency, 1e-9) / 1e9) + " --intra-us " +
             std::to_string(latency * 1e6);
  }
  if (group == nullptr || group->rank() == 0) std::printf("%s\n", flags.c_str());
}

// --timeline DIR: each setting's trace (Perfetto / chrome://tracing) and figure, named
// after it (stage-2.json, stage-3-offload-optimizer.svg), and every setting's rank 0 on
// one scale in all.svg. The dashed levels: the formula's model states (and host states).
std::string setting_name(int stage, dist::Offload offload) {
  std::string out = "stage-" + std::to_string(stage);
  if (offload != dist::Offload::none) out += std::string("-offload-") + dist::name(offload);
  for (char& c : out) c = c == '+' ? '-' : c;
  return out;
}
std::string setting_title(int stage, dist::Offload offload) {
  std::string out = stage == 0 ? "DDP" : "ZeRO-" + std::to_string(stage);
  if (offload != dist::Offload::none) out += std::string(", offload ") + dist::name(offload);
  return out;
}
// Writes the setting's trace and figure; returns its panel.
MemoryPanel write_timeline(const std::string& dir, const TimelineRun& run, const Record& r, Device device,
                           const std::string& what) {
  const std::string base = dir + "/" + setting_name(r.stage, r.offload);
  std::vector<MemoryLevel> levels = {{"formula", r.formula_states}};
  if (r.offload != dist::Offload::none) levels.push_back({"host formula", r.formula_host});
  const std::string trace = chrome_trace_json(run.timeline, levels);
  write_file_atomically(base + ".json", trace, "zero_memory --timeline");
  MemoryPanel panel{setting_title(r.stage, r.offload), memory_series(trace, 0, device.str()), levels, g_caching};
  write_file_atomically(base + ".svg", memory_figure_svg({panel}, setting_title(r.stage, r.offload) + ": " + what),
                        "zero_memory --timeline");
  return panel;
}

void usage() {
  std::printf(
      "usage: zero_memory [--model tiny|124m|350m|1.5b|7.5b] [--world-size N] [--stage 0|1|2|3|all]\n"
      "                   [--device meta|cpu|cuda|auto] [--group auto|local|nccl] [--steps K] [--batch B]\n"
      "                   [--seq T] [--offload none|optimizer|optimizer+params|all] [--accumulate bf16|f32]\n"
      "                   [--shard-group S] [--prefetch-bytes B] [--keep-after-forward U,U|*] [--json]\n"
      "                   [--compute bf16|f32] [--checkpointing] [--caching] [--timeline DIR]\n"
      "       zero_memory --simulate [--world-size N,N,...] [--tflops X] [--memory-gbps X] [--kernel-us X]\n"
      "                   [--ranks-per-node G] [--intra-gbps X] [--intra-us X] [--inter-gbps X] [--inter-us X]\n"
      "       zero_memory --calibrate [--model M] [--batch B] [--seq T]   (under mpirun: the network too)\n"
      "       zero_memory --largest-on GB\n"
      "A preset's shape changes with --layers L --heads H --embd C --vocab V.\n"
      "Per-rank memory by category and bytes sent per step for DDP and ZeRO-1/2/3, next to the ZeRO\n"
      "paper's formulas. meta (default): rank 0 of N with a fake group, nothing allocated, activations\n"
      "as a GPU keeps them (flash attention);\n"
      "cpu / cuda: N ranks as threads, real steps, through the local group (sharing one GPU) or, with\n"
      "N GPUs, nccl (--group auto picks nccl then); --device auto: cuda if usable, else cpu.\n"
      "--model defaults to 124m (tiny on the cpu). --accumulate f32: stages 2-3 sum micro-batches in an f32\n"
      "gradient shard. --offload: roles in host memory (all: every setting\n"
      "each stage allows). --largest-on GB: per offload setting, the largest GPT whose one-rank dry run\n"
      "(activation checkpointing, batch 1 x 1024) peaks within GB of device memory. --shard-group S\n"
      "(stages 2, 3): hybrid sharding, shards within groups of S ranks, replicas across N / S groups.\n"
      "--compute: the dtype of the forward and backward (bf16 default; master weights and Adam stay f32).\n"
      "--checkpointing: each block's activations recomputed in backward instead of kept.\n"
      "--caching (meta): through the GPU's caching allocator over a simulated device: reserved bytes as\n"
      "a GPU's cache would hold them (segments, 512 B rounding, freed blocks kept for reuse).\n"
      "--timeline DIR: every allocation of the steps, per setting a trace for ui.perfetto.dev\n"
      "(stage-S.json) and a figure (stage-S.svg); all.svg puts rank 0 of each on one scale.\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name, stage_arg = "all", device_arg = "meta", group_arg = "auto", offload_arg = "none";
  double largest_on = 0;
  int world = 0, steps = 1;  // world 0: unset (4; under mpirun, its processes)
  std::vector<int> worlds;   // --world-size's list (--simulate runs each)
  int64_t layers = 0, heads = 0, embd = 0, vocab = 0;  // a shape of one's own over the preset's (0: the preset's)
  bool simulate_step = false, calibrate_rates = false;
  dist::Machine machine;
  int64_t batch = 1, seq = 0;
  bool json = false;
  std::string timeline_dir;
  bool checkpointing = false;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        ZG_CHECK(i + 1 < argc, "zero_memory: ", a, " needs a value");
        return argv[++i];
      };
      auto words = [](const std::string& list) {  // a comma-separated list
        std::vector<std::string> out;
        for (size_t at = 0; at <= list.size();) {
          const size_t comma = std::min(list.find(',', at), list.size());
          out.push_back(list.substr(at, comma - at));
          at = comma + 1;
        }
        return out;
      };
      auto rate = [&](double unit) {  // a positive number, in `unit`s
        const std::string v = value();
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        ZG_CHECK(!v.empty() && *end == '\0' && x >= 0 && std::isfinite(x), "zero_memory: ", a,
                 " needs a number >= 0, got '", v, "'");
        return x * unit;
      };
      auto number = [&](int64_t least, int64_t most) -> int64_t {
        const std::string v = value();
        int64_t n = 0;
        ZG_CHECK(parse_number(v, n) && n >= least && n <= most, "zero_memory: ", a, " needs a whole number in [",
                 least, ", ", most, "], got '", v, "'");
        return n;
      };
      if (a == "--model") model_name = value();
      else if (a == "--world-size") {
        const std::string list = value();
        for (const std::string& word : words(list)) {
          int64_t n = 0;
          ZG_CHECK(parse_number(word, n) && n >= 1 && n <= (1 << 20),
                   "zero_memory: --world-size needs whole numbers in [1, 1048576], comma-separated, got '", list, "'");
          worlds.push_back(static_cast<int>(n));
        }
        world = worlds.front();
      }
      else if (a == "--simulate") simulate_step = true;
      else if (a == "--layers") layers = number(1, 1 << 16);
      else if (a == "--heads") heads = number(1, 1 << 16);
      else if (a == "--embd") embd = number(1, 1 << 20);
      else if (a == "--vocab") vocab = number(1, 1 << 30);
      else if (a == "--calibrate") calibrate_rates = true;
      else if (a == "--tflops") machine.flops_per_second = rate(1e12);
      else if (a == "--memory-gbps") machine.memory_bytes_per_second = rate(1e9);
      else if (a == "--kernel-us") machine.kernel_seconds = rate(1e-6);
      else if (a == "--ranks-per-node") machine.ranks_per_node = static_cast<int>(number(1, 1 << 20));
      else if (a == "--intra-gbps") machine.intra_bytes_per_second = rate(1e9);
      else if (a == "--intra-us") machine.intra_latency_seconds = rate(1e-6);
      else if (a == "--inter-gbps") machine.inter_bytes_per_second = rate(1e9);
      else if (a == "--inter-us") machine.inter_latency_seconds = rate(1e-6);
      else if (a == "--stage") stage_arg = value();
      else if (a == "--device") device_arg = value();
      else if (a == "--group") group_arg = value();
      else if (a == "--steps") steps = static_cast<int>(number(1, 1 << 20));
      else if (a == "--batch") batch = number(1, INT64_MAX);
      else if (a == "--seq") seq = number(1, INT64_MAX);
      else if (a == "--json") json = true;
      else if (a == "--timeline") timeline_dir = value();
      else if (a == "--checkpointing") checkpointing = true;
      else if (a == "--caching") g_caching = true;
      else if (a == "--compute") {
        const std::string dtype = value();
        ZG_CHECK(dtype == "bf16" || dtype == "f32", "zero_memory: --compute must be bf16 or f32, got '", dtype, "'");
        g_compute = dtype == "f32" ? DType::f32 : DType::bf16;
      }
      else if (a == "--offload") offload_arg = value();
      else if (a == "--accumulate") {
        const std::string dtype = value();
        ZG_CHECK(dtype == "bf16" || dtype == "f32", "zero_memory: --accumulate must be bf16 or f32, got '", dtype, "'");
        if (dtype == "f32") g_accumulate = DType::f32;
      }
      else if (a == "--largest-on") largest_on = static_cast<double>(number(1, 1 << 20));
      else if (a == "--shard-group") g_shard_group = static_cast<int>(number(1, 1 << 20));
      else if (a == "--prefetch-bytes") g_prefetch_bytes = number(0, INT64_MAX);
      else if (a == "--keep-after-forward") g_keep_after_forward = words(value());
      else {
        usage();
        return a == "--help" ? 0 : 2;
      }
    }
    if (largest_on > 0) return largest_trainable(largest_on * 1e9);
    // auto: the GPU when this build has a usable one (N ranks sharing it), else the CPU.
    if (device_arg == "auto") device_arg = cuda_usable() ? "cuda" : "cpu";
    // Without --model: GPT-2 124M, or the tiny GPT for real steps on the CPU.
    if (model_name.empty()) model_name = device_arg == "cpu" ? "tiny" : "124m";
    const Preset* preset = nullptr;
    for (const Preset& p : kPresets)
      if (model_name == p.name) preset = &p;
    ZG_CHECK(preset != nullptr, "zero_memory: unknown --model ", model_name, " (tiny, 124m, 350m, 1.5b, 7.5b)");
    // --layers, --heads, --embd, --vocab: the preset's shape changed (e.g. to train_zero's).
    Preset shaped = *preset;
    if (layers || heads || embd || vocab) {
      nn::GPTConfig& c = shaped.config;
      c.n_layer = layers ? layers : c.n_layer, c.n_head = heads ? heads : c.n_head;
      c.n_embd = embd ? embd : c.n_embd, c.vocab_size = vocab ? vocab : c.vocab_size;
      ZG_CHECK(c.n_embd % c.n_head == 0, "zero_memory: --embd ", c.n_embd, " is not a multiple of --heads ", c.n_head);
      model_name += "-custom";
      shaped.name = model_name.c_str();
      preset = &shaped;
    }
    ZG_CHECK(!g_caching || device_arg == "meta", "zero_memory: --caching simulates a GPU's cache in a dry run "
             "(--device meta); a real run uses its device's own allocator");
    ZG_CHECK(g_compute == DType::bf16 || offload_arg == "none", "zero_memory: --compute f32 is for runs without "
             "--offload (offload's formulas are for 16-bit compute weights beside the f32 master)");
    if (checkpointing) {
      shaped = *preset;
      shaped.config.activation_checkpointing = true;
      preset = &shaped;
    }
    if (calibrate_rates) {
      if (seq <= 0) seq = std::min<int64_t>(preset->config.block_size, 1024);
#if ZG_HAVE_MPI
      if (dist::launched_as_rank())
        return dist::run_mpi([&](dist::ProcessGroup& group) { calibrate(*preset, batch, seq, &group); });
#endif
      calibrate(*preset, batch, seq, nullptr);
      return 0;
    }
    // Under mpirun each process is a rank of a real run (the dry run stays one process).
    const bool processes = dist::launched_as_rank() && device_arg != "meta";
#if !ZG_HAVE_MPI
    ZG_CHECK(!processes, "zero_memory: started by mpirun, but this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
    if (world == 0 && !processes) world = 4;
    ZG_CHECK(processes || (world >= 1 && steps >= 1 && batch >= 1),
             "zero_memory: --world-size, --steps and --batch must be at least 1");
    std::vector<int> stages;
    if (stage_arg == "all") stages = {0, 1, 2, 3};
    else if (stage_arg.size() == 1 && stage_arg[0] >= '0' && stage_arg[0] <= '3') stages = {stage_arg[0] - '0'};
    else fail("zero_memory: --stage must be 0, 1, 2, 3 or all, got '", stage_arg, "'");
    // The (stage, offload) pairs to run: with `all` on either side, those the stage allows.
    std::vector<dist::Offload> offloads;
    if (offload_arg == "all") offloads = {dist::Offload::none, dist::Offload::optimizer, dist::Offload::optimizer_and_params};
    else offloads = {dist::parse_offload(offload_arg)};
    std::vector<std::pair<int, dist::Offload>> settings;
    for (int stage : stages)
      for (dist::Offload offload : offloads) {
        const bool allowed = (offload == dist::Offload::none || (stage >= 1 && (offload == dist::Offload::optimizer || stage == 3))) &&
                             (g_shard_group == 0 || stage >= 2);
        if (allowed || (offloads.size() == 1 && stages.size() == 1)) settings.emplace_back(stage, offload);  // else the library says why
      }
    ZG_CHECK(worlds.size() <= 1 || simulate_step, "zero_memory: a list of world sizes is for --simulate");
    ZG_CHECK(!settings.empty(), "zero_memory: no stage in --stage ", stage_arg, " allows --offload ", offload_arg,
             g_shard_group ? " with --shard-group" : "", " (optimizer: stages 1-3; optimizer+params: stage 3; "
             "--shard-group: stages 2-3)");
    ZG_CHECK(timeline_dir.empty() || (!processes && !simulate_step), "zero_memory: --timeline records the ranks of "
             "this process (--device meta, or cpu / cuda with the ranks as threads), not under mpirun or --simulate");
    if (!timeline_dir.empty()) {
      std::error_code error;
      std::filesystem::create_directories(timeline_dir, error);
      ZG_CHECK(!error && std::filesystem::is_directory(timeline_dir), "zero_memory: --timeline ", timeline_dir,
               " is not a directory that can be made: ", error ? error.message() : "a file is in the way");
    }
    if (simulate_step) {
      ZG_CHECK(device_arg == "meta" && !processes, "zero_memory: --simulate replays dry runs on the meta device; "
               "leave --device out");
      if (worlds.empty()) worlds = {world};
      if (seq <= 0) seq = std::min<int64_t>(preset->config.block_size, 1024);
      return simulate(*preset, settings, worlds, batch, seq, machine, json);
    }
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
    if (device.type == DeviceType::cpu && !processes) check_host_memory(*preset, stages, world);

    std::vector<Record> records;
    std::mutex records_mutex;
#if ZG_HAVE_MPI
    if (processes) {
      ZG_CHECK(group_arg == "auto", "zero_memory: under mpirun the group is mpi (CPU) or nccl (CUDA); leave --group out");
      int my_rank = 0;
      const int status = dist::run_mpi([&](dist::ProcessGroup& host) {
        ZG_CHECK(world == 0 || world == host.size(), "zero_memory: --world-size ", world, " but mpirun started ",
                 host.size(), " processes");
        world = host.size(), my_rank = host.rank();
        std::unique_ptr<dist::ProcessGroup> nccl;  // CUDA: rank r on its node's GPU r, the id sent over MPI
        Device mine = device;
        if (device.type == DeviceType::cuda) {
#ifdef ZG_WITH_NCCL
          mine = Device(DeviceType::cuda, dist::node_local_rank(host.rank()));
          nccl = dist::NcclGroup::bootstrap(host, mine);
#else
          fail("zero_memory: --device cuda under mpirun needs a build with CUDA (the nccl group)");
#endif
        }
        std::vector<Record> measured;
        for (const auto& [stage, offload] : settings)
          measured.push_back(measure(preset->config, stage, offload, steps, batch, seq, mine, nccl ? *nccl : host));
        records = all_records(host, measured);
      });
      if (status != 0 || my_rank != 0) return status;  // rank 0 prints
    }
#endif
    std::vector<MemoryPanel> panels;  // --timeline: rank 0 of each setting
    for (const auto& [stage, offload] : settings) {
      if (processes) break;  // measured above
      std::optional<TimelineRun> run;
      if (!timeline_dir.empty()) run.emplace();
      TimelineRun* recording = run ? &*run : nullptr;
      if (device.type == DeviceType::meta) {
        Context rank0(0);
        if (g_caching) rank0.set_allocator(kMeta, cuda::simulated_caching_allocator(kMeta));
        ContextGuard guard(rank0);
        dist::FakeGroup group(0, world);
        records.push_back(measure(preset->config, stage, offload, steps, batch, seq, device, group, nullptr, recording));
      } else {
        dist::run_local(world, [&](dist::ProcessGroup& group) {
          Record r;
          if (!use_nccl) {
            r = measure(preset->config, stage, offload, steps, batch, seq, device, group, nullptr, recording);
          } else {
#ifdef ZG_WITH_NCCL
            // The local group bootstraps NCCL (the unique id); rank r runs on cuda:r.
            const Device mine(DeviceType::cuda, group.rank());
            const auto nccl = dist::NcclGroup::bootstrap(group, mine);
            r = measure(preset->config, stage, offload, steps, batch, seq, mine, *nccl, nullptr, recording);
#endif
          }
          std::lock_guard lock(records_mutex);
          records.push_back(r);
        });
      }
      if (run) {
        const Record& rank0 = *std::find_if(records.begin(), records.end(), [&](const Record& r) {
          return r.stage == stage && r.offload == offload && r.rank == 0;
        });
        const std::string what = "GPT " + model_name + ", rank 0 of " + std::to_string(world) + " on " + device.str() +
                                 ", " + name(g_compute) + " compute" +
                                 (preset->config.activation_checkpointing ? ", activation checkpointing" : "") + ", " +
                                 std::to_string(steps) + (steps == 1 ? " step" : " steps");
        panels.push_back(write_timeline(timeline_dir, *run, rank0, device, what));
        if (panels.size() == settings.size())
          write_file_atomically(timeline_dir + "/all.svg",
                                memory_figure_svg(panels, "Bytes by category, " + what + " (one scale)"),
                                "zero_memory --timeline");
      }
    }
    std::sort(records.begin(), records.end(),
              [](const Record& a, const Record& b) {
                return std::tuple(a.stage, a.offload, a.rank) < std::tuple(b.stage, b.offload, b.rank);
              });

    if (json) {
      std::printf("[\n");
      for (size_t i = 0; i < records.size(); ++i) {
        const Record& r = records[i];
        std::printf("  {\"model\": \"%s\", \"device\": \"%s\", \"group\": \"%s\", \"stage\": %d, \"world_size\": %d, \"rank\": %d, "
                    "\"params\": %lld, \"parameter\": %lld, \"gradient\": %lld, \"optimizer_state\": %lld, "
                    "\"activation\": %lld, \"communication\": %lld, \"peak_allocated\": %lld, \"reserved\": %lld, "
                    "\"sent_per_step\": %lld, \"formula_model_states\": %lld, \"formula_sent_per_step\": %lld, "
                    "\"construction_peak\": %lld, \"offload\": \"%s\", \"host_parameter\": %lld, \"host_gradient\": %lld, "
                    "\"host_optimizer_state\": %lld, \"host_peak\": %lld, \"formula_host_model_states\": %lld, "
                    "\"shard_group\": %d, \"sent_across_groups\": %lld, \"formula_sent_across_groups\": %lld}%s\n",
                    model_name.c_str(), device.str().c_str(), r.group.c_str(), r.stage, r.world_size, r.rank,
                    (long long)r.params, (long long)r.parameter, (long long)r.gradient, (long long)r.optimizer_state,
                    (long long)r.activation, (long long)r.communication, (long long)r.peak_allocated,
                    (long long)r.reserved, (long long)r.sent_per_step, (long long)r.formula_states,
                    (long long)r.formula_sent, (long long)r.construction_peak, dist::name(r.offload),
                    (long long)r.host_parameter, (long long)r.host_gradient, (long long)r.host_optimizer_state,
                    (long long)r.host_peak, (long long)r.formula_host, r.shard_group, (long long)r.sent_across,
                    (long long)r.formula_sent_across, i + 1 < records.size() ? "," : "");
      }
      std::printf("]\n");
      return 0;
    }
    std::printf("GPT %s: Ψ = %lld parameters, N = %d, %s, %s group, batch %lld x %lld tokens, %s compute + fp32 AdamW\n",
                model_name.c_str(), (long long)records.front().params, world, device.str().c_str(),
                records.front().group.c_str(), (long long)batch, (long long)seq, name(g_compute));
    if (16 * records.front().params < 1'000'000'000) g_unit = 1e6;
    std::printf("sizes in %s; model states = parameter + gradient + optimizer_state after backward; build = the\n"
                "peak while the model was built (deferred, then materialised shard by shard)\n\n",
                g_unit == 1e9 ? "GB (1e9 bytes)" : "MB (1e6 bytes)");
    // With offload, the setting and the host pool's figures follow each row.
    const bool offloading = std::any_of(records.begin(), records.end(),
                                        [](const Record& r) { return r.offload != dist::Offload::none; });
    std::printf("%5s %4s %9s %9s %9s %12s %9s %11s %9s %9s %11s %9s %9s", "stage", "rank", "param", "grad",
                "optim", "model states", "formula", "activation", "comm", "peak", "sent/step", "formula", "build");
    if (offloading) std::printf("  %-16s %11s %9s %9s", "offload", "host states", "formula", "host peak");
    const bool hybrid = g_shard_group != 0 && g_shard_group != world;
    if (hybrid) std::printf("  %5s %13s %9s", "S", "sent across", "formula");
    std::printf("\n");
    for (const Record& r : records) {
      std::printf("%5d %4d %9.3f %9.3f %9.3f %12.3f %9.3f %11.3f %9.3f %9.3f %11.3f %9.3f %9.3f", r.stage, r.rank,
                  gb(r.parameter), gb(r.gradient), gb(r.optimizer_state),
                  gb(r.parameter + r.gradient + r.optimizer_state), gb(r.formula_states), gb(r.activation),
                  gb(r.communication), gb(r.peak_allocated), gb(r.sent_per_step), gb(r.formula_sent),
                  gb(r.construction_peak));
      if (offloading)
        std::printf("  %-16s %11.3f %9.3f %9.3f", dist::name(r.offload),
                    gb(r.host_parameter + r.host_gradient + r.host_optimizer_state), gb(r.formula_host),
                    gb(r.host_peak));
      if (hybrid) std::printf("  %5d %13.3f %9.3f", r.shard_group, gb(r.sent_across), gb(r.formula_sent_across));
      std::printf("\n");
    }
    // Each unit's buffers are padded to a multiple of N: next to Ψ / N that is visible
    // only when N is close to a unit's size.
    double above = 0;
    for (const Record& r : records)
      above = std::max(above, static_cast<double>(r.parameter + r.gradient + r.optimizer_state + r.host_parameter +
                                                  r.host_gradient + r.host_optimizer_state) /
                                      static_cast<double>(std::max<int64_t>(r.formula_states + r.formula_host, 1)) - 1);
    if (above > 0.01)
      std::printf("\nmodel states are up to %.1f%% above the formula: each unit's buffers are padded to a multiple "
                  "of N = %d\n", 100 * above, world);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
