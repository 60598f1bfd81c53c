// train_zero: train_gpt's loop on N ranks, its parameters in a ShardedModel -- DDP or
// ZeRO-1/2/3 is one flag. The ranks are N threads of this process (a local group: on
// the CPU, or sharing one GPU), or, under mpirun, one process each (CPU tensors over the
// mpi group; CUDA tensors over NCCL, rank r on its node's GPU r, the NCCL id sent over
// MPI); each takes its rows of the global batch, so every stage trains the same
// model as one rank would. The checkpoint is a directory of per-rank shards, and a run
// resumes from it at any --ranks and --stage.
//
//   build/examples/train_zero --ranks 4 --stage 3 --steps 100 --save ckpt
//   build/examples/train_zero --ranks 2 --stage 1 --steps 200 --resume ckpt
//   mpirun -n 4 build/examples/train_zero --stage 3 --steps 100
//   mpirun -n 8 build/examples/train_zero --stage 3 --device cuda          (NCCL, a GPU a process)
//   mpirun -n 4 build/examples/train_zero --stage 3 --shard-group 2   (HSDP: 2 groups of 2)
//   build/examples/train_zero --ranks 2 --stage 3 --offload optimizer+params --dtype bf16
//   build/examples/train_zero --ranks 1 --stage 3 --offload nvme --offload-dir /tmp --host-budget 64
//   build/examples/train_zero --ranks 2 --stage 2 --offload optimizer --update-in-backward
//   mpirun -n 4 build/examples/train_zero --tp 2 --stage 3   (each layer cut across 2 ranks, ZeRO-3 over 2)
//   mpirun -n 4 build/examples/train_zero --pp 4 --micro-batches 8 --schedule 1f1b   (the layers cut in 4 stages)
//   mpirun -n 4 build/examples/train_zero --cp 4 --seq 1024   (each sequence cut across 4 ranks: ring attention)
//
// With --tp T the ranks are a mesh of data-parallel ranks x T tensor-parallel ones (tp
// innermost): the GPT is cut by its plan (heads, MLP features, vocabulary) across each
// group of T consecutive ranks, which take the same rows; ZeRO shards each rank's slices
// over the data-parallel ranks.
//
// With --pp P the ranks are also P pipeline stages (outermost: a stage's ranks are
// consecutive): the GPT is cut into P x --chunks stages by its blocks (dist::gpt_stages), each
// data-parallel rank's rows split into --micro-batches, run in the --schedule's order
// (dist::Pipeline); each rank's ShardedModel holds its chunks.
//
// With --cp C each sequence is cut across C ranks (beside tp; dist::parallelize_context):
// each holds 2 of its 2C pieces, attention runs as --cp-variant says, and ZeRO shards
// over the data-parallel x cp ranks, averaging their gradients.
//
// --model llama trains a Llama of the same size instead (RMSNorm, rotary positions, SwiGLU,
// grouped-query attention with half the heads' keys and values; dist::llama_stages under --pp).
//
// Rank 0 prints a line per step: the global loss, the gradient norm, and its own bytes
// by category -- the model states shrink with the stage, `comm` holds the gathered
// ZeRO-3 units and reduction buffers. The last line is "final loss: X".
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/gpt.h"
#include "nn/llama.h"
#include "optim/schedule.h"
#include "training.h"
#include "zerograd.h"

using namespace zg;

namespace {

struct Flags : examples::TrainingFlags {
  int64_t ranks = 0, stage = 3, prefetch = 1;  // ranks 0: unset (2 threads; under mpirun, its processes)
  int64_t shard_group = 0;                     // 0: shard over every data-parallel rank
  int64_t tp = 1;                              // tensor-parallel ranks a layer
  int64_t cp = 1;                              // context-parallel ranks a sequence
  std::string cp_variant = "ring";
  int64_t pp = 1, micro_batches = 1, chunks = 0;  // pipeline stages' ranks; chunks 0: the schedule's default
  std::string schedule = "1f1b";
  bool sequence_parallel = false, reduce_once = false, qwz = false, hpz = false;
  bool update_in_backward = false;  // each unit's AdamW as its gradient lands (no clipping)
  int64_t delayed_update = -1;      // the delayed parameter update after this many steps (-1: off)
  bool offload_activations = false;  // saved activations in the host pool between forward and backward
  int64_t gradient_bits = 0, ranks_per_node = 0;  // qgZ's bits (0: off); hpZ's and qgZ's node (0: all one)
  int64_t gradient_block = 64;                    // qgZ's elements a scale
  int64_t prefetch_bytes = 0;                  // 0: --prefetch alone bounds it
  std::vector<std::string> keep_after_forward;
  std::string group = "auto";
  std::string model = "gpt";                   // gpt or llama
  Flags() { steps = 100; }
  bool pipelined() const { return pp > 1 || micro_batches > 1; }
};

void usage() {
  std::cout << "usage: train_zero [flags]\n"
               "  --ranks N          ranks, as threads of this process (default 2; under mpirun: its processes)\n"
               "  --group G          auto (under mpirun: nccl with --device cuda, else mpi; local otherwise),\n"
               "                     local (threads), mpi (a process a rank, CPU tensors) or nccl (a process a\n"
               "                     rank, its node's GPU r, bootstrapped over MPI)\n"
               "  --stage S          0 = DDP, 1, 2, 3 = ZeRO-1/2/3 (default 3)\n"
               "  --prefetch K       ZeRO-3: units gathered ahead of use (default 1)\n"
               "  --prefetch-bytes B ZeRO-3: prefetch stops before the gathered units exceed B bytes\n"
               "  --keep-after-forward U,U  ZeRO-3: units kept gathered from forward to backward (* for all)\n"
               "  --shard-group S    hybrid sharding (stages 2, 3): shard within groups of S consecutive ranks,\n"
               "                     replicate across the ranks / S groups (default: one group of all)\n"
               "  --tp T             tensor parallelism: each layer cut across T consecutive ranks (heads, MLP\n"
               "                     features, vocabulary); ZeRO over the ranks / T data-parallel ones (default 1)\n"
               "  --sequence-parallel  with --tp: between the cut layers each rank holds its rows of the sequence\n"
               "  --cp C             context parallelism: each sequence cut across C ranks (2 of 2C pieces each,\n"
               "                     one early, one late); --seq a multiple of 2C (default 1)\n"
               "  --cp-variant V     ring (keys and values passed round), all_gather (gathered once a layer) or\n"
               "                     ulysses (all-to-all to a head split: heads / tp divide by C) (default ring)\n"
               "  --pp P             pipeline parallelism: the layers cut into P stages (x --chunks) across P groups\n"
               "                     of consecutive ranks; data parallelism over the ranks / (P x T) (default 1)\n"
               "  --schedule S       the pipeline's order: gpipe, 1f1b, interleaved, zb-h1 or zb-h2 (default 1f1b)\n"
               "  --micro-batches M  each data-parallel rank's rows split into M micro-batches (default 1)\n"
               "  --chunks V         stages a rank holds: 1, or V >= 2 for interleaved (default: 2 for interleaved)\n"
               "  --qwz              stage 3: weight all-gathers in blockwise int8 (ZeRO++'s qwZ); master\n"
               "                     weights and optimizer stay exact\n"
               "  --hpz              stage 3: a secondary partition of the weights within each node of\n"
               "                     --ranks-per-node ranks, so the step's later gathers stay in the node (hpZ)\n"
               "  --qgz              stages 2, 3: gradients reduced as int4 all-to-alls within the node, then\n"
               "                     across (ZeRO++'s qgZ), summed in f32; --qgz-bits 8 for int8, --qgz-block B\n"
               "                     elements a scale (64)\n"
               "  --ranks-per-node G hpZ's and qgZ's node: G consecutive data-parallel ranks\n"
               "  --reduce-once      stages 2, 3 with --micro-batches: keep each unit's full gradient over the\n"
               "                     micro-batches and reduce it once a step, not each (FSDP2's no-sync)\n"
               "  --update-in-backward  stages 1-3: each unit's AdamW on a host thread as its gradient lands,\n"
               "                     while the backward goes on (ShardedModel::step_in_backward); no clipping\n"
               "  --delayed-update N with --offload optimizer, after N exact steps: each step's update runs beside\n"
               "                     the next step's forward and backward (ZeRO-Offload's DPU; not exact)\n"
               "  --offload-activations  the forward's saved activations wait in the host pool for the backward\n"
               "                     (autograd's OffloadSavedTensors)\n"

               "  --model gpt|llama  the model: GPT-2's shape, or a Llama's of the same size (grouped-query\n"
               "                     attention, half the heads' keys and values) (default gpt)\n"
               "  --batch B          sequences per step, all ranks together: a multiple of --ranks (default 8)\n"
               "  --dtype f32|bf16   compute dtype; master weights and Adam state stay f32\n"
               "  --device cpu|cuda  where every rank trains (default cpu)\n"
               "  --resume DIR       continue from a sharded checkpoint, saved at any --ranks and --stage\n"
            << Flags().common_help();
}

// The ranks divide into data-parallel ones of C x T each, and the batch into their rows.
void check_ranks(const Flags& f, int ranks) {
  ZG_CHECK(ranks % (f.pp * f.cp * f.tp) == 0, "train_zero: ", f.pp > 1 ? "--pp " + std::to_string(f.pp) + " x " : "",
           f.cp > 1 ? "--cp " + std::to_string(f.cp) + " x " : "", "--tp ", f.tp, " does not divide the ", ranks,
           " ranks");
  const int64_t data_ranks = ranks / (f.pp * f.cp * f.tp);
  ZG_CHECK(f.batch % (data_ranks * f.micro_batches) == 0, "train_zero: --batch ", f.batch, " is not a multiple of the ",
           data_ranks, " data-parallel ranks x ", f.micro_batches, " micro-batches: each takes batch / ", data_ranks,
           " rows, split into micro-batches of equal rows");
}

// --cp: the sequence cuts into 2C pieces; Ulysses splits each tp rank's heads (and a Llama's
// key/value heads, half as many) across the C ranks.
void check_context_parallel(const Flags& f) {
  if (f.cp == 1) return;
  const dist::ContextVariant variant = dist::parse_context_variant(f.cp_variant);
  ZG_CHECK(f.seq % (2 * f.cp) == 0, "train_zero: --seq ", f.seq, " does not cut into the 2 x ", f.cp,
           " equal pieces --cp ", f.cp, " needs; make it a multiple of ", 2 * f.cp);
  const int64_t kv_heads = f.model == "llama" ? std::max<int64_t>(f.heads / 2, 1) : f.heads;
  ZG_CHECK(variant != dist::ContextVariant::ulysses || (f.heads % (f.tp * f.cp) == 0 && kv_heads % (f.tp * f.cp) == 0),
           "train_zero: --cp-variant ulysses gives each of the --cp ", f.cp, " ranks 1/", f.cp, " of a tp rank's ",
           f.heads / f.tp, " heads and ", kv_heads / f.tp, " key/value heads, which do not divide; use ring or "
           "all_gather, or change --heads");
}

bool parse(int argc, char** argv, Flags& f) {
  examples::FlagReader flag("train_zero", argc, argv);
  while (flag.next()) {
    const std::string& a = flag.name();
    if (a == "--help") return false;
    else if (f.read(flag)) continue;
    else if (a == "--ranks") f.ranks = flag.count(1);
    else if (a == "--stage") f.stage = flag.count(0);
    else if (a == "--prefetch") f.prefetch = flag.count(0);
    else if (a == "--shard-group") f.shard_group = flag.count(1);
    else if (a == "--tp") f.tp = flag.count(1);
    else if (a == "--cp") f.cp = flag.count(1);
    else if (a == "--cp-variant") f.cp_variant = flag.value();
    else if (a == "--pp") f.pp = flag.count(1);
    else if (a == "--micro-batches") f.micro_batches = flag.count(1);
    else if (a == "--chunks") f.chunks = flag.count(1);
    else if (a == "--schedule") f.schedule = flag.value();
    else if (a == "--sequence-parallel") f.sequence_parallel = true;
    else if (a == "--reduce-once") f.reduce_once = true;
    else if (a == "--update-in-backward") f.update_in_backward = true, f.max_grad_norm = 0;
    else if (a == "--delayed-update") f.delayed_update = flag.count(0);
    else if (a == "--offload-activations") f.offload_activations = true;
    else if (a == "--qwz") f.qwz = true;
    else if (a == "--hpz") f.hpz = true;
    else if (a == "--qgz") f.gradient_bits = 4;
    else if (a == "--qgz-bits") f.gradient_bits = flag.count(1);
    else if (a == "--qgz-block") f.gradient_block = flag.count(1);
    else if (a == "--ranks-per-node") f.ranks_per_node = flag.count(1);
    else if (a == "--prefetch-bytes") f.prefetch_bytes = flag.count(0);
    else if (a == "--keep-after-forward") {
      const std::string list = flag.value();
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        f.keep_after_forward.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    }
    else if (a == "--group") f.group = flag.value();
    else if (a == "--model") f.model = flag.value();
    else flag.unknown();
  }
  f.check("train_zero");
  ZG_CHECK(f.stage <= 1024 && f.ranks <= 1024 && f.prefetch <= 1024 && f.shard_group <= 1024 && f.tp <= 1024 && f.cp <= 1024 &&
               f.pp <= 1024 && f.micro_batches <= 1024 && f.chunks <= 1024 && f.gradient_bits <= 1024 &&
               f.ranks_per_node <= 1024,
           "train_zero: --stage, --ranks, --prefetch, --shard-group, --tp, --cp, --pp, --micro-batches, --chunks, --qgz-bits "
           "and --ranks-per-node go up to 1024");
  const dist::ScheduleKind kind = dist::parse_schedule(f.schedule);
  ZG_CHECK(!dist::splits_backward(kind) || f.stage < 3, "train_zero: --schedule ", f.schedule,
           " runs each micro-batch's W after its I, and ZeRO-3 frees a unit's gathered weights at the end of I; use "
           "--stage 0, 1 or 2 with it");
  if (f.chunks == 0) f.chunks = kind == dist::ScheduleKind::interleaved ? 2 : 1;
  ZG_CHECK(f.tp > 1 || !f.sequence_parallel, "train_zero: --sequence-parallel cuts the sequence across the --tp ranks: "
           "add --tp");
  ZG_CHECK(f.model == "gpt" || f.model == "llama", "train_zero: --model must be gpt or llama, got ", f.model);
  check_context_parallel(f);
  ZG_CHECK(f.model == "gpt" || !f.checkpointing, "train_zero: --checkpointing is GPT's (nn::GPTConfig); the Llama keeps "
           "its activations");
  ZG_CHECK(f.group == "auto" || f.group == "local" || f.group == "mpi" || f.group == "nccl",
           "train_zero: --group must be auto, local, mpi or nccl, got ", f.group);
  if (f.group == "auto")
    f.group = !dist::launched_as_rank() ? "local" : Device(f.device).type == DeviceType::cuda ? "nccl" : "mpi";
  ZG_CHECK(f.group != "nccl" || Device(f.device).type == DeviceType::cuda, "train_zero: --group nccl moves CUDA tensors: "
           "add --device cuda");
  if (f.group == "local" && f.ranks == 0) f.ranks = 2;
  if (f.group == "local") check_ranks(f, static_cast<int>(f.ranks));  // (under mpirun: once the processes are counted)
  ZG_CHECK(f.dtype == "f32" || f.dtype == "bf16", "train_zero: --dtype must be f32 or bf16, got ", f.dtype);
  ZG_CHECK(!f.offload_activations || !f.pipelined(), "train_zero: --offload-activations wraps the forward of a "
           "step without a pipeline (leave it out with --pp or --micro-batches)");
  ZG_CHECK(!f.update_in_backward || !f.pipelined(), "train_zero: --update-in-backward runs a step's updates during its "
           "one backward; a pipeline's or --micro-batches' step has several (leave it out)");
  return true;
}

// The configuration every rank's ShardedModel takes.
dist::ZeroConfig zero_config(const Flags& f) {
  return {.stage = static_cast<int>(f.stage),
          .compute_dtype = f.dtype == "bf16" ? DType::bf16 : DType::f32,
          .adamw = {0.9, 0.95, 1e-8, f.weight_decay},
          .max_grad_norm = f.max_grad_norm,
          .prefetch = static_cast<int>(f.prefetch),
          .offload = f.offloaded(),
          .offload_dir = f.offload_dir,
          .delayed_update_after = f.delayed_update,
          .keep_after_forward = f.keep_after_forward,
          .prefetch_bytes = f.prefetch_bytes,
          .shard_group_size = static_cast<int>(f.shard_group), .reduce_once = f.reduce_once,
          .quantize_weights = f.qwz, .secondary_weights = f.hpz, .gradient_bits = static_cast<int>(f.gradient_bits),
          .gradient_block = f.gradient_block,
          .ranks_per_node = static_cast<int>(f.ranks_per_node)};
}

// Refuses what ZeroConfig::problem finds wrong at the data-parallel ranks (known once the
// group is: under mpirun, its processes) before any rank builds a model.
void check_config(const Flags& f, int ranks) {
  const std::string wrong = zero_config(f).problem(ranks / static_cast<int>(f.tp * f.pp));
  ZG_CHECK(wrong.empty(), "train_zero: ", wrong);
}

// Rank 0's bytes by category on the device, then (offload) in the host pool.
std::string memory_line(Device device) {
  const MemoryStats s = memory_stats(device);
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  char line[300];
  std::snprintf(line, sizeof line, "rank 0: param %.2f grad %.2f opt %.2f comm(peak) %.2f act(peak) %.2f MiB",
                             mib(s[MemoryCategory::parameter]), mib(s[MemoryCategory::gradient]),
                             mib(s[MemoryCategory::optimizer_state]), mib(s.peak_of(MemoryCategory::communication)),
                             mib(s.peak_of(MemoryCategory::activation)));
  return line + examples::host_memory_part();
}

// The model --model names, at --layers, --heads, --embd, --seq over bytes (a vocabulary of 256).
std::unique_ptr<nn::CausalLM> make_model(const Flags& f, Device device) {
  const TensorOptions options = TensorOptions(DType::f32).device(device);
  if (f.model == "llama") {
    nn::LlamaConfig config;
    config.n_layer = f.layers, config.n_head = f.heads, config.n_kv_head = std::max<int64_t>(f.heads / 2, 1);
    config.n_embd = f.embd, config.vocab_size = 256, config.block_size = f.seq;
    return std::make_unique<nn::Llama>(config, options);
  }
  nn::GPTConfig config;
  config.n_layer = f.layers, config.n_head = f.heads, config.n_embd = f.embd;
  config.vocab_size = 256, config.block_size = f.seq;
  config.activation_checkpointing = f.checkpointing;
  return std::make_unique<nn::GPT>(config, options);
}

// One rank's run: every rank executes this, with its own Context and group handle.
void train(dist::ProcessGroup& group, const Flags& f) {
  const Device device(f.device);
  ZG_CHECK(device.type != DeviceType::meta, "train_zero: --device meta holds no values to train; use cpu or cuda");
  const auto writer = f.claim_save("train_zero", group, device);
  const bool printer = group.rank() == 0;
  examples::TextData data("train_zero", f.data, f.seq);  // every rank reads the same global batches
  manual_seed(f.seed);

  // Under --pp a rank holds its stages alone: the model is built deferred (no bytes), and its
  // ShardedModel fills only its own chunks' values -- an eager build's values (tensor/deferred.h).
  std::optional<DeferredInit> nothing_allocated;
  if (f.pp > 1 && f.init.empty()) nothing_allocated.emplace();
  const std::unique_ptr<nn::CausalLM> built = make_model(f, device);
  nn::CausalLM& model = *built;
  nothing_allocated.reset();
  const int64_t parameters = model.num_parameters();  // the whole model's, before any cut
  if (!f.init.empty() && group.rank() == 0) nn::load_state(model, f.init);  // rank 0's weights become every rank's
  // --tp, --cp, --pp: [pp x] dp_replicate x dp_shard (S = --shard-group, or every data-parallel rank) [x cp] [x tp].
  const std::unique_ptr<dist::DeviceMesh> mesh =
      f.tp > 1 || f.pp > 1 || f.cp > 1
          ? dist::training_mesh(group, {.pp = static_cast<int>(f.pp), .tp = static_cast<int>(f.tp),
                                        .cp = static_cast<int>(f.cp), .shard_group_size = static_cast<int>(f.shard_group)})
          : nullptr;
  if (f.tp > 1) {  // each layer cut across the tp group (every rank built the same model from one seed)
    nn::ParallelPlan plan = model.parallel_plan();
    plan.sequence_parallel = f.sequence_parallel;
    dist::parallelize_module(model, mesh->group("tp"), plan);
  }
  if (f.cp > 1) dist::parallelize_context(model, mesh->group("cp"), dist::parse_context_variant(f.cp_variant));
  // --pp, --micro-batches: the model cut into stages; this rank runs its chunks in the schedule's order.
  dist::SingleRank one_stage;
  dist::ProcessGroup& pp = f.pp > 1 ? mesh->group("pp") : one_stage;
  const dist::Schedule schedule = dist::make_schedule(dist::parse_schedule(f.schedule), static_cast<int>(f.pp),
                                                      static_cast<int>(f.micro_batches), static_cast<int>(f.chunks));
  const dist::Stages stages = !f.pipelined()        ? dist::Stages()
                              : f.model == "llama" ? dist::llama_stages(static_cast<nn::Llama&>(model), schedule.stages())
                                                   : dist::gpt_stages(static_cast<nn::GPT&>(model), schedule.stages());
  const auto chunks = f.pipelined() ? stages.chunks(schedule, pp.rank()) : std::vector<std::shared_ptr<nn::Module>>();
  const std::shared_ptr<nn::Module> held = f.pipelined() ? dist::join_chunks(chunks) : nullptr;
  nn::Module& trained = held ? *held : model;
  // The parameters move into flat units, sharded as the stage says; rank 0's initial
  // weights become every rank's.
  f.cap_host_pool();
  dist::ShardedModel sharded = mesh ? dist::ShardedModel(trained, *mesh, zero_config(f))
                                    : dist::ShardedModel(trained, group, zero_config(f));
  const std::unique_ptr<dist::Pipeline> pipeline =
      f.pipelined() ? std::make_unique<dist::Pipeline>(pp, schedule, chunks, stages.loss) : nullptr;
  const examples::RunRecord record(f.layers, f.heads, f.embd, f.seq);  // what a checkpoint records, as train_gpt's
  int64_t first_step = 0;
  if (!f.resume.empty()) {
    const Metadata meta = sharded.load(f.resume);
    first_step = record.resume("train_zero", f.resume, meta, data).value_or(0);
    ZG_CHECK(first_step < f.steps, "train_zero: ", f.resume, " is at step ", first_step, ": --steps ",
             f.steps, " leaves nothing to train");
    if (printer) std::printf("resumed from %s at step %lld\n", meta.at("path").c_str(), static_cast<long long>(first_step));
  }
  if (printer)
    std::printf("%s: %lld layers, %lld heads, n_embd %lld, %lld parameters; %s on %lld ranks, %s compute on %s%s\n",
                f.model == "llama" ? "Llama" : "GPT", static_cast<long long>(f.layers), static_cast<long long>(f.heads), static_cast<long long>(f.embd),
                static_cast<long long>(parameters), sharded.describe().c_str(),
                static_cast<long long>(group.size()), f.dtype.c_str(), device.str().c_str(),
                pipeline ? ("; " + schedule.describe()).c_str()
                : f.cp > 1 ? ("; each sequence cut across " + std::to_string(f.cp) + " cp ranks (" + f.cp_variant + ")").c_str()
                           : "");

  // Data-parallel rank d takes rows [d B / D, (d + 1) B / D); its tp and pp ranks alike, its
  // cp ranks their pieces of them.
  const int64_t data_ranks = group.size() / (f.tp * f.cp * f.pp), rows = f.batch / data_ranks;
  const int64_t first_row = group.rank() % (data_ranks * f.cp * f.tp) / (f.cp * f.tp) * rows;
  const int cp_rank = mesh ? mesh->coordinate("cp") : 0;
  double loss_value = NAN;
  examples::RunTrace trace(f, group);
  for (int64_t step = first_step; step < f.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    Context::current().allocator(device)->reset_peaks();
    const auto [inputs, targets] = data.next_batch(f.batch, f.seq, device);  // the global batch

    sharded.zero_grad();
    const double lr = optim::warmup_cosine_lr(step, f.lr, f.min_lr, f.warmup, f.steps);
    if (f.update_in_backward) sharded.step_in_backward(lr);
    Tensor loss;
    {
      MemoryScope scope(MemoryCategory::activation);
      const Tensor x = dist::context_shard(inputs.narrow(0, first_row, rows), cp_rank, static_cast<int>(f.cp));
      const Tensor y = dist::context_shard(targets.narrow(0, first_row, rows), cp_rank, static_cast<int>(f.cp));
      if (pipeline) {  // every micro-batch's forward and backward, in the schedule's order
        loss = full({1}, pipeline->run(x, y), DType::f64);
      } else {
        {
          std::optional<OffloadSavedTensors> offloaded;  // --offload-activations
          if (f.offload_activations) offloaded.emplace();
          loss = model.forward(x, y).loss;
        }
        loss.backward();  // gathers and reductions run from hooks as the backward goes
      }
    }
    const dist::StepResult result = sharded.step(lr);  // global norm, clip, AdamW on this rank's slices
    // The global batch's loss: the mean of the ranks' means (they take equal tokens; tp and pp ranks the same ones).
    Tensor global_loss = loss.detach().reshape({1}).to(DType::f32).to(device);
    group.all_reduce(global_loss, dist::ReduceKind::average);
    loss_value = global_loss.item<double>();

    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (printer) {
      std::printf("step %4lld/%lld | loss %.4f | norm %6.3f | %7.0f tok/s | lr %.2e | %s%s\n",
                  static_cast<long long>(step + 1), static_cast<long long>(f.steps), loss_value, result.grad_norm,
                  static_cast<double>(f.batch * f.seq) / seconds, lr, memory_line(device).c_str(),
                  result.stepped ? "" : " | skipped (inf/nan gradients)");
      std::fflush(stdout);
    }
    f.save_after(step + 1, sharded, record.save(data, step + 1));
  }
  trace.finish(device, "train_zero, " + sharded.describe() + ": bytes by category, steps " +
                           std::to_string(first_step + 1) + "-" + std::to_string(f.steps));
  // Every rank's model states, least and most (one collective: a max-reduction of x and -x).
  const MemoryStats s = memory_stats(device);
  const MemoryCategory shown[] = {MemoryCategory::parameter, MemoryCategory::gradient, MemoryCategory::optimizer_state};
  std::vector<double> bounds;
  for (MemoryCategory c : shown) bounds.insert(bounds.end(), {static_cast<double>(s[c]), -static_cast<double>(s[c])});
  bounds.insert(bounds.end(), {static_cast<double>(s.peak_of(MemoryCategory::communication)),
                               -static_cast<double>(s.peak_of(MemoryCategory::communication))});
  const MemoryStats host = host_memory_stats();  // offload's bytes
  for (MemoryCategory c : {MemoryCategory::gradient, MemoryCategory::optimizer_state})
    bounds.insert(bounds.end(), {static_cast<double>(host[c]), -static_cast<double>(host[c])});
  const Tensor extremes = tensor<double>(bounds).to(group.accepts(kCPU) ? kCPU : device);  // NCCL: on its GPU
  group.all_reduce(extremes, dist::ReduceKind::max);
  if (printer) {
    const std::vector<double> e = extremes.to_vector<double>();
    const auto range = [&](size_t i) {
      char text[64];
      std::snprintf(text, sizeof text, "%.2f-%.2f", -e[2 * i + 1] / (1 << 20), e[2 * i] / (1 << 20));
      return std::string(text);
    };
    std::printf("every rank (least-most MiB): param %s grad %s opt %s comm(peak) %s%s\n", range(0).c_str(),
                range(1).c_str(), range(2).c_str(), range(3).c_str(),
                f.offload == "none" ? "" : (" | host grad " + range(4) + " opt " + range(5)).c_str());
    if (const dist::ProcessGroup* replicas = sharded.replica_group())  // hybrid: the traffic within and across
      std::printf("rank 0 sent: %.2f MiB within its shard group, %.2f MiB across the groups\n",
                  static_cast<double>(sharded.shard_group().bytes_sent()) / (1 << 20),
                  static_cast<double>(replicas->bytes_sent()) / (1 << 20));
    std::printf("%s", examples::file_tier_line(sharded).c_str());
    std::printf("final loss: %.4f\n", loss_value);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags;
    if (!parse(argc, argv, flags)) {
      usage();
      return 0;
    }
    if (flags.group == "local") {
      check_config(flags, static_cast<int>(flags.ranks));
      dist::run_local(static_cast<int>(flags.ranks), [&](dist::ProcessGroup& group) { train(group, flags); });
      return 0;
    }
#if ZG_HAVE_MPI
    ZG_CHECK(flags.group == "nccl" || Device(flags.device).type == DeviceType::cpu, "train_zero: --group mpi moves CPU "
             "tensors; --device ", flags.device, " takes --group nccl");
    // One rank per process: an error is printed by its rank and sent to the others (run_mpi).
    return dist::run_mpi([&](dist::ProcessGroup& host) {
      ZG_CHECK(flags.ranks == 0 || flags.ranks == host.size(), "train_zero: --ranks ", flags.ranks, " but mpirun started ",
               host.size(), " processes");
      check_ranks(flags, host.size());
      check_config(flags, host.size());
      if (flags.group == "mpi") return train(host, flags);
#if ZG_HAVE_CUDA
      // Rank r on its node's GPU r; the NCCL id goes out over MPI (bootstrap checks a GPU each).
      Flags mine = flags;
      mine.device = Device(DeviceType::cuda, dist::node_local_rank(host.rank())).str();
      const std::unique_ptr<dist::NcclGroup> nccl = dist::NcclGroup::bootstrap(host, Device(mine.device));
      train(*nccl, mine);
#else
      fail("train_zero: --group nccl needs a build with CUDA");
#endif
    });
#else
    fail("train_zero: --group mpi: this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::cerr << e.what() << "\n";
    return 1;
  }
}
