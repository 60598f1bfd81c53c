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
// --offload nvme [--offload-dir DIR] (ZeRO-Infinity): the master, m, v and the gradient
// shard (at stage 3 the parameter shard too) in a file, (12 + 2)Ψ/N bytes; the host pool
// holds at most three units' state at a time (one read ahead, one in use, one written
// behind) plus, at stages 1, 2, a unit's update for the device; the dry run needs no DIR.
// --shard-group S (stages 2, 3): hybrid sharding -- shards within groups of S ranks,
// replicas across the N / S groups: model states follow the formulas with S for N,
// traffic splits into the stage's within its group (with S) and the gradient shard's
// all-reduce across the groups, 2 (R-1)/R x Ψ/S elements (R = N / S).
// --tp T: tensor parallelism (Megatron's cut, dist/tensor/parallelize.h) composed with the
// stage: N = dp x T ranks on a mesh dp_replicate x dp_shard x tp (--shard-group S divides
// dp = N / T); each rank's slices (Ψ_cut / T + Ψ_replicated parameters) sharded over the dp
// ranks by the formulas above, plus Megatron's per-layer all-reduces on the tp group and
// activations next to Korthikanti et al. 2022 (bench/tensor_parallel_formulas.h);
// --sequence-parallel cuts the activations between the cut layers along the sequence too.
// --pp P [--schedule S] [--micro-batches M] [--chunks V]: pipeline parallelism, the GPT cut
// into P x V stages (dist::gpt_stages), N = P x dp x T ranks (pp outermost); a step runs M
// micro-batches of --batch rows each in the schedule's order (dist::Pipeline). A rank's
// model states are its stages' (Ψ the stage's parameters, in the formulas too); its
// activations peak at the micro-batches the schedule keeps in flight on it (the "held" column,
// from dist::simulate), e.g. p - r under 1F1B on pp rank r. With --simulate, rank 0's step
// adds its wait for the other stages (dist::predict_pipeline, the "idle ms" column).
// --largest-on GB: for each offload setting, the largest GPT-3-family model whose dry
// run (one rank, activation checkpointing, batch 1 x 1024) peaks within GB of device memory.
// --simulate: the step-time model (dist/comm/step_model.h) replays each dry run's kernels
// and collectives on a machine of given rates (H100 nodes unless flags say otherwise:
// --tflops, --memory-gbps, --kernel-us, --ranks-per-node, --intra-gbps/-us, --inter-gbps/-us)
// for every N of --world-size (a list: 8,64,1024): step time, compute, exposed communication.
// --schedule-svg FILE draws each one's schedule, compute over communication, as a Gantt chart
// (dist/comm/step_figure.h); --bucket-bytes B sets DDP's gradient buckets (25 MiB).
// --calibrate: this machine's rates for those flags (a matrix product, a memory-bound add,
// an empty kernel; under mpirun also the mpi group's latency and bandwidth).
//
// --device meta (default): a dry run of rank 0 (--rank R: of rank R, its place in the
// mesh and its shards) with a fake group -- real code paths,
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
//   build/bench/zero_memory --model 7.5b --world-size 1 --stage 3 --offload nvme --device meta --json
//   build/bench/zero_memory --largest-on 80
//   build/bench/zero_memory --model 7.5b --world-size 64 --stage 3 --shard-group 8
//   build/bench/zero_memory --model 7.5b --world-size 64 --tp 8 --stage 1 --device meta --json
//   build/bench/zero_memory --model 7.5b --world-size 64 --pp 4 --micro-batches 8 --stage 1 --rank 0
//   build/bench/zero_memory --model 7.5b --stage all --simulate --world-size 8,64,512,4096
//   build/bench/zero_memory --stage 0,3 --simulate --world-size 64 --schedule-svg overlap.svg
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#ifdef ZG_WITH_NCCL
#include "cuda/device.h"
#include "dist/comm/nccl_group.h"
#endif
#include "cuda/simulated_device.h"
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/comm/step_figure.h"
#include "dist/comm/step_model.h"
#include "dist/pipeline/stages.h"
#include "dist/pipeline/step_time.h"
#include "dist/tensor/parallelize.h"
#include "dist/zero/sharded_model.h"
#include "dist/zero/zero_config.h"
#include "model_shape.h"
#include "offload_schedule.h"
#include "plan.h"
#include "nn/gpt.h"
#include "nn/hf_gpt2.h"
#include "nn/hf_llama.h"
#include "tensor/atomic_file.h"
#include "tensor/deferred.h"
#include "tensor_parallel_formulas.h"
#include "context_figure.h"
#include "context_parallel_formulas.h"
#include "traffic_figure.h"
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

struct LlamaPreset {
  const char* name;
  nn::LlamaConfig config;
};
const std::vector<LlamaPreset> kLlamaPresets = {{"llama3-8b", bench::llama3(32, 4096, 32, 14336)},
                                                {"llama3-70b", bench::llama3(80, 8192, 64, 28672)}};

struct Record {
  std::string group;  // the process group's kind
  int stage = 0, world_size = 1, rank = 0, shard_group = 0;  // shard_group: S (hybrid), else N
  dist::Offload offload = dist::Offload::none;
  int64_t params = 0, parameter = 0, gradient = 0, optimizer_state = 0, activation = 0, communication = 0,
          peak_allocated = 0, reserved = 0, sent_per_step = 0, formula_states = 0, formula_sent = 0,
          construction_peak = 0,  // the most this rank held while the sharded model was built
          sent_across = 0, formula_sent_across = 0;  // hybrid: of sent_per_step, what went to the other groups
  // Of sent_per_step, what stayed within this rank's node of ranks_per_node ranks and its share
  // of what left it (across_share); the formulas' without --tp or --pp.
  int ranks_per_node = 1;
  int64_t sent_within_node = 0, sent_across_nodes = 0, formula_sent_within_node = 0, formula_sent_across_nodes = 0;
  // --tp T: of sent_per_step, what went to the tensor-parallel group; activations' formulas
  // (bench/tensor_parallel_formulas.h: the step's peak, and one layer as we keep it and as the paper counts it).
  int tp = 1;
  bool sequence_parallel = false;
  int64_t sent_tp = 0, formula_sent_tp = 0, formula_activation = 0, formula_activation_layer = 0,
          paper_activation_layer = 0;
  // --cp C: of sent_per_step, what went to the context-parallel group (the attention's keys
  // and values), its formula (bench/context_parallel_formulas.h); the activations' above.
  int cp = 1;
  int64_t sent_cp = 0, formula_sent_cp = 0;
  // --pp P, --micro-batches M: this rank's pp rank, the micro-batches the schedule keeps in
  // flight on it, and what went to the pipeline group (activations and their gradients).
  int pp = 1, pp_rank = 0, micro_batches = 1, chunks = 1, held = 1;
  int64_t sent_pp = 0;
  // The host pool (offload), after backward as the device's; its peak over the steps.
  int64_t host_parameter = 0, host_gradient = 0, host_optimizer_state = 0, host_peak = 0, formula_host = 0;
  // Offload nvme: the file tier's bytes (the tensors', the file's), read and written over the steps, the formula.
  int64_t nvme_bytes = 0, nvme_file_bytes = 0, nvme_read = 0, nvme_written = 0, formula_nvme = 0, largest_shard = 0;
};

// --pp, --schedule, --micro-batches, --chunks.
struct Pipelining {
  int pp = 1, micro_batches = 1, chunks = 0;  // chunks 0: the schedule's default
  std::string schedule = "1f1b";
  bool on() const { return pp > 1 || micro_batches > 1; }
  dist::Schedule make() const {
    const dist::ScheduleKind kind = dist::parse_schedule(schedule);
    return dist::make_schedule(kind, pp, micro_batches, chunks ? chunks : kind == dist::ScheduleKind::interleaved ? 2 : 1);
  }
};

using bench::OffloadSchedule;

// The command line, parsed.
struct Options {
  std::string model_name, config_file, model_title, stage_arg = "all", device_arg = "meta", group_arg = "auto", offload_arg = "none";
  double largest_on = 0;
  int world = 0, steps = 1;  // world 0: unset (4; under mpirun, its processes)
  int tp = 1;                // --tp: the model cut over T ranks, N / T data-parallel ranks
  int cp = 1;                // --cp: each sequence cut over C ranks (--cp-variant's attention)
  dist::ContextVariant cp_variant = dist::ContextVariant::ring;
  int dry_rank = 0;          // --rank: the rank of N the meta dry run is
  // --timeline's rank: the dry run's, or rank 0 of the threads.
  int recorded_rank(Device device) const { return device.type == DeviceType::meta ? dry_rank : 0; }
  bool sequence_parallel = false;  // --sequence-parallel: and the activations between the cut layers
  bench::ModelCut cut() const { return {.tp = tp, .sp = sequence_parallel, .cp = cp, .cp_variant = cp_variant}; }
  Pipelining pipe;
  std::vector<int> worlds;   // --world-size's list (--simulate runs each)
  std::vector<OffloadSchedule> offload_schedules{OffloadSchedule::after_backward};  // --simulate runs each
  int64_t layers = 0, heads = 0, embd = 0, vocab = 0;  // a shape of one's own over the preset's (0: the preset's)
  bool simulate = false, calibrate = false, json = false, checkpointing = false, caching = false;  // caching: meta
  dist::Machine machine;
  int64_t batch = 1, seq = 0;  // seq 0: the model's block, up to 1024
  std::string timeline_dir, schedule_svg, zeropp_svg, cp_svg;
  // --plan: the cluster (--gpus, --gpus-per-node as --ranks-per-node, --gpu-memory, --peak-tflops),
  // the global batch (--global-batch), the rows printed (--top), the figure (--plan-svg).
  bool plan = false;
  bench::Cluster cluster;
  std::string global_batch = "1M-tokens", plan_svg;
  int top = 20;
  bool plan_full_runs = false;  // every micro-batch dry-run, none extended
  // What every setting's ShardedModel is given besides its stage and offload: --compute,
  // --accumulate, --shard-group (0: the whole group), --bucket-bytes, --prefetch-bytes,
  // --keep-after-forward.
  dist::ZeroConfig zero{.compute_dtype = DType::bf16, .max_grad_norm = 1.0};  // mixed precision, as the papers count
};

// A stage and an offload: one row of the table, one ShardedModel.
struct Setting {
  int stage = 0;
  dist::Offload offload = dist::Offload::none;
  bool operator==(const Setting&) const = default;
};

// The configuration a setting trains with, wherever this bench builds a ShardedModel.
dist::ZeroConfig zero_config(const Options& o, Setting setting,
                             OffloadSchedule schedule = OffloadSchedule::after_backward) {
  dist::ZeroConfig zero = o.zero;
  zero.stage = setting.stage, zero.offload = setting.offload;
  return bench::with_schedule(zero, schedule);
}

// A setting as figures title it: "DDP", "ZeRO-3", "ZeRO-3, offload optimizer".
std::string setting_title(int stage, dist::Offload offload) {
  std::string out = stage == 0 ? "DDP" : "ZeRO-" + std::to_string(stage);
  if (offload != dist::Offload::none) out += std::string(", offload ") + dist::name(offload);
  return out;
}

// The formulas, read off the placement policy: each role's bytes per parameter (2
// compute, 2 gradient, 12 master + Adam), divided by N where the role is sharded, on
// the device or (offload) the host. An offloaded gradient keeps only its shard, on the
// host; the device's full one (stage 1) stays. Parameter offload: the master is the shard.
// --accumulate f32 (stages 2, 3): the gradient shard takes 4 bytes a parameter, not 2.
struct Formula {
  int64_t device = 0, host = 0, file = 0;
};
constexpr int kPagedUnits = 3;  // offload nvme: read ahead, in use, written behind (dist/zero/paged_state.h)
// --compute f32: the compute weights are the f32 master (4 + 4 + 8 bytes: no separate copy).
// Offload nvme: the file holds the host's 14Ψ/N; the host pool kPagedUnits units' share of it
// (`largest`: elements of the largest unit's slice), and at stages 1, 2 a unit's update on its way up.
Formula formula_states(const dist::ZeroConfig& zero, int64_t psi, int n, int64_t largest = 0) {
  const int64_t compute = element_size(zero.compute_dtype), optimizer = compute == 4 ? 8 : 12;
  const int64_t shard_bytes = element_size(zero.accumulate());
  const dist::Placement placement = zero.placement();
  const auto bytes = [&](const dist::RolePlacement& role, int64_t per_param) {
    return role.layout == dist::Layout::sharded ? per_param * psi / n : per_param * psi;
  };
  Formula f;
  if (!placement.offloads_parameters()) f.device += bytes(placement.compute, compute);
  if (zero.secondary_weights) f.device += compute * psi / zero.ranks_per_node;  // hpZ: 2Ψ/S
  if (placement.pages_to_file()) {
    f.file = (12 + shard_bytes) * psi / n;
    f.host = kPagedUnits * (12 + shard_bytes) * largest + (placement.offloads_parameters() ? 0 : compute * largest);
    if (placement.gradients.layout == dist::Layout::full) f.device += 2 * psi;
  } else if (placement.offloads_optimizer()) {
    f.host += (12 + shard_bytes) * psi / n;
    if (placement.gradients.layout == dist::Layout::full) f.device += 2 * psi;
  } else {
    f.device += bytes(placement.gradients, placement.gradients.layout == dist::Layout::sharded ? shard_bytes : compute) +
                bytes(placement.optimizer_state, optimizer);
  }
  return f;
}

// Gradient reductions a step: one; under a pipeline of M micro-batches and V chunks a rank,
// stages 2, 3 reduce at each of the V M backwards (every unit of the rank, zeros where the
// pass had none), unless they reduce once (ZeroConfig::reduce_once).
int reductions(const dist::ZeroConfig& zero, int micro_batches, int chunks) {
  return zero.placement().frees_full_gradients() && !zero.reduce_once ? micro_batches * chunks : 1;
}
// Bytes a rank sends per step, by the group they go on: its shard group of n (all N, or S
// with hybrid sharding), and with hpZ or qgZ its node's g ranks and its node rank's N / g.
// Each reduction sends Ψ (an all-reduce's reduce-scatter half, or a reduce-scatter) and the
// step gathers Ψ (the all-reduce's other half, or the all-gather after the update) -- ZeRO-3
// gathers for each micro-batch's forward and backward instead, 2 M Ψ; each of the compute
// dtype, ring-counted ((n-1)/n). So 2Ψ, and 3Ψ at ZeRO-3, with one micro-batch. ZeRO++:
//   qwZ  the gathers over n in int8 and the blocks' f32 scales, 1 + 4/2048 bytes an element
//   hpZ  the step's first gather over n, the other 2M - 1 within the node from the secondary
//        partition (the compute dtype: qwZ's values dequantized), Ψ (g-1)/g each
//   qgZ  each reduction as the two-hop all-to-all (quantized_reduce.h), b = bits/8 + 4/block:
//        Ψ (g-1)/g b within the node, Ψ/g (r-1)/r b across (r = N/g)
// This rank's share of `bytes` it sent on a group of n ranks `stride` apart that left its node
// of `node` ranks: a ring leaves a node once for the h members on it, each sending 1/h of that
// -- all of it when h = 1 (one member a node), none when the group lies within the node.
double across_share(double bytes, int n, int stride, int node) {
  const int here = stride >= node ? 1 : std::min(n, node / stride);
  return here >= n ? 0 : bytes / here;
}

struct Traffic {
  double shard = 0, node = 0, across = 0;
  double total() const { return shard + node + across; }
};
Traffic formula_traffic(const dist::ZeroConfig& zero, int64_t psi, int n, int g, int micro_batches, int chunks) {
  const double element = static_cast<double>(element_size(zero.compute_dtype)), p = static_cast<double>(psi);
  const double scales = 4.0 / static_cast<double>(kQuantizationBlock);
  const double gather_bytes = zero.quantize_weights ? 1.0 + scales : element;
  const auto ring = [](int k) { return (k - 1.0) / k; };
  Traffic t;
  const int rho = reductions(zero, micro_batches, chunks);
  if (zero.gradient_bits != 0) {
    const double b = zero.gradient_bits / 8.0 + 4.0 / static_cast<double>(zero.gradient_block);
    t.node += rho * p * ring(g) * b;
    t.across += rho * p / g * ring(n / g) * b;
  } else {
    t.shard += rho * p * ring(n) * element;
  }
  if (!zero.placement().gathers_parameters()) {
    t.shard += p * ring(n) * element;
  } else if (zero.secondary_weights) {
    t.shard += p * ring(n) * gather_bytes;
    t.node += (2.0 * micro_batches - 1) * p * ring(g) * element;
  } else {
    t.shard += 2.0 * micro_batches * p * ring(n) * gather_bytes;
  }
  return t;
}
// Hybrid sharding, across r groups of s: each reduction's all-reduce of the gradient shard, Ψ/s elements.
int64_t formula_sent_across(const dist::ZeroConfig& zero, int64_t psi, int s, int r, int micro_batches, int chunks) {
  return static_cast<int64_t>(reductions(zero, micro_batches, chunks) * 2.0 * (r - 1) / r * static_cast<double>(psi) /
                              s * static_cast<double>(element_size(zero.compute_dtype)));
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
void check_host_memory(const Options& o, const bench::ModelShape& model, const std::vector<Setting>& settings) {
  const int64_t psi = model.make(kMeta)->num_parameters();
  int64_t states = 0;
  for (const Setting& s : settings)  // offload moves states to the host pool, here the same memory
    states = std::max(states, formula_states(zero_config(o, {s.stage, dist::Offload::none}), psi, o.world).device);
  const int64_t available = available_host_bytes();
  ZG_CHECK(states <= available / o.world, "zero_memory: ", o.world, " ranks of the ", model.name,
           " model on the cpu need at least ", format_bytes(states), " of host memory each (their model states); ",
           format_bytes(available), " is available. --device meta gives the figures without allocating them");
}

// --timeline: one recording of every rank's steps (ranks may be threads: the recorded
// rank starts and ends it, between barriers).
struct TimelineRun {
  int rank = 0;  // the recorded rank
  MemoryTimeline timeline;
  std::optional<MemoryTimelineRecording> recording;
};

// --tp T x --cp C x --pp P must divide every N (each world of --world-size, or mpirun's processes).
void check_model_parallel(int world, int tp, int pp, int cp = 1) {
  ZG_CHECK(world % (tp * pp * cp) == 0, "zero_memory: --tp ", tp, cp > 1 ? concat(" x --cp ", cp) : "",
           pp > 1 ? concat(" x --pp ", pp) : "", " does not divide the world size N = ", world, " (N = ",
           pp > 1 ? "P x " : "", "data-parallel ranks x ", cp > 1 ? "C x " : "", "T)");
}

// The groups a cut model sends on besides the world's: each of the mesh's dimensions, and
// the data-parallel ranks as one (ShardedModel's "dp", which it flattened already).
std::set<dist::ProcessGroup*> mesh_groups(dist::DeviceMesh& mesh) {
  std::set<dist::ProcessGroup*> groups;
  std::vector<std::string> data_dims;
  for (const dist::MeshDim& dim : mesh.dims()) {
    groups.insert(&mesh.group(dim.name));
    if (dim.name != "tp" && dim.name != "pp") data_dims.push_back(dim.name);
  }
  groups.insert(&mesh.flatten("dp", data_dims));
  return groups;
}

// The formulas beside a record's figures. With hybrid sharding they hold with S for N,
// plus the traffic across groups; with --tp T, for the Ψ_cut / T + Ψ_replicated parameters
// each rank holds, over the N / T data-parallel ranks, plus the tensor-parallel traffic.
// With --pp, for the parameters of this rank's stages.
void add_formulas(Record& r, const dist::ZeroConfig& zero, const bench::ModelShape& model, int64_t batch, int64_t seq,
                  const bench::ModelCut& cut) {
  const int tp = cut.tp;
  const bool sp = cut.sp;
  // Megatron's and Korthikanti et al.'s formulas (bench/tensor_parallel_formulas.h) are a GPT's.
  const bool gpt_cut = tp > 1 && r.pp == 1 && model.is_gpt();
  const int64_t psi = gpt_cut ? bench::tensor_parallel_counts(model.gpt()).per_rank(tp) : r.params;
  const Formula formula = formula_states(zero, psi, r.shard_group, r.largest_shard);
  r.formula_states = formula.device;
  r.formula_host = formula.host;
  r.formula_nvme = formula.file;
  r.formula_sent_across =
      formula_sent_across(zero, psi, r.shard_group, r.world_size / tp / r.pp / r.shard_group, r.micro_batches, r.chunks);
  r.cp = cut.cp;
  const Traffic traffic =
      formula_traffic(zero, psi, r.shard_group, std::max(zero.ranks_per_node, 1), r.micro_batches, r.chunks);
  r.formula_sent = static_cast<int64_t>(traffic.total()) + r.formula_sent_across;
  if (cut.cp > 1 && r.pp == 1 && r.micro_batches == 1) {  // the attention's traffic on the cp group; its activations
    const bench::ContextFormula context = bench::formula_context(model, batch, seq, cut, zero.compute_dtype);
    r.formula_sent_cp = context.sent;
    r.formula_sent += r.formula_sent_cp;
    r.formula_activation = context.peak;
    r.formula_activation_layer = context.layer;
  }
  if (tp == 1 && r.pp == 1 && cut.cp == 1) {  // within and across nodes: the shard group's ranks 1 apart, the replicas' S
    const int s = r.shard_group, g = r.ranks_per_node, node = std::max(zero.ranks_per_node, 1);  // (hpZ's, qgZ's)
    r.formula_sent_across_nodes = static_cast<int64_t>(
        across_share(traffic.shard, s, 1, g) + across_share(traffic.node, node, 1, g) +
        across_share(traffic.across, s / node, node, g) +
        across_share(static_cast<double>(r.formula_sent_across), r.world_size / s, s, g));
    r.formula_sent_within_node = r.formula_sent - r.formula_sent_across_nodes;
  }
  r.tp = tp;
  r.sequence_parallel = sp;
  if (!gpt_cut || cut.cp > 1) return;  // Korthikanti et al.'s formulas are for the whole model and sequence
  const nn::GPTConfig& config = model.gpt();
  const int64_t compute = element_size(zero.compute_dtype);
  r.formula_sent_tp = bench::formula_sent_tensor_parallel(config, batch, seq, tp, compute, sp);
  r.formula_sent += r.formula_sent_tp;
  const bench::ActivationFormula activations = bench::formula_activations(config, batch, seq, tp, compute, sp);
  r.formula_activation = activations.peak;
  r.formula_activation_layer = activations.ours;
  r.paper_activation_layer = activations.paper;
}

// This rank's model. Built already sharded: constructed without memory (cut, with --tp,
// over the mesh's tp group, each rank keeping its slices' recipes; with --pp, into stages,
// this rank holding its chunks), each rank materialising its units.
struct RankModel {
  std::shared_ptr<nn::CausalLM> model;
  std::unique_ptr<dist::DeviceMesh> mesh;  // --tp, --cp, --pp: [pp x] dp_replicate x dp_shard [x cp] [x tp]
  std::optional<dist::Schedule> schedule;  // --pp, --micro-batches: the stages, this rank's chunks
  dist::Stages stages;
  std::vector<std::shared_ptr<nn::Module>> chunks;
  std::shared_ptr<nn::Module> held;  // the chunks as one module, for the ShardedModel
  dist::SingleRank one_stage;
  std::optional<dist::ShardedModel> sharded;  // made by the caller, once the peaks are reset
  // --cp: the context-parallel ranks as a group of their own (the mesh's cp may be the world,
  // which ZeRO sends on too), so that sent cp is the attention's alone.
  std::unique_ptr<dist::ProcessGroup> cp;

  RankModel(const bench::ModelShape& shape, Device device, dist::ProcessGroup& group, const bench::ModelCut& cut,
            const dist::ZeroConfig& zero, const Pipelining& pipe) {
    manual_seed(1);
    model = shape.make(TensorOptions(DType::f32).device(device));
    if (cut.tp > 1 || cut.cp > 1 || pipe.pp > 1) {
      check_model_parallel(group.size(), cut.tp, pipe.pp, cut.cp);
      mesh = dist::training_mesh(group, {.pp = pipe.pp, .tp = cut.tp, .cp = cut.cp,
                                         .shard_group_size = zero.shard_group_size});
    }
    if (cut.tp > 1) {
      nn::ParallelPlan plan = model->parallel_plan();
      plan.sequence_parallel = cut.sp;
      dist::parallelize_module(*model, mesh->group("tp"), plan);
    }
    if (cut.cp > 1) {
      cp = group.split_grid(cut.cp, mesh->stride("cp"));
      dist::parallelize_context(*model, *cp, cut.cp_variant);
    }
    if (!pipe.on()) return;
    schedule.emplace(pipe.make());
    stages = shape.stages(*model, schedule->stages());
    chunks = stages.chunks(*schedule, pp().rank());
    held = dist::join_chunks(chunks);
  }
  dist::ProcessGroup& pp() { return mesh && schedule->ranks > 1 ? mesh->group("pp") : one_stage; }
  nn::Module& trained() { return held ? *held : static_cast<nn::Module&>(*model); }
};

// Of what the model's groups sent, this rank's share of what left its node (across_share),
// each group's stride from the mesh: the world's ranks are 1 apart, dp_shard's node ranks
// as dp_shard's, its node ranks' peers ranks_per_node of them apart.
double sent_across_nodes(const dist::ShardedModel& sharded, dist::ProcessGroup& world, int ranks_per_node) {
  const dist::DeviceMesh& mesh = sharded.mesh();
  const int shard = mesh.stride("dp_shard");
  std::map<dist::ProcessGroup*, int> strides = {{&world, 1}};
  for (const dist::MeshDim& dim : mesh.dims()) strides.emplace(&mesh.group(dim.name), mesh.stride(dim.name));
  if (dist::ProcessGroup* node = sharded.node_group()) {
    strides.emplace(node, shard);
    strides.emplace(sharded.across_group(), shard * node->size());
  }
  double across = 0;
  for (const auto& [group, stride] : strides)
    across += across_share(static_cast<double>(group->bytes_sent()), group->size(), stride, ranks_per_node);
  return across;
}

// Training steps on this rank with `zero`, the model cut over `tp` ranks; returns the record
// read after the last. With `log`, the last step's kernels and collectives are recorded
// into it (a dry run: --simulate); with `run`, every allocation of the steps into its timeline;
// with `update_in_backward`, each step's AdamW runs unit by unit during its backward.
Record measure(const dist::ZeroConfig& zero, const bench::ModelShape& shape, int steps, int64_t batch, int64_t seq,
               Device device, dist::ProcessGroup& group, const bench::ModelCut& cut, const Pipelining& pipe,
               int ranks_per_node, StepLog* log = nullptr, TimelineRun* run = nullptr,
               bool update_in_backward = false) {
  const int tp = cut.tp;
  const bool sp = cut.sp;
  RankModel built(shape, device, group, cut, zero, pipe);
  nn::CausalLM& model = *built.model;
  const std::unique_ptr<dist::DeviceMesh>& mesh = built.mesh;
  Context& context = Context::current();
  const Device host = device.type == DeviceType::meta ? kMeta : kCPU;  // where the host pool counts
  context.allocator(device)->reset_peaks();
  dist::ShardedModel& sharded =
      mesh ? built.sharded.emplace(built.trained(), *mesh, zero) : built.sharded.emplace(built.trained(), group, zero);
  std::optional<dist::Pipeline> pipeline;  // --pp, --micro-batches: the step runs the schedule
  if (built.schedule) {
    pipeline.emplace(built.pp(), *built.schedule, built.chunks, built.stages.loss);
    // A dry run's peers send no headers: hidden states [b, T, C] (T / C_cp a cp rank's, / T_tp
    // under sequence parallelism) in the compute dtype.
    if (device.type == DeviceType::meta)
      pipeline->set_activation({batch, seq / cut.cp / (sp ? tp : 1), shape.width()}, zero.compute_dtype);
  }
  dist::ProcessGroup* replicas = sharded.replica_group();  // hybrid sharding's other groups, or null
  const int64_t construction_peak = context.memory_stats(device).peak_total;
  context.allocator(device)->reset_peaks();
  context.host_allocator(host)->reset_peaks();
  if (run) {
    group.barrier();
    if (group.rank() == run->rank) run->recording.emplace(run->timeline);
    group.barrier();
  }
  const TensorOptions ids = TensorOptions(DType::i64).device(device);
  const int64_t rows = batch * pipe.micro_batches;  // --batch rows a micro-batch
  const Tensor x = zeros({rows, seq / cut.cp}, ids), y = zeros({rows, seq / cut.cp}, ids);  // --cp: this rank's pieces
  Record r{.group = group.kind(), .stage = zero.stage, .world_size = group.size(), .rank = group.rank(),
           .shard_group = sharded.shard_group().size(), .offload = zero.offload, .params = sharded.num_parameters(),
           .construction_peak = construction_peak};
  if (pipeline) {
    r.pp = pipe.pp, r.pp_rank = built.pp().rank(), r.micro_batches = pipe.micro_batches;
    r.chunks = built.schedule->chunks;
    r.held = dist::simulate(*built.schedule).peak_activations()[static_cast<size_t>(r.pp_rank)];
  }
  for (int s = 0; s < steps; ++s) {
    std::optional<StepLogScope> recording;
    if (log != nullptr && s == steps - 1) {
      log->clear();
      recording.emplace(*log);
    }
    // Every group the model sends on, each once: a mesh dimension as large as the world is
    // the world itself (dp_shard without hybrid sharding, dp_replicate at S = 1).
    std::set<dist::ProcessGroup*> groups = {&group, &sharded.shard_group()};
    if (replicas) groups.insert(replicas);
    if (mesh) groups.merge(mesh_groups(*mesh));
    if (built.cp) groups.insert(built.cp.get());
    for (dist::ProcessGroup* zeropp : {sharded.node_group(), sharded.across_group()})
      if (zeropp) groups.insert(zeropp);
    for (dist::ProcessGroup* g : groups) g->reset_bytes_sent();
    const auto mark = [&](const char* phase) {  // where the step's phases begin, for --schedule-svg
      if (recording) log->mark(phase);
    };
    mark("forward");
    sharded.zero_grad();
    if (update_in_backward) sharded.step_in_backward(1e-4);
    {
      MemoryScope scope(MemoryCategory::activation);
      if (pipeline) {
        pipeline->run(x, y);  // every micro-batch's forward and backward, in the schedule's order
      } else {
        const Tensor loss = model.forward(x, y).loss;  // the logits go: backward writes their gradient over them
        mark("backward");
        loss.backward();
      }
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
    mark("optimizer");
    sharded.step(1e-4);
    r.sent_across = replicas ? replicas->bytes_sent() : 0;
    r.sent_tp = mesh && tp > 1 ? mesh->group("tp").bytes_sent() : 0;
    r.sent_cp = built.cp ? built.cp->bytes_sent() : 0;
    r.sent_pp = pipeline && pipe.pp > 1 ? built.pp().bytes_sent() : 0;
    r.sent_per_step = 0;
    for (dist::ProcessGroup* g : groups) r.sent_per_step += g->bytes_sent();
    r.ranks_per_node = ranks_per_node;
    const double cp_across = built.cp ? across_share(static_cast<double>(r.sent_cp), cut.cp, mesh->stride("cp"),
                                                     ranks_per_node) : 0;  // (the cp group is not the mesh's)
    r.sent_across_nodes = static_cast<int64_t>(sent_across_nodes(sharded, group, ranks_per_node) + cp_across);
    r.sent_within_node = r.sent_per_step - r.sent_across_nodes;
  }
  if (run) {
    group.barrier();
    if (group.rank() == run->rank) run->recording.reset();
  }
  const MemoryStats s = context.memory_stats(device);
  r.activation = s.peak_of(MemoryCategory::activation);
  r.communication = s.peak_of(MemoryCategory::communication);
  r.peak_allocated = s.peak_total;
  r.reserved = s.peak_reserved;
  r.host_peak = context.host_memory_stats(host).peak_total;
  const FileTierStats tier = sharded.file_tier_stats();
  r.nvme_bytes = tier.paged_bytes, r.nvme_file_bytes = tier.file_bytes;
  r.nvme_read = tier.bytes_read, r.nvme_written = tier.bytes_written;
  r.largest_shard = sharded.largest_shard();
  add_formulas(r, zero, shape, batch, seq, cut);
  return r;
}

// Every rank's records, on every rank: their numbers all-gathered over `host` (a CPU group).
// The group's kind is the one the ranks measured with, the same on all.
std::vector<Record> all_records(dist::ProcessGroup& host, const std::vector<Record>& mine) {
  static constexpr int Record::*kInts[] = {&Record::stage, &Record::world_size, &Record::rank, &Record::shard_group,
                                           &Record::tp, &Record::pp, &Record::pp_rank, &Record::micro_batches,
                                           &Record::held, &Record::ranks_per_node, &Record::cp};
  static constexpr int64_t Record::*kInt64s[] = {
      &Record::params, &Record::parameter, &Record::gradient, &Record::optimizer_state, &Record::activation,
      &Record::communication, &Record::peak_allocated, &Record::reserved, &Record::sent_per_step,
      &Record::formula_states, &Record::formula_sent, &Record::construction_peak, &Record::sent_across,
      &Record::formula_sent_across, &Record::host_parameter, &Record::host_gradient, &Record::host_optimizer_state,
      &Record::host_peak, &Record::formula_host, &Record::sent_tp, &Record::formula_sent_tp,
      &Record::formula_activation, &Record::formula_activation_layer, &Record::paper_activation_layer,
      &Record::sent_cp, &Record::formula_sent_cp,
      &Record::sent_pp, &Record::sent_within_node, &Record::sent_across_nodes, &Record::formula_sent_within_node,
      &Record::formula_sent_across_nodes, &Record::nvme_bytes, &Record::nvme_file_bytes, &Record::nvme_read,
      &Record::nvme_written, &Record::formula_nvme, &Record::largest_shard};
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

// Which of `candidates` run: those whose configuration ZeroConfig::problem accepts at
// every N of `worlds`. A setting named alone must be valid (its problem is the error); of
// several (an `all`), the refused are left out, and if none is left the first says why.
std::vector<Setting> valid_settings(const Options& o, const std::vector<Setting>& candidates,
                                    const std::vector<int>& worlds, const std::string& asked) {
  std::vector<Setting> valid;
  std::string refused;  // the first refused setting and its problem
  for (const Setting& setting : candidates) {
    std::string wrong;
    for (size_t i = 0; i < worlds.size() && wrong.empty(); ++i)
      wrong = zero_config(o, setting).problem(worlds[i] / o.tp / o.pipe.pp);
    if (wrong.empty() && o.pipe.on() && setting.stage == 3 && dist::splits_backward(dist::parse_schedule(o.pipe.schedule)))
      wrong = concat("--schedule ", o.pipe.schedule, " runs each micro-batch's W after its I, and ZeRO-3 frees a unit's "
                     "gathered weights at the end of I");
    if (wrong.empty()) valid.push_back(setting);
    else if (candidates.size() == 1) fail("zero_memory: ", wrong);
    else if (refused.empty())
      refused = concat("stage ", setting.stage, " with offload ", dist::name(setting.offload), ": ", wrong);
  }
  ZG_CHECK(!valid.empty(), "zero_memory: ", asked, " leaves no valid setting (", refused, ")");
  return valid;
}

// A comma-separated list's words.
std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// The settings --stage and --offload ask for (all: every stage, every offload; --stage
// also takes a list, 0,3) that run.
std::vector<Setting> requested_settings(const Options& o) {
  std::vector<int> stages;
  if (o.stage_arg == "all") stages = {0, 1, 2, 3};
  else
    for (const std::string& word : split_commas(o.stage_arg)) {
      int64_t stage = 0;
      ZG_CHECK(parse_number(word, stage) && stage == static_cast<int>(stage), "zero_memory: --stage must be all or "
               "whole numbers, comma-separated, got '", o.stage_arg, "'");
      stages.push_back(static_cast<int>(stage));
    }
  std::vector<dist::Offload> offloads;
  if (o.offload_arg == "all") offloads = {dist::Offload::none, dist::Offload::optimizer, dist::Offload::optimizer_and_params};
  else offloads = {dist::parse_offload(o.offload_arg)};
  std::vector<Setting> candidates;
  for (int s : stages)
    for (dist::Offload offload : offloads) candidates.push_back({s, offload});
  const int world = o.world != 0 ? o.world : dist::launched_world_size();  // unset under mpirun: its processes
  return valid_settings(o, candidates, o.worlds.empty() ? std::vector<int>{world} : o.worlds,
                        concat("--stage ", o.stage_arg, " with --offload ", o.offload_arg));
}

// Tokens a sequence: --seq, else the model's block up to 1024.
int64_t seq_of(const Options& o, const bench::ModelShape& shape) {
  return o.seq > 0 ? o.seq : std::min<int64_t>(shape.block(), 1024);
}

// --largest-on: for each offload setting (at the stage that gains most from it), the
// largest model of kLadder whose one-rank dry run peaks within --largest-on GB: ZeRO-3 at
// N = 1 shards nothing but gathers per unit, so its figures are the offloaded ones'.
int largest_trainable(const Options& o) {
  struct Row {
    Setting setting;
    const char* paper;  // the device bytes a parameter, as the papers count them
  };
  const Row rows[] = {{{0, dist::Offload::none}, "16 (DDP; ZeRO paper)"},
                      {{2, dist::Offload::optimizer}, "2 (ZeRO-Offload: fp16 weights)"},
                      {{3, dist::Offload::optimizer}, "2 (weights, a unit gathered at a time)"},
                      {{3, dist::Offload::optimizer_and_params}, "0 (ZeRO-Infinity: units in use)"}};
  std::vector<Setting> candidates;
  for (const Row& row : rows) candidates.push_back(row.setting);
  const std::vector<Setting> valid = valid_settings(o, candidates, {1}, "--largest-on");
  const double device_bytes = o.largest_on * 1e9;
  std::printf("The largest GPT whose one-rank step fits %.0f GB of device memory (dry run on meta: bf16 compute,\n"
              "fp32 AdamW, activation checkpointing, batch 1 x 1024 tokens; peak = every byte allocated at once;\n"
              "a + after the name: the last model tried, a larger one may fit)\n\n",
              device_bytes / 1e9);
  std::printf("%-7s %-16s %-11s %8s %12s %12s %9s  %s\n", "stage", "offload", "model", "Ψ (B)", "device peak",
              "host states", "host/Ψ", "device bytes a parameter, paper");
  for (const auto& [setting, paper] : rows) {
    if (std::find(valid.begin(), valid.end(), setting) == valid.end()) continue;
    const Preset* fits = nullptr;
    Record best;
    for (const Preset& preset : kLadder) {
      bench::ModelShape shape{preset.name, preset.config};
      shape.set_checkpointing(true);
      Context rank0(0);
      ContextGuard guard(rank0);
      dist::FakeGroup group(0, 1);
      const Record r = measure(zero_config(o, setting), shape, 1, 1, 1024, kMeta, group, {}, {}, 1);
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
                static_cast<double>(host) / 1e9, static_cast<double>(host) / static_cast<double>(best.params), paper);
  }
  return 0;
}

// A column of milliseconds, as the --simulate table prints them.
std::string format_ms(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), " %11.2f", seconds * 1e3);
  return text;
}

// --simulate's offload columns: the CPU's, the host link's and the disk's milliseconds, the
// host thread's (its share of them, beside the compute stream), and when the AdamW ran.
std::string offload_columns(dist::Offload offload, OffloadSchedule schedule, const dist::StepTime& t) {
  char text[128];
  std::snprintf(text, sizeof(text), "  %-16s %8.2f %9.2f %9.2f %10.2f  %s", dist::name(offload), t.host * 1e3,
                t.link * 1e3, t.disk * 1e3, t.worker * 1e3, bench::name(schedule));
  return text;
}

// A schedule as a panel's title ends: "ZeRO-1, offload optimizer, N = 1, AdamW in the backward".
std::string schedule_title(OffloadSchedule s) {
  return s == OffloadSchedule::after_backward ? "after the backward"
         : s == OffloadSchedule::in_backward  ? "in the backward"
                                              : "delayed (DPU)";
}

// --zeropp-svg FILE: ZeRO-3 and each ZeRO++ technique (qwZ, hpZ, qgZ, then all three) as
// dry runs of rank --rank at N in nodes of --ranks-per-node: a table of what a rank sends
// within its node and across nodes, and the figure of it (bench/traffic_figure.h).
int zeropp_figure(const Options& o, const bench::ModelShape& shape) {
  struct Technique {
    const char* label;
    bool qwz, hpz;
    int gradient_bits;
  };
  const int64_t seq = seq_of(o, shape);
  const int node = o.machine.ranks_per_node;
  std::printf("%s, N = %d in nodes of %d, batch %lld x %lld, ZeRO-3 in bf16, rank %d: GB a step (1e9 bytes); M "
              "= 2Ψ, the paper's unit (a node's bytes across)\n\n%-16s %12s %12s %11s %13s\n",
              shape.title().c_str(), o.world, node, static_cast<long long>(o.batch), static_cast<long long>(seq), o.dry_rank,
              "technique", "within node", "across", "across M", "model states");
  std::vector<bench::TrafficBar> bars;
  for (const Technique& t : {Technique{"ZeRO-3", false, false, 0}, Technique{"qwZ", true, false, 0},
                             Technique{"hpZ", false, true, 0}, Technique{"qgZ (int4)", false, false, 4},
                             Technique{"qwZ + hpZ + qgZ", true, true, 4}}) {
    dist::ZeroConfig zero = zero_config(o, {3, dist::Offload::none});
    zero.quantize_weights = t.qwz, zero.secondary_weights = t.hpz, zero.gradient_bits = t.gradient_bits;
    zero.ranks_per_node = node;
    Context dry(o.dry_rank);
    ContextGuard guard(dry);
    dist::FakeGroup group(o.dry_rank, o.world);
    const Record r = measure(zero, shape, o.steps, o.batch, seq, kMeta, group, {}, {}, node);
    const double m = 2.0 * static_cast<double>(r.params) / node;  // a rank's share of M
    bars.push_back({t.label, static_cast<double>(r.sent_within_node), static_cast<double>(r.sent_across_nodes),
                    static_cast<double>(r.sent_across_nodes) / m});
    std::printf("%-16s %12.3f %12.3f %11.3f %13.3f\n", t.label, static_cast<double>(r.sent_within_node) / 1e9,
                static_cast<double>(r.sent_across_nodes) / 1e9, bars.back().across_m,
                static_cast<double>(r.parameter + r.gradient + r.optimizer_state) / 1e9);
  }
  const std::string title = concat("ZeRO++, ", shape.title(), " at N = ", o.world, " in nodes of ", node,
                                   ": bytes a rank sends a step, within its node and across nodes");
  std::ofstream(o.zeropp_svg) << bench::traffic_svg(title, bars);
  return 0;
}

// --cp-svg FILE: one long sequence (--seq, --batch) at ZeRO-3 over C = 1, 2, 4, 8 cp ranks
// (no data parallelism), each variant a dry run of rank 0: a table of a rank's activation
// peak and the bytes its cp group sends a step, and the figure of it (bench/context_figure.h).
int context_figure(const Options& o, const bench::ModelShape& shape) {
  const int64_t seq = seq_of(o, shape);
  constexpr dist::ContextVariant kVariants[] = {dist::ContextVariant::ring, dist::ContextVariant::all_gather,
                                                dist::ContextVariant::ulysses};
  std::printf("%s, batch %lld x %lld, ZeRO-3 over the C ranks, rank 0: GB (1e9 bytes)\n\n%4s %-11s %11s %9s %9s\n",
              shape.title().c_str(), static_cast<long long>(o.batch), static_cast<long long>(seq), "C", "variant",
              "activation", "sent cp", "peak");
  std::vector<bench::ContextBars> rows;
  for (int cp : {1, 2, 4, 8}) {
    ZG_CHECK(seq % (2 * cp) == 0, "zero_memory --cp-svg: --seq ", seq, " does not cut into 2 x ", cp, " pieces");
    bench::ContextBars& row = rows.emplace_back();
    row.cp = cp;
    for (int v = 0; v < 3; ++v) {
      Context dry(0);
      ContextGuard guard(dry);
      dist::FakeGroup group(0, cp);
      const Record r = measure(zero_config(o, {3, dist::Offload::none}), shape, 1, o.batch, seq, kMeta, group,
                               {.cp = cp, .cp_variant = kVariants[v]}, {}, 1);
      row.activation[v] = static_cast<double>(r.activation), row.sent[v] = static_cast<double>(r.sent_cp);
      std::printf("%4d %-11s %11.3f %9.3f %9.3f\n", cp, dist::name(kVariants[v]), row.activation[v] / 1e9,
                  row.sent[v] / 1e9, static_cast<double>(r.peak_allocated) / 1e9);
    }
  }
  const std::string title = concat("Context parallelism, ", shape.title(), " on ", seq,
                                   " tokens: who sends what, and a rank's bytes at C = 1, 2, 4, 8");
  write_file_atomically(o.cp_svg, bench::context_svg(title, rows), "zero_memory --cp-svg");
  return 0;
}

// --simulate: for each N and setting, rank 0's dry run (its second step, recorded)
// replayed by the step-time model; with --schedule-svg, each one's schedule drawn.
int simulate(const Options& o, const bench::ModelShape& shape, const std::vector<Setting>& settings, bool processes) {
  ZG_CHECK(o.device_arg == "meta" && !processes, "zero_memory: --simulate replays dry runs on the meta device; "
           "leave --device out");
  const bool offloading = std::any_of(settings.begin(), settings.end(),
                                      [](const Setting& s) { return s.offload != dist::Offload::none; });
  const int64_t batch = o.batch, seq = seq_of(o, shape);
  if (!o.json) {
    std::string who = o.tp == 1 ? "a rank" : concat("a tensor-parallel group of T = ", o.tp, " (tp innermost)");
    if (o.cp > 1) who = concat("a context-parallel group of C = ", o.cp, o.tp > 1 ? concat(" x T = ", o.tp) : "",
                               " (each rank ", seq / o.cp, " of them, ", dist::name(o.cp_variant), ")");
    if (o.pipe.on())
      who = concat("a micro-batch in ", o.pipe.make().describe(), " (rank 0: the first stage; idle: its wait for "
                   "the others, dist/pipeline/step_time.h)");
    std::printf("%s, batch %lld x %lld tokens %s, bf16 compute + fp32 AdamW; the step-time model "
                "(dist/comm/step_model.h) on\n%s%s\n\n",
                shape.title().c_str(), static_cast<long long>(batch), static_cast<long long>(seq), who.c_str(),
                o.machine.describe().c_str(), offloading ? ("; " + o.machine.describe_offload()).c_str() : "");
    std::printf("%5s %6s %5s %11s %11s %11s %11s %9s %14s%s%s\n", "stage", "N", "S", "step ms", "compute ms", "comm ms",
                "exposed ms", "exposed", "tokens/s", o.pipe.on() ? "     idle ms" : "",
                offloading ? "  offload          host ms   link ms   disk ms  thread ms  schedule" : "");
  } else {
    std::printf("[\n");
  }
  bool first = true;
  std::deque<StepLog> logs;  // the panels' (a deque: the references stay valid)
  std::vector<dist::SchedulePanel> panels;
  for (int world : o.worlds.empty() ? std::vector<int>{o.world} : o.worlds)
    for (const Setting& setting : settings)
      for (OffloadSchedule schedule : o.offload_schedules) {
        Context rank0(0);
        ContextGuard guard(rank0);
        dist::FakeGroup group(0, world);
        StepLog& log = logs.emplace_back();
        const Record r = measure(zero_config(o, setting, schedule), shape, 2, batch, seq, kMeta, group, o.cut(), o.pipe,
                                 o.machine.ranks_per_node, &log, nullptr, schedule == OffloadSchedule::in_backward);
        dist::StepTime t = dist::predict(log, o.machine);
        double idle = 0;  // --pp: the first stage's wait for the others
        if (o.pipe.on()) {
          const dist::PipelineStepTime pipe = dist::predict_pipeline(log, t, o.pipe.make(), r.pp_rank);
          idle = pipe.idle, t.step = pipe.step, t.exposed = t.step - t.compute - idle;
        }
        // A tp group shares its batch, a cp group its sequences; a pipeline's stages share theirs, of M micro-batches.
        const double tokens =
            static_cast<double>(batch * o.pipe.micro_batches * seq) * world / o.tp / o.cp / o.pipe.pp / t.step;
        if (o.json)
          std::printf("%s  {\"model\": \"%s\", \"stage\": %d, \"world_size\": %d, \"shard_group\": %d, "
                      "\"step_seconds\": %.6g, \"compute_seconds\": %.6g, \"communication_seconds\": %.6g, "
                      "\"exposed_seconds\": %.6g, \"tokens_per_second\": %.6g, \"offload\": \"%s\", "
                      "\"host_seconds\": %.6g, \"link_seconds\": %.6g, \"disk_seconds\": %.6g, "
                      "\"host_thread_seconds\": %.6g, \"offload_schedule\": \"%s\"%s%s}",
                      first ? "" : ",\n", shape.name.c_str(), setting.stage, world, r.shard_group, t.step, t.compute,
                      t.communication, t.exposed, tokens, dist::name(setting.offload), t.host, t.link, t.disk, t.worker,
                      bench::name(schedule),
                      ((o.tp == 1 ? std::string() : concat(", \"tp\": ", o.tp)) +
                       (o.cp == 1 ? std::string()
                                  : concat(", \"cp\": ", o.cp, ", \"cp_variant\": \"", dist::name(o.cp_variant), "\"")))
                          .c_str(),
                      o.pipe.on() ? concat(", \"pp\": ", o.pipe.pp, ", \"micro_batches\": ", o.pipe.micro_batches,
                                           ", \"pipeline_idle_seconds\": ", idle).c_str() : "");
        else
          std::printf("%5d %6d %5d %11.2f %11.2f %11.2f %11.2f %8.1f%% %14.0f%s%s\n", setting.stage, world, r.shard_group,
                      t.step * 1e3, t.compute * 1e3, t.communication * 1e3, t.exposed * 1e3, 100 * t.exposed / t.step,
                      tokens, o.pipe.on() ? format_ms(idle).c_str() : "",
                      offloading ? offload_columns(setting.offload, schedule, t).c_str() : "");
        first = false;
        panels.push_back({setting_title(setting.stage, setting.offload) + ", N = " + std::to_string(world) +
                              (r.shard_group != world ? ", S = " + std::to_string(r.shard_group) : "") +
                              (setting.offload == dist::Offload::none ? "" : concat(", AdamW ", schedule_title(schedule))),
                          log, t});
      }
  if (o.json) std::printf("\n]\n");
  if (!o.schedule_svg.empty())
    write_file_atomically(o.schedule_svg,
                          dist::step_schedule_svg(panels, concat(shape.title(), ", batch ", batch, " x ", seq,
                                                                 " tokens a rank: one step, rank 0, as the step model "
                                                                 "schedules it"),
                                                  o.machine.describe()),
                          "zero_memory --schedule-svg");
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

// Offload's CPU AdamW here: bytes a second over 4M parameters in the host pool (the bytes the
// step log counts for it: f32 master, m, v read and written, a bf16 gradient read and bf16
// weights written).
double host_adamw_rate() {
  NoGradGuard no_grad;
  const int64_t n = int64_t{1} << 22;
  const auto host = [n](DType dtype) {
    Tensor t = empty({n}, TensorOptions(dtype).pinned(true));
    t.zero_();
    return t;
  };
  const Tensor master = host(DType::f32), m = host(DType::f32), v = host(DType::f32), grad = host(DType::bf16),
               compute = host(DType::bf16);
  const std::vector<optim::AdamWSpan> spans = {{master, grad, m, v, compute}};
  int64_t step = 0;
  const double seconds = seconds_per_call(10, [&] { optim::adamw_update(spans, {}, 1e-4, ++step, 1.0); });
  return static_cast<double>(n) * (6 * 4 + 2 + 2) / seconds;
}

// --calibrate: this machine's rates, as the flags --simulate takes. Compute: a bf16 matrix
// product of the model's MLP shape (rows = batch x seq), a memory-bound add, an empty
// add's cost -- then all three scaled alike so that the model's compute for a one-rank
// step equals a real one-rank step of this model here (what the kernels' FLOPs and bytes
// do not say: unfused CPU kernels, conversions, allocation); the host's rate for offload's
// CPU AdamW (host_adamw_rate). Under mpirun (every rank
// measuring at once, as they would train): also the mpi group's latency (an all-reduce
// of one float) and bandwidth (of 4M floats), every rank counted as on one node.
void calibrate(const Options& o, const bench::ModelShape& shape, int64_t seq, dist::ProcessGroup* group) {
  const int64_t batch = o.batch;
  dist::Machine rates;
  {
    NoGradGuard no_grad;
    const int64_t rows = batch * seq, width = shape.width();
    const TensorOptions bf16 = TensorOptions(DType::bf16);
    const Tensor x = randn({rows, width}).to(DType::bf16), w = randn({width, 4 * width}).to(DType::bf16);
    rates.flops_per_second = 2.0 * rows * width * 4 * width / seconds_per_call(10, [&] { matmul(x, w); });
    const Tensor big = zeros({int64_t(1) << 22}, bf16), one = zeros({1}, bf16);
    rates.memory_bytes_per_second = 3.0 * big.nbytes() / seconds_per_call(10, [&] { big + big; });
    rates.kernel_seconds = seconds_per_call(200, [&] { one + one; });
  }
  // A real one-rank step, and the model's compute for the same step (DDP) from its dry run.
  const dist::ZeroConfig zero = zero_config(o, {0, dist::Offload::none});
  double real_step = 0;
  {
    manual_seed(1);
    const std::shared_ptr<nn::CausalLM> model = shape.make(kCPU);
    dist::SingleRank one;
    dist::ShardedModel sharded(*model, one, zero);
    const Tensor ids = zeros({batch, seq}, DType::i64);
    real_step = seconds_per_call(5, [&] {
      sharded.zero_grad();
      model->forward(ids, ids).loss.backward();
      sharded.step(1e-4);
    });
  }
  StepLog log;
  {
    Context rank0(0);
    ContextGuard guard(rank0);
    dist::FakeGroup one(0, 1);
    measure(zero, shape, 2, batch, seq, kMeta, one, {}, {}, 1, &log);
  }
  const double scale = real_step / dist::predict(log, rates).compute;
  std::string flags = "--tflops " + std::to_string(rates.flops_per_second / scale / 1e12) + " --memory-gbps " +
                      std::to_string(rates.memory_bytes_per_second / scale / 1e9) + " --kernel-us " +
                      std::to_string(rates.kernel_seconds * scale * 1e6) + " --host-gbps " +
                      std::to_string(host_adamw_rate() / 1e9);
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

// --calibrate's run: this process, or under mpirun every process at once (rank 0 prints).
int run_calibrate(const Options& o, const bench::ModelShape& shape) {
  const int64_t seq = seq_of(o, shape);
#if ZG_HAVE_MPI
  if (dist::launched_as_rank())
    return dist::run_mpi([&](dist::ProcessGroup& group) { calibrate(o, shape, seq, &group); });
#endif
  calibrate(o, shape, seq, nullptr);
  return 0;
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
// Writes the setting's trace and figure; returns its panel.
MemoryPanel write_timeline(const Options& o, const TimelineRun& run, const Record& r, Device device,
                           const std::string& what) {
  const std::string base = o.timeline_dir + "/" + setting_name(r.stage, r.offload);
  std::vector<MemoryLevel> levels = {{"formula", r.formula_states}};
  if (r.offload != dist::Offload::none) levels.push_back({"host formula", r.formula_host, true});
  const std::string trace = chrome_trace_json(run.timeline, levels);
  write_file_atomically(base + ".json", trace, "zero_memory --timeline");
  MemoryPanel panel{setting_title(r.stage, r.offload), memory_series(trace, r.rank, device.str()), levels, o.caching};
  write_file_atomically(base + ".svg", memory_figure_svg({panel}, setting_title(r.stage, r.offload) + ": " + what),
                        "zero_memory --timeline");
  return panel;
}

// --timeline's directory, made before anything runs; it records the ranks of this process.
void make_timeline_dir(const Options& o, bool processes) {
  ZG_CHECK(o.timeline_dir.empty() || (!processes && !o.simulate), "zero_memory: --timeline records the ranks of "
           "this process (--device meta, or cpu / cuda with the ranks as threads), not under mpirun or --simulate");
  if (o.timeline_dir.empty()) return;
  std::error_code error;
  std::filesystem::create_directories(o.timeline_dir, error);
  ZG_CHECK(!error && std::filesystem::is_directory(o.timeline_dir), "zero_memory: --timeline ", o.timeline_dir,
           " is not a directory that can be made: ", error ? error.message() : "a file is in the way");
}

// One setting's records from this process: rank --rank of a fake group (meta), or every rank
// as a thread, through the local group or (use_nccl) NCCL with rank r on cuda:r.
std::vector<Record> measure_setting(const Options& o, const bench::ModelShape& shape, Setting setting, Device device,
                                    bool use_nccl, TimelineRun* run) {
  const dist::ZeroConfig zero = zero_config(o, setting);
  const int64_t seq = seq_of(o, shape);
  std::vector<Record> records;
  if (device.type == DeviceType::meta) {
    Context dry(o.dry_rank);
    if (o.caching) dry.set_allocator(kMeta, cuda::simulated_caching_allocator(kMeta));
    ContextGuard guard(dry);
    dist::FakeGroup group(o.dry_rank, o.world);
    records.push_back(measure(zero, shape, o.steps, o.batch, seq, device, group, o.cut(), o.pipe,
                              o.machine.ranks_per_node, nullptr, run));
    return records;
  }
  std::mutex records_mutex;
  dist::run_local(o.world, [&](dist::ProcessGroup& group) {
    Record r;
    if (!use_nccl) {
      r = measure(zero, shape, o.steps, o.batch, seq, device, group, o.cut(), o.pipe, o.machine.ranks_per_node,
                  nullptr, run);
    } else {
#ifdef ZG_WITH_NCCL
      // The local group bootstraps NCCL (the unique id); rank r runs on cuda:r.
      const Device mine(DeviceType::cuda, group.rank());
      const auto nccl = dist::NcclGroup::bootstrap(group, mine);
      r = measure(zero, shape, o.steps, o.batch, seq, mine, *nccl, o.cut(), o.pipe, o.machine.ranks_per_node,
                  nullptr, run);
#endif
    }
    std::lock_guard lock(records_mutex);
    records.push_back(r);
  });
  return records;
}

// --timeline: every setting measured with its allocations recorded; rank 0's trace and
// figure written for each, then all of them on one scale in all.svg, and the last (the
// most sharded, whose bands the shared scale makes thin) again on a scale of its own.
std::vector<Record> record_timelines(const Options& o, const bench::ModelShape& shape, const std::vector<Setting>& settings,
                                     Device device, bool use_nccl) {
  const int shown = o.recorded_rank(device);
  const std::string what = shape.title() + ", rank " + std::to_string(shown) + " of " + std::to_string(o.world) +
                           " on " + device.str() +
                           ", " + name(o.zero.compute_dtype) + " compute" +
                           (o.checkpointing ? ", activation checkpointing" : "") + ", " +
                           std::to_string(o.steps) + (o.steps == 1 ? " step" : " steps");
  std::vector<Record> records;
  std::vector<MemoryPanel> panels;
  for (const Setting& setting : settings) {
    TimelineRun run;
    run.rank = shown;
    const std::vector<Record> measured = measure_setting(o, shape, setting, device, use_nccl, &run);
    records.insert(records.end(), measured.begin(), measured.end());
    const Record& recorded =
        *std::find_if(measured.begin(), measured.end(), [&](const Record& r) { return r.rank == shown; });
    panels.push_back(write_timeline(o, run, recorded, device, what));
  }
  std::string scales = " (one scale)";
  if (panels.size() > 1) {
    MemoryPanel close_up = panels.back();
    scales = " (one scale but the last)";
    close_up.title += ", on its own scale";
    close_up.own_scale = true;
    panels.push_back(std::move(close_up));
  }
  write_file_atomically(o.timeline_dir + "/all.svg", memory_figure_svg(panels, "Bytes by category, " + what + scales),
                        "zero_memory --timeline");
  return records;
}

// --tp T's fields of a record (none at T = 1): the tensor-parallel group's bytes sent and
// the activations' formulas (the peak; one layer as kept here and as Korthikanti et al. count it).
std::string tensor_parallel_json(const Record& r) {
  if (r.tp == 1) return "";
  return concat(", \"tp\": ", r.tp, ", \"sequence_parallel\": ", r.sequence_parallel ? "true" : "false",
                ", \"sent_tensor_parallel\": ", r.sent_tp,
                ", \"formula_sent_tensor_parallel\": ", r.formula_sent_tp, ", \"formula_activation\": ",
                r.formula_activation, ", \"formula_activation_layer\": ", r.formula_activation_layer,
                ", \"paper_activation_layer\": ", r.paper_activation_layer);
}

// --cp C's fields of a record (none at C = 1): the cp group's bytes sent, their formula, and
// the activations' formulas (the peak and one layer; 0 where there is none for the cut).
std::string context_parallel_json(const Options& o, const Record& r) {
  if (r.cp == 1) return "";
  return concat(", \"cp\": ", r.cp, ", \"cp_variant\": \"", dist::name(o.cp_variant), "\", \"sent_context_parallel\": ",
                r.sent_cp, ", \"formula_sent_context_parallel\": ", r.formula_sent_cp,
                r.tp > 1 ? "" : concat(", \"formula_activation\": ", r.formula_activation,  // (with tp: its fields)
                                       ", \"formula_activation_layer\": ", r.formula_activation_layer));
}

// --pp's and --micro-batches' fields of a record (none without them).
std::string pipeline_json(const Options& o, const Record& r) {
  if (r.pp == 1 && r.micro_batches == 1) return "";
  return concat(", \"pp\": ", r.pp, ", \"pp_rank\": ", r.pp_rank, ", \"schedule\": \"", o.pipe.schedule,
                "\", \"micro_batches\": ", r.micro_batches, ", \"chunks\": ", r.chunks,
                ", \"held_micro_batches\": ", r.held, ", \"reduce_once\": ", o.zero.reduce_once ? "true" : "false",
                ", \"sent_pipeline\": ", r.sent_pp);
}

// Within and across nodes, and ZeRO++'s settings. The paper counts M = the model's 16-bit
// bytes a node sends across (3M for ZeRO-3): across_nodes_in_M is G x this rank's share / 2Ψ.
// Offload nvme's fields: the file tier's bytes next to their formula, and the host pool's bound.
std::string nvme_json(const Record& r) {
  if (r.offload != dist::Offload::nvme) return "";
  return concat(", \"nvme_bytes\": ", r.nvme_bytes, ", \"formula_nvme_bytes\": ", r.formula_nvme,
                ", \"nvme_file_bytes\": ", r.nvme_file_bytes, ", \"nvme_read\": ", r.nvme_read,
                ", \"nvme_written\": ", r.nvme_written, ", \"host_bound_units\": ", kPagedUnits,
                ", \"largest_unit_shard\": ", r.largest_shard);
}

std::string node_json(const Options& o, const Record& r) {
  const bool formulas = r.tp == 1 && r.pp == 1;
  const double m = 2.0 * static_cast<double>(r.params) / r.ranks_per_node;  // this rank's share of M
  return concat(", \"ranks_per_node\": ", r.ranks_per_node, ", \"sent_within_node\": ", r.sent_within_node,
                ", \"sent_across_nodes\": ", r.sent_across_nodes,
                formulas ? concat(", \"formula_sent_within_node\": ", r.formula_sent_within_node,
                                  ", \"formula_sent_across_nodes\": ", r.formula_sent_across_nodes)
                         : std::string(),
                ", \"across_nodes_in_M\": ", static_cast<double>(r.sent_across_nodes) / m,
                ", \"qwz\": ", o.zero.quantize_weights ? "true" : "false", ", \"hpz\": ",
                o.zero.secondary_weights ? "true" : "false", ", \"qgz_bits\": ", o.zero.gradient_bits);
}

// One JSON record per rank and setting.
void print_json(const Options& o, Device device, const std::vector<Record>& records) {
  std::printf("[\n");
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    std::printf("  {\"model\": \"%s\", \"device\": \"%s\", \"group\": \"%s\", \"stage\": %d, \"world_size\": %d, \"rank\": %d, "
                "\"params\": %lld, \"parameter\": %lld, \"gradient\": %lld, \"optimizer_state\": %lld, "
                "\"activation\": %lld, \"communication\": %lld, \"peak_allocated\": %lld, \"reserved\": %lld, "
                "\"sent_per_step\": %lld, \"formula_model_states\": %lld, \"formula_sent_per_step\": %lld, "
                "\"construction_peak\": %lld, \"offload\": \"%s\", \"host_parameter\": %lld, \"host_gradient\": %lld, "
                "\"host_optimizer_state\": %lld, \"host_peak\": %lld, \"formula_host_model_states\": %lld, "
                "\"shard_group\": %d, \"sent_across_groups\": %lld, \"formula_sent_across_groups\": %lld%s%s%s%s%s}%s\n",
                o.model_name.c_str(), device.str().c_str(), r.group.c_str(), r.stage, r.world_size, r.rank,
                (long long)r.params, (long long)r.parameter, (long long)r.gradient, (long long)r.optimizer_state,
                (long long)r.activation, (long long)r.communication, (long long)r.peak_allocated,
                (long long)r.reserved, (long long)r.sent_per_step, (long long)r.formula_states,
                (long long)r.formula_sent, (long long)r.construction_peak, dist::name(r.offload),
                (long long)r.host_parameter, (long long)r.host_gradient, (long long)r.host_optimizer_state,
                (long long)r.host_peak, (long long)r.formula_host, r.shard_group, (long long)r.sent_across,
                (long long)r.formula_sent_across, nvme_json(r).c_str(), node_json(o, r).c_str(), tensor_parallel_json(r).c_str(),
                context_parallel_json(o, r).c_str(), pipeline_json(o, r).c_str(), i + 1 < records.size() ? "," : "");
  }
  std::printf("]\n");
}

// The table: a row per rank and setting, in GB (1e9 bytes), or MB for models whose 16Ψ is
// under a GB; with offload the host pool's columns, with hybrid sharding the traffic across.
void print_table(const Options& o, Device device, int64_t seq, const std::vector<Record>& records) {
  const std::string slices = o.pipe.pp > 1 ? " (rank 0's stages)" : o.tp == 1 ? "" : " (a rank's slices)";
  const int data_ranks = o.world / o.tp / o.pipe.pp / o.cp;
  std::string cut = o.pipe.pp > 1 ? concat(" = P = ", o.pipe.pp, " x ", data_ranks, " data-parallel") : "";
  if (o.cp > 1) cut += concat(o.pipe.pp > 1 ? "" : concat(" = ", data_ranks, " data-parallel"), " x C = ", o.cp);
  if (o.tp > 1)
    cut += concat(o.pipe.pp > 1 || o.cp > 1 ? "" : concat(" = ", data_ranks, " data-parallel"), " x T = ", o.tp);
  std::printf("%s: Ψ = %lld parameters%s, N = %d%s, %s, %s group, batch %lld x %lld tokens, %s compute + "
              "fp32 AdamW\n",
              o.model_title.c_str(), (long long)records.front().params, slices.c_str(), o.world, cut.c_str(),
              device.str().c_str(),
              records.front().group.c_str(), (long long)o.batch, (long long)seq, name(o.zero.compute_dtype));
  const double unit = 16 * records.front().params < 1'000'000'000 ? 1e6 : 1e9;
  const auto gb = [unit](int64_t bytes) { return static_cast<double>(bytes) / unit; };
  std::printf("sizes in %s; model states = parameter + gradient + optimizer_state after backward; build = the\n"
              "peak while the model was built (deferred, then materialised shard by shard)\n\n",
              unit == 1e9 ? "GB (1e9 bytes)" : "MB (1e6 bytes)");
  const bool offloading = std::any_of(records.begin(), records.end(),
                                      [](const Record& r) { return r.offload != dist::Offload::none; });
  std::printf("%5s %4s %9s %9s %9s %12s %9s %11s %9s %9s %11s %9s %9s", "stage", "rank", "param", "grad",
              "optim", "model states", "formula", "activation", "comm", "peak", "sent/step", "formula", "build");
  if (offloading) std::printf("  %-16s %11s %9s %9s", "offload", "host states", "formula", "host peak");
  const bool paging = std::any_of(records.begin(), records.end(),
                                  [](const Record& r) { return r.offload == dist::Offload::nvme; });
  if (paging) std::printf("  %9s %9s", "nvme", "formula");
  const bool hybrid = o.zero.shard_group_size != 0 && o.zero.shard_group_size != o.world / o.tp;
  if (hybrid) std::printf("  %5s %13s %9s", "S", "sent across", "formula");
  const bool tp_formulas = o.tp > 1 && !o.pipe.on();
  if (tp_formulas) std::printf("  %9s %9s %11s %11s %11s", "sent tp", "formula", "act formula", "act a layer", "paper");
  else if (o.tp > 1) std::printf("  %9s", "sent tp");
  if (o.pipe.on()) std::printf("  %7s %4s %9s", "pp rank", "held", "sent pp");
  if (o.cp > 1) std::printf("  %9s %9s %11s %11s", "sent cp", "formula", "act formula", "act a layer");
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
    if (paging) std::printf("  %9.3f %9.3f", gb(r.nvme_bytes), gb(r.formula_nvme));
    if (hybrid) std::printf("  %5d %13.3f %9.3f", r.shard_group, gb(r.sent_across), gb(r.formula_sent_across));
    if (tp_formulas)
      std::printf("  %9.3f %9.3f %11.3f %11.3f %11.3f", gb(r.sent_tp), gb(r.formula_sent_tp), gb(r.formula_activation),
                  gb(r.formula_activation_layer), gb(r.paper_activation_layer));
    else if (o.tp > 1) std::printf("  %9.3f", gb(r.sent_tp));
    if (o.pipe.on()) std::printf("  %7d %4d %9.3f", r.pp_rank, r.held, gb(r.sent_pp));
    if (o.cp > 1)
      std::printf("  %9.3f %9.3f %11.3f %11.3f", gb(r.sent_cp), gb(r.formula_sent_cp), gb(r.formula_activation),
                  gb(r.formula_activation_layer));
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
                "of N = %d\n", 100 * above, o.world);
  if (o.pipe.on())
    std::printf("\n%s, %lld row%s a micro-batch; held: the micro-batches whose activations the schedule\n"
                "keeps on that pp rank at once (dist::simulate); sent pp: of sent/step, the activations and\n"
                "gradients sent to the other stages and the tied embedding's gradient; model states and their\n"
                "formula are the rank's stages'. Stages 0, 1 (and 2, 3 with --reduce-once) reduce the gradients\n"
                "once a step, stages 2, 3 at each backward; the formula counts them so, and ZeRO-3's gathers as\n"
                "one for each micro-batch's forward and one for its backward (fewer run: an embedding's backward\n"
                "reads no weights, and the last stage keeps its head from F to B). sent/step adds sent pp.\n",
                o.pipe.make().describe().c_str(), static_cast<long long>(o.batch), o.batch == 1 ? "" : "s");
  if (o.cp > 1)
    std::printf("\nsent cp: of sent/step, the attention's keys and values on the context-parallel group (%s;\n"
                "formula: dist::context_attention_bytes a layer); act formula: the activation peak as this code keeps\n"
                "activations on its s / C tokens, act a layer: one layer's (bench/context_parallel_formulas.h;\n"
                "0: no formula for this cut)\n",
                dist::name(o.cp_variant));
  if (tp_formulas)
    std::printf("\nsent tp: of sent/step, what went to the tensor-parallel group (formula: Megatron's %s);\n"
                "act formula: the activation peak as this code keeps activations, act a layer: one layer's,\n"
                "paper: Korthikanti et al. 2022's %s (bench/tensor_parallel_formulas.h)\n",
                o.sequence_parallel ? "all-gathers and reduce-scatters" : "all-reduces",
                o.sequence_parallel ? "sbh/t (34 + 5as/h), with sequence parallelism" : "sbh(10 + 24/t + 5as/(ht))");
}

// Every rank's records in order of stage, offload and rank, as JSON or the table.
int print_records(const Options& o, const bench::ModelShape& shape, Device device, std::vector<Record> records) {
  std::sort(records.begin(), records.end(), [](const Record& a, const Record& b) {
    return std::tuple(a.stage, a.offload, a.rank) < std::tuple(b.stage, b.offload, b.rank);
  });
  if (o.json) print_json(o, device, records);
  else print_table(o, device, seq_of(o, shape), records);
  return 0;
}

#if ZG_HAVE_MPI
// Under mpirun: each process is a rank of every setting (CPU tensors over the mpi group;
// CUDA over NCCL, rank r on its node's GPU r); rank 0 prints every rank's records.
int run_processes(Options& o, const bench::ModelShape& shape, const std::vector<Setting>& settings, Device device) {
  ZG_CHECK(o.group_arg == "auto", "zero_memory: under mpirun the group is mpi (CPU) or nccl (CUDA); leave --group out");
  std::vector<Record> records;
  int my_rank = 0;
  const int status = dist::run_mpi([&](dist::ProcessGroup& host) {
    ZG_CHECK(o.world == 0 || o.world == host.size(), "zero_memory: --world-size ", o.world, " but mpirun started ",
             host.size(), " processes");
    o.world = host.size(), my_rank = host.rank();
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
    for (const Setting& setting : settings)
      measured.push_back(measure(zero_config(o, setting), shape, o.steps, o.batch, seq_of(o, shape), mine,
                                 nccl ? *nccl : host, o.cut(), o.pipe, o.machine.ranks_per_node));
    records = all_records(host, measured);
  });
  if (status != 0 || my_rank != 0) return status;  // rank 0 prints
  return print_records(o, shape, device, records);
}
#endif

// The table (the default mode): every setting measured by real steps (--device cpu |
// cuda) or a dry run (meta), with --timeline its allocations recorded too.
int run_table(Options& o, const bench::ModelShape& shape, const std::vector<Setting>& settings, bool processes) {
  const Device device(o.device_arg);
  ZG_CHECK(o.group_arg == "auto" || o.group_arg == "local" || o.group_arg == "nccl",
           "zero_memory: --group must be auto, local or nccl, got '", o.group_arg, "'");
  ZG_CHECK(device.type != DeviceType::meta || o.group_arg == "auto", "zero_memory: --device meta runs rank 0 of a "
           "fake group (a dry run), not --group ", o.group_arg, "; leave --group out");
  bool use_nccl = false;
#ifdef ZG_WITH_NCCL
  const bool enough_gpus = device.type == DeviceType::cuda && cuda::device_count() >= o.world;
  use_nccl = o.group_arg == "nccl" || (o.group_arg == "auto" && enough_gpus);
  ZG_CHECK(!use_nccl || enough_gpus, "zero_memory: --group nccl needs --device cuda and ", o.world,
           " GPUs (one per rank), found ", device.type == DeviceType::cuda ? cuda::device_count() : 0);
#else
  ZG_CHECK(o.group_arg != "nccl", "zero_memory: --group nccl needs a build with CUDA");
#endif
  if (device.type == DeviceType::cpu && !processes) check_host_memory(o, shape, settings);
#if ZG_HAVE_MPI
  if (processes) return run_processes(o, shape, settings, device);
#endif
  if (!o.timeline_dir.empty())
    return print_records(o, shape, device, record_timelines(o, shape, settings, device, use_nccl));
  std::vector<Record> records;
  for (const Setting& setting : settings) {
    const std::vector<Record> measured = measure_setting(o, shape, setting, device, use_nccl, nullptr);
    records.insert(records.end(), measured.begin(), measured.end());
  }
  return print_records(o, shape, device, records);
}

// A step of M micro-batches, from dry runs of m and m + 1 of them: every micro-batch once
// the pipeline is full is the same program, so the step time, the bytes sent and the peak
// (whose only part that grows with M is the step's token ids) grow by the same amount with
// each (each extended linearly).
struct MicroBatchRun {
  Record record;
  dist::StepTime replay, time;  // the log's replay; the step's (extended to M)
  StepLog log;
};
void extend(MicroBatchRun& to, const MicroBatchRun& from, int from_m, int to_m, int m) {
  const double k = static_cast<double>(m - to_m) / (to_m - from_m);
  for (double dist::StepTime::*part : {&dist::StepTime::step, &dist::StepTime::compute, &dist::StepTime::communication,
                                       &dist::StepTime::exposed, &dist::StepTime::host, &dist::StepTime::link,
                                       &dist::StepTime::disk})
    to.time.*part += k * (to.time.*part - from.time.*part);
  for (int64_t Record::*bytes : {&Record::sent_within_node, &Record::sent_across_nodes, &Record::peak_allocated})
    to.record.*bytes += std::llround(k * static_cast<double>(to.record.*bytes - from.record.*bytes));
}

// --plan's evaluation of one candidate: rank 0's dry run (under a pipeline also the last
// stage's first rank's, whose head and loss make its peak), rank 0's step replayed. A step of
// more than m + 1 micro-batches (m = max(P, 2): the pipeline full, its peak reached) is
// extended from m and m + 1 (MicroBatchRun) unless --plan-full-runs.
bench::Evaluation evaluate(const Options& o, const bench::PlanRequest& request, double flops_per_token,
                           const bench::Candidate& c) {
  bench::ModelShape shape = request.model;
  shape.set_checkpointing(c.checkpointing);
  dist::ZeroConfig zero = zero_config(o, {c.stage, c.offload});
  zero.shard_group_size = c.shard_group == c.dp ? 0 : c.shard_group;
  if (const std::string problem = zero.problem(c.dp * c.cp); !problem.empty()) fail(problem);
  const int n = request.cluster.gpus, m = std::max(c.pp, 2);
  const bool extended = !o.plan_full_runs && c.micro_batches > m + 1;
  const auto dry_run = [&](int rank, int micro_batches, MicroBatchRun& out) {
    Context dry(rank);
    ContextGuard guard(dry);
    dist::FakeGroup group(rank, n);
    out.record = measure(zero, shape, 2, c.rows, request.seq, kMeta, group,
                         {.tp = c.tp, .sp = c.tp > 1, .cp = c.cp, .cp_variant = c.cp_variant},
                         {.pp = c.pp, .micro_batches = micro_batches}, request.cluster.gpus_per_node, &out.log);
    out.replay = out.time = dist::predict(out.log, o.machine);
  };
  const auto step_of = [&](int rank) {
    MicroBatchRun run, fewer;
    dry_run(rank, extended ? m + 1 : c.micro_batches, run);
    if (extended) {
      dry_run(rank, m, fewer);
      extend(run, fewer, m, m + 1, c.micro_batches);
    }
    return run;
  };
  const MicroBatchRun run = step_of(0);
  bench::Evaluation e;
  e.peak = run.record.peak_allocated, e.host_peak = run.record.host_peak;
  e.sent_within = run.record.sent_within_node, e.sent_across = run.record.sent_across_nodes;
  e.time = run.time;
  if (c.pp > 1) e.peak = std::max(e.peak, step_of(n - n / c.pp).record.peak_allocated);  // pp outermost
  if (c.micro_batches > 1) {  // the wait for the other stages, in a schedule of all M
    const Pipelining pipe{.pp = c.pp, .micro_batches = c.micro_batches};
    const dist::PipelineStepTime p = dist::predict_pipeline(run.log, run.replay, pipe.make(), 0);
    e.idle = p.idle, e.time.step += p.idle;
  }
  e.tokens_per_second = static_cast<double>(request.sequences * request.seq) / e.time.step;
  e.mfu = e.tokens_per_second / n * flops_per_token / request.cluster.peak_flops;
  const bench::Cluster& cluster = request.cluster;
  e.host_fits = cluster.host_memory == 0 || e.host_peak * cluster.gpus_per_node <= cluster.host_memory;
  e.fits = e.peak <= cluster.gpu_memory && e.host_fits;
  e.time.compute_spans.clear(), e.time.collective_spans.clear();  // the ranking keeps hundreds
  return e;
}

// A count with a binary suffix (K, M, G: 2^10, 2^20, 2^30), as --global-batch writes it.
int64_t parse_count(const std::string& flag, const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  int64_t n = 0;
  const std::string suffix = text.substr(digits);
  const int64_t unit = suffix == "K" ? int64_t(1) << 10 : suffix == "M" ? int64_t(1) << 20 : suffix == "G" ? int64_t(1) << 30 : 1;
  ZG_CHECK(parse_number(text.substr(0, digits), n) && n > 0 && (suffix.empty() || unit > 1), "zero_memory: ", flag,
           " needs a positive whole number with an optional K, M or G (binary), got '", text, "'");
  return n * unit;
}

// --gpu-memory, --host-memory: "80GB" (1e9 bytes a GB), "80GiB" (2^30), "80" (GB), also MB, MiB, TB, TiB.
int64_t parse_bytes(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  const std::string unit = end ? std::string(end) : "";
  const std::map<std::string, double> units = {{"", 1e9},          {"GB", 1e9},  {"GiB", 0x1p30}, {"MB", 1e6},
                                               {"MiB", 0x1p20}, {"TB", 1e12}, {"TiB", 0x1p40}};
  const auto it = units.find(unit);
  ZG_CHECK(end != text.c_str() && it != units.end() && x > 0 && std::isfinite(x), "zero_memory: ", flag,
           " needs a size such as 80GB or 80GiB, got '", text, "'");
  return static_cast<int64_t>(x * it->second);
}

// --global-batch: "1M-tokens" (2^20 tokens), "128" or "128-sequences": sequences of `seq` tokens a step.
int64_t global_sequences(const std::string& spec, int64_t seq) {
  const size_t dash = spec.find('-');
  const std::string count = spec.substr(0, dash), what = dash == std::string::npos ? "sequences" : spec.substr(dash + 1);
  ZG_CHECK(what == "tokens" || what == "sequences", "zero_memory: --global-batch is N-tokens or N-sequences, got '",
           spec, "'");
  const int64_t n = parse_count("--global-batch", count);
  if (what == "sequences") return n;
  ZG_CHECK(n % seq == 0, "zero_memory: --global-batch ", spec, " is ", n, " tokens, not a whole number of sequences of ",
           seq, " (--seq): give a multiple of ", seq);
  return n / seq;
}

// --plan: the planner's search (bench/plan.h) over this model on --gpus GPUs.
int run_plan(const Options& o, const bench::ModelShape& shape) {
  bench::PlanRequest request{.model = shape, .cluster = o.cluster};
  request.cluster.gpus_per_node = o.machine.ranks_per_node;
  request.seq = o.seq > 0 ? o.seq : shape.block();
  request.sequences = global_sequences(o.global_batch, request.seq);
  const double flops_per_token = shape.flops_per_token(request.seq, shape.make(kMeta)->num_parameters());
  const auto start = std::chrono::steady_clock::now();
  int refused = 0;
  const std::vector<bench::PlannedSetting> ranked = bench::plan(
      request, [&](const bench::Candidate& c) { return evaluate(o, request, flops_per_token, c); },
      static_cast<int>(std::max(1u, std::thread::hardware_concurrency())), &refused);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (o.json) std::printf("%s", bench::plan_json(request, ranked).c_str());
  else bench::print_plan(request, o.machine, ranked, o.top, refused, seconds);
  if (!o.plan_svg.empty()) write_file_atomically(o.plan_svg, bench::plan_svg(request, ranked), "zero_memory --plan-svg");
  return ranked.empty() ? 1 : 0;
}

void usage() {
  std::printf(
      "usage: zero_memory [--model tiny|124m|350m|1.5b|7.5b|llama3-8b|llama3-70b | --config FILE] [--world-size N] [--stage 0|1|2|3|all|S,S]\n"
      "                   [--device meta|cpu|cuda|auto] [--rank R] [--group auto|local|nccl] [--steps K] [--batch B]\n"
      "                   [--seq T] [--offload none|optimizer|optimizer+params|nvme|all] [--offload-dir DIR]\n"
      "                   [--accumulate bf16|f32]\n"
      "                   [--shard-group S] [--tp T [--sequence-parallel]] [--cp C [--cp-variant ring|all_gather|ulysses]]\n"
      "                   [--prefetch-bytes B] [--keep-after-forward U,U|*] [--json]\n"
      "                   [--pp P] [--schedule gpipe|1f1b|interleaved|zb-h1|zb-h2] [--micro-batches M] [--chunks V]\n"
      "                   [--reduce-once] [--qwz] [--hpz] [--qgz | --qgz-bits 4|8] [--qgz-block B]\n"
      "                   [--ranks-per-node G]\n"
      "                   [--compute bf16|f32] [--checkpointing] [--caching] [--timeline DIR]\n"
      "       zero_memory --simulate [--world-size N,N,...] [--stage S,S,...] [--tflops X] [--memory-gbps X]\n"
      "                   [--kernel-us X] [--ranks-per-node G] [--intra-gbps X] [--intra-us X] [--inter-gbps X]\n"
      "                   [--inter-us X] [--host-gbps X] [--link-gbps X] [--disk-gbps X] [--bucket-bytes B]\n"
      "                   [--schedule-svg FILE] [--offload O] [--offload-schedule after-backward,in-backward,delayed]\n"
      "       zero_memory --zeropp-svg FILE [--model M] [--world-size N] [--ranks-per-node G]\n"
      "       zero_memory --cp-svg FILE [--model M | --config FILE] [--seq T] [--batch B]   (C = 1, 2, 4, 8)\n"
      "       zero_memory --calibrate [--model M] [--batch B] [--seq T]   (under mpirun: the network too)\n"
      "       zero_memory --plan [--model M | --config config.json] --gpus N [--gpus-per-node G] [--gpu-memory 80GB]\n"
      "                   [--host-memory 2TB (a node's; unchecked without)]\n"
      "                   [--seq T] [--global-batch 1M-tokens | 128-sequences] [--peak-tflops X] [--top K] [--json]\n"
      "                   [--plan-svg FILE] [--plan-full-runs] [the machine's rates, or --rates FILE]\n"
      "       zero_memory --largest-on GB\n"
      "A preset's shape changes with --layers L --heads H --embd C --vocab V. --model llama3-8b|llama3-70b, or\n"
      "--config FILE (a Hugging Face config.json: GPT-2's, or the Llama family's: Llama 2/3, Mistral, Qwen2).\n"
      "--rates FILE: the flags in FILE (what --calibrate printed) as if given here.\n"
      "--plan: every mesh (dp_replicate x dp_shard x tp x pp), stage, offload, checkpointing and micro-batch for\n"
      "  the model on --gpus N GPUs, each by a dry run and the step-time model, ranked (docs chapter 20).\n"
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
      "--rank R (meta): the dry run as rank R of the N (its place in the mesh, its shards); 0 by default.\n"
            "--tp T: tensor parallelism, the model cut over T ranks (tp innermost), N / T data-parallel ranks;\n"
      "  --sequence-parallel: and the activations between the cut layers cut along the sequence.\n"
      "--cp C: context parallelism, each sequence cut over C ranks (beside tp), N / (C T) data-parallel ranks;\n"
      "  --cp-variant: the attention's keys and values passed round a ring (default), all-gathered, or\n"
      "  Ulysses' all-to-all to a head split. --seq is the whole sequence, a multiple of 2C.\n"
      "--pp P: pipeline parallelism, the layers cut into P stages (x --chunks V for interleaved) across P\n"
      "  groups (pp outermost), N = P x data-parallel x T ranks; --schedule (1f1b by default) runs\n"
      "  --micro-batches M of --batch rows each a step. A rank's row: its stages' states and activations;\n"
      "  with --simulate, the first stage's step time and its wait for the others (idle ms).\n"
      "--reduce-once (stages 2, 3; with --micro-batches): each unit's full gradient kept over the micro-batches,\n"
      "  reduced once a step instead of each (stages 0, 1 always reduce once).\n"
      "--qwz (stage 3): ZeRO++'s quantized weight gathers, int8 with an f32 scale per 2048 elements.\n"
      "--hpz (stage 3): ZeRO++'s secondary partition of the weights within each node of --ranks-per-node G\n"
      "  ranks (8 by default): the step's later gathers stay within the node, for 2Ψ/G more bytes a rank.\n"
      "--qgz (stages 2, 3): ZeRO++'s gradient reduction as int4 all-to-alls within the node, then across\n"
      "  (--qgz-bits 8: int8; --qgz-block: elements a scale, 64). The sharding stays over all N: not with\n"
      "  --shard-group (hybrid sharding, HSDP).\n"
      "Sent within / across nodes (of --ranks-per-node G): a collective over ranks on several nodes leaves\n"
      "  each node once, its bytes shared by the node's ranks in it (the ZeRO++ paper's accounting).\n"
      "--zeropp-svg FILE: ZeRO-3, qwZ, hpZ, qgZ and all three as dry runs: a table of the bytes a rank sends\n"
      "  within its node and across nodes, and their figure.\n"
      "--compute: the dtype of the forward and backward (bf16 default; master weights and Adam stay f32).\n"
      "--checkpointing: each block's activations recomputed in backward instead of kept.\n"
      "--caching (meta): through the GPU's caching allocator over a simulated device: reserved bytes as\n"
      "a GPU's cache would hold them (segments, 512 B rounding, freed blocks kept for reuse).\n"
      "--timeline DIR: every allocation of the steps, per setting a trace for ui.perfetto.dev\n"
      "(stage-S.json) and a figure (stage-S.svg); all.svg puts rank 0 (--rank) of each on one scale (and the\n"
      "last setting again on its own).\n"
      "--simulate: the step-time model's step time for each N and stage; --schedule-svg FILE draws each\n"
      "step's compute and communication in time (a Gantt chart). --bucket-bytes: DDP's gradient buckets.\n"
      "--offload-schedule (with --simulate --offload optimizer): when the CPU AdamW runs, each of a list: after\n"
      "the backward (step), in it on a host thread as each unit's gradient lands (step_in_backward), or\n"
      "delayed beside the next step's forward and backward (ZeroConfig::delayed_update_after 0).\n");
}

// The flags, read into `o`; an exit status instead where they ask for the usage (--help,
// or a flag this bench does not know).
std::optional<int> parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      ZG_CHECK(i + 1 < argc, "zero_memory: ", a, " needs a value");
      return argv[++i];
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
    auto bf16_or_f32 = [&] {  // --compute, --accumulate
      const std::string dtype = value();
      ZG_CHECK(dtype == "bf16" || dtype == "f32", "zero_memory: ", a, " must be bf16 or f32, got '", dtype, "'");
      return dtype == "f32" ? DType::f32 : DType::bf16;
    };
    if (a == "--model") o.model_name = value();
    else if (a == "--config") o.config_file = value();
    else if (a == "--world-size") {
      const std::string list = value();
      for (const std::string& word : split_commas(list)) {
        int64_t n = 0;
        ZG_CHECK(parse_number(word, n) && n >= 1 && n <= (1 << 20),
                 "zero_memory: --world-size needs whole numbers in [1, 1048576], comma-separated, got '", list, "'");
        o.worlds.push_back(static_cast<int>(n));
      }
      o.world = o.worlds.front();
    }
    else if (a == "--simulate") o.simulate = true;
    else if (a == "--plan") o.plan = true;
    else if (a == "--gpus") o.cluster.gpus = static_cast<int>(number(1, 1 << 20));
    else if (a == "--gpus-per-node") o.machine.ranks_per_node = static_cast<int>(number(1, 1 << 10));
    else if (a == "--gpu-memory") o.cluster.gpu_memory = parse_bytes(a, value());
    else if (a == "--host-memory") o.cluster.host_memory = parse_bytes(a, value());
    else if (a == "--peak-tflops") o.cluster.peak_flops = rate(1e12);
    else if (a == "--global-batch") o.global_batch = value();
    else if (a == "--top") o.top = static_cast<int>(number(1, 1 << 20));
    else if (a == "--plan-svg") o.plan_svg = value();
    else if (a == "--plan-full-runs") o.plan_full_runs = true;
    else if (a == "--layers") o.layers = number(1, 1 << 16);
    else if (a == "--heads") o.heads = number(1, 1 << 16);
    else if (a == "--embd") o.embd = number(1, 1 << 20);
    else if (a == "--vocab") o.vocab = number(1, 1 << 30);
    else if (a == "--calibrate") o.calibrate = true;
    else if (a == "--tflops") o.machine.flops_per_second = rate(1e12);
    else if (a == "--memory-gbps") o.machine.memory_bytes_per_second = rate(1e9);
    else if (a == "--kernel-us") o.machine.kernel_seconds = rate(1e-6);
    else if (a == "--ranks-per-node") o.machine.ranks_per_node = static_cast<int>(number(1, 1 << 20));
    else if (a == "--intra-gbps") o.machine.intra_bytes_per_second = rate(1e9);
    else if (a == "--intra-us") o.machine.intra_latency_seconds = rate(1e-6);
    else if (a == "--inter-gbps") o.machine.inter_bytes_per_second = rate(1e9);
    else if (a == "--inter-us") o.machine.inter_latency_seconds = rate(1e-6);
    else if (a == "--host-gbps") o.machine.host_bytes_per_second = rate(1e9);
    else if (a == "--link-gbps") o.machine.link_bytes_per_second = rate(1e9);
    else if (a == "--disk-gbps") o.machine.disk_bytes_per_second = rate(1e9);
    else if (a == "--stage") o.stage_arg = value();
    else if (a == "--device") o.device_arg = value();
    else if (a == "--group") o.group_arg = value();
    else if (a == "--steps") o.steps = static_cast<int>(number(1, 1 << 20));
    else if (a == "--rank") o.dry_rank = static_cast<int>(number(0, 1 << 20));
    else if (a == "--batch") o.batch = number(1, INT64_MAX);
    else if (a == "--seq") o.seq = number(1, INT64_MAX);
    else if (a == "--json") o.json = true;
    else if (a == "--timeline") o.timeline_dir = value();
    else if (a == "--checkpointing") o.checkpointing = true;
    else if (a == "--caching") o.caching = true;
    else if (a == "--compute") o.zero.compute_dtype = bf16_or_f32();
    else if (a == "--offload") o.offload_arg = value();
    else if (a == "--offload-dir") o.zero.offload_dir = value();
    else if (a == "--accumulate") {
      const DType dtype = bf16_or_f32();
      if (dtype == DType::f32) o.zero.accumulate_dtype = dtype;  // bf16: unset, the default
    }
    else if (a == "--largest-on") o.largest_on = static_cast<double>(number(1, 1 << 20));
    else if (a == "--tp") o.tp = static_cast<int>(number(1, 1 << 20));
    else if (a == "--sequence-parallel") o.sequence_parallel = true;
    else if (a == "--cp") o.cp = static_cast<int>(number(1, 1 << 20));
    else if (a == "--cp-variant") o.cp_variant = dist::parse_context_variant(value());
    else if (a == "--pp") o.pipe.pp = static_cast<int>(number(1, 1 << 20));
    else if (a == "--micro-batches") o.pipe.micro_batches = static_cast<int>(number(1, 1 << 16));
    else if (a == "--reduce-once") o.zero.reduce_once = true;
    else if (a == "--qwz") o.zero.quantize_weights = true;
    else if (a == "--hpz") o.zero.secondary_weights = true;
    else if (a == "--qgz") o.zero.gradient_bits = 4;
    else if (a == "--qgz-bits") o.zero.gradient_bits = static_cast<int>(number(1, 64));
    else if (a == "--qgz-block") o.zero.gradient_block = number(1, INT64_MAX);
    else if (a == "--chunks") o.pipe.chunks = static_cast<int>(number(1, 1 << 10));
    else if (a == "--schedule") o.pipe.schedule = value();
    else if (a == "--shard-group") o.zero.shard_group_size = static_cast<int>(number(1, 1 << 20));
    else if (a == "--prefetch-bytes") o.zero.prefetch_bytes = number(0, INT64_MAX);
    else if (a == "--bucket-bytes") o.zero.bucket_bytes = number(1, INT64_MAX);
    else if (a == "--schedule-svg") o.schedule_svg = value();
    else if (a == "--zeropp-svg") o.zeropp_svg = value();
    else if (a == "--cp-svg") o.cp_svg = value();
    else if (a == "--offload-schedule") {
      o.offload_schedules.clear();
      for (const std::string& item : split_commas(value()))
        o.offload_schedules.push_back(bench::parse_offload_schedule(item, "zero_memory"));
    }
    else if (a == "--keep-after-forward") o.zero.keep_after_forward = split_commas(value());
    else {
      usage();
      return a == "--help" ? 0 : 2;
    }
  }
  return std::nullopt;
}

// The command line with each --rates FILE replaced by the flags FILE holds: what --calibrate
// printed (or rates written by hand: --tflops 380 --inter-gbps 50 ...), whitespace-separated.
std::vector<std::string> with_rates_files(int argc, char** argv) {
  std::vector<std::string> words;
  for (int i = 0; i < argc; ++i) {
    if (std::string(argv[i]) != "--rates") {
      words.emplace_back(argv[i]);
      continue;
    }
    ZG_CHECK(i + 1 < argc, "zero_memory: --rates needs a file (what zero_memory --calibrate printed)");
    std::ifstream in(argv[++i]);
    ZG_CHECK(in.good(), "zero_memory: --rates ", argv[i], " cannot be read");
    const size_t first = words.size();
    for (std::string word; in >> word; words.push_back(word))
      ZG_CHECK(words.size() > first || word.starts_with("--"), "zero_memory: --rates ", argv[i],
               " must hold flags such as --tflops 380, as --calibrate prints them; it starts with '", word, "'");
  }
  return words;
}

// The model --model names (GPT-2 124M by default, the tiny GPT for real steps on the
// CPU; llama3-8b, llama3-70b) or --config's config.json (model_type gpt2, read by
// nn::hf_gpt2_config_json; else the Llama family's, by nn::hf_llama_config), a GPT
// preset's shape changed by --layers, --heads, --embd, --vocab
// (e.g. to train_zero's), with --checkpointing, its positions covering --seq.
bench::ModelShape chosen_model(Options& o) {
  ZG_CHECK(o.config_file.empty() || o.model_name.empty(), "zero_memory: --model ", o.model_name, " and --config ",
           o.config_file, " both name the model: give one");
  bench::ModelShape shape;
  if (!o.config_file.empty()) {
    std::filesystem::path path(o.config_file);
    if (std::filesystem::is_directory(path)) path /= "config.json";
    std::ifstream in(path);
    const bool gpt2 = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false).value("model_type", "") == "gpt2";
    const std::string name = (path.filename() == "config.json" ? path.parent_path().filename() : path.stem()).string();
    shape = gpt2 ? bench::ModelShape{name, nn::hf_gpt2_config_json(o.config_file)}
                 : bench::ModelShape{name, nn::hf_llama_config(o.config_file)};
  } else {
    if (o.model_name.empty()) o.model_name = o.device_arg == "cpu" ? "tiny" : "124m";
    const auto gpt = std::find_if(kPresets.begin(), kPresets.end(), [&](const Preset& p) { return o.model_name == p.name; });
    const auto llama = std::find_if(kLlamaPresets.begin(), kLlamaPresets.end(),
                                    [&](const LlamaPreset& p) { return o.model_name == p.name; });
    ZG_CHECK(gpt != kPresets.end() || llama != kLlamaPresets.end(), "zero_memory: unknown --model ", o.model_name,
             " (tiny, 124m, 350m, 1.5b, 7.5b, llama3-8b, llama3-70b; or --config FILE)");
    shape = gpt != kPresets.end() ? bench::ModelShape{gpt->name, gpt->config} : bench::ModelShape{llama->name, llama->config};
  }
  if (o.layers || o.heads || o.embd || o.vocab) {
    ZG_CHECK(shape.is_gpt(), "zero_memory: --layers, --heads, --embd and --vocab change a GPT preset's shape; ",
             shape.title(), "'s comes from its config (write a config.json and pass --config)");
    nn::GPTConfig& c = std::get<nn::GPTConfig>(shape.config);
    c.n_layer = o.layers ? o.layers : c.n_layer, c.n_head = o.heads ? o.heads : c.n_head;
    c.n_embd = o.embd ? o.embd : c.n_embd, c.vocab_size = o.vocab ? o.vocab : c.vocab_size;
    ZG_CHECK(c.n_embd % c.n_head == 0, "zero_memory: --embd ", c.n_embd, " is not a multiple of --heads ", c.n_head);
    shape.name += "-custom";
  }
  shape.set_checkpointing(o.checkpointing);
  if (o.seq > 0) shape.fit_sequence(o.seq);
  o.model_name = shape.name, o.model_title = shape.title();
  return shape;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    std::vector<std::string> words = with_rates_files(argc, argv);
    std::vector<char*> args;
    for (std::string& word : words) args.push_back(word.data());
    if (const std::optional<int> status = parse(static_cast<int>(args.size()), args.data(), o)) return *status;
    ZG_CHECK(o.tp == 1 || (!o.calibrate && o.largest_on == 0), "zero_memory: --tp is for the table and --simulate, "
             "not --calibrate or --largest-on (one rank)");
    ZG_CHECK(!o.pipe.on() || (!o.calibrate && o.largest_on == 0), "zero_memory: --pp and --micro-batches are for "
             "the table and --simulate, not --calibrate or --largest-on (one rank)");
    ZG_CHECK(o.tp > 1 || !o.sequence_parallel, "zero_memory: --sequence-parallel cuts the sequence across the --tp "
             "ranks: add --tp");
    ZG_CHECK(o.cp == 1 || (!o.calibrate && o.largest_on == 0 && !o.plan), "zero_memory: --cp is for the table, "
             "--simulate and --cp-svg (--plan searches cp itself, where sequences are long)");
    if (o.zero.secondary_weights || o.zero.gradient_bits != 0) {  // hpZ's and qgZ's node: the machine's
      ZG_CHECK(o.zero.shard_group_size == 0, "zero_memory: --hpz and --qgz shard over all N ranks with nodes of "
               "--ranks-per-node G (", o.machine.ranks_per_node, "); --shard-group ", o.zero.shard_group_size,
               " is hybrid sharding (HSDP), which keeps every collective within its group: drop it, and give the node "
               "as --ranks-per-node");
      o.zero.ranks_per_node = std::max(o.machine.ranks_per_node / o.tp, 1);
    }
    if (o.largest_on > 0) return largest_trainable(o);
    // auto: the GPU when this build has a usable one (N ranks sharing it), else the CPU.
    if (o.device_arg == "auto") o.device_arg = cuda_usable() ? "cuda" : "cpu";
    const bench::ModelShape shape = chosen_model(o);
    ZG_CHECK(o.cp == 1 || seq_of(o, shape) % (2 * o.cp) == 0, "zero_memory: --seq ", seq_of(o, shape),
             " does not cut into the 2 x ", o.cp, " equal pieces --cp ", o.cp, " needs; give a multiple of ", 2 * o.cp);
    ZG_CHECK(!o.caching || o.device_arg == "meta", "zero_memory: --caching simulates a GPU's cache in a dry run "
             "(--device meta); a real run uses its device's own allocator");
    ZG_CHECK(o.zero.compute_dtype == DType::bf16 || o.offload_arg == "none", "zero_memory: --compute f32 is for runs "
             "without --offload (offload's formulas are for 16-bit compute weights beside the f32 master)");
    if (o.calibrate) return run_calibrate(o, shape);
    if (o.plan) return run_plan(o, shape);
    // Under mpirun each process is a rank of a real run (the dry run stays one process).
    const bool processes = dist::launched_as_rank() && o.device_arg != "meta";
#if !ZG_HAVE_MPI
    ZG_CHECK(!processes, "zero_memory: started by mpirun, but this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
    if (o.world == 0 && !processes) o.world = 4;
    ZG_CHECK(processes || (o.world >= 1 && o.steps >= 1 && o.batch >= 1),
             "zero_memory: --world-size, --steps and --batch must be at least 1");
    ZG_CHECK(o.worlds.size() <= 1 || o.simulate, "zero_memory: a list of world sizes is for --simulate");
    ZG_CHECK(o.schedule_svg.empty() || o.simulate, "zero_memory: --schedule-svg draws the schedules --simulate "
             "predicts; add --simulate");
    ZG_CHECK(o.simulate || o.offload_schedules == std::vector{OffloadSchedule::after_backward},
             "zero_memory: --offload-schedule is for --simulate (train_zero runs them: --update-in-backward, "
             "--delayed-update)");
    for (int world : o.worlds.empty() ? std::vector<int>{o.world} : o.worlds)
      if (world != 0) check_model_parallel(world, o.tp, o.pipe.pp, o.cp);
    ZG_CHECK(o.dry_rank == 0 || (o.device_arg == "meta" && !o.simulate && o.dry_rank < o.world), "zero_memory: --rank ",
             o.dry_rank, " picks the rank of the dry run (--device meta, the table) of N = ", o.world,
             " ranks: it must be below N");
    const std::vector<Setting> settings = requested_settings(o);
    make_timeline_dir(o, processes);
    if (o.simulate) return simulate(o, shape, settings, processes);
    if (!o.zeropp_svg.empty()) return zeropp_figure(o, shape);
    if (!o.cp_svg.empty()) return context_figure(o, shape);
    return run_table(o, shape, settings, processes);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
