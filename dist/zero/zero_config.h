// ZeroConfig: how a ShardedModel stores and trains its parameters -- the stage, the
// dtypes, bucket and prefetch sizes, offload, hybrid sharding -- and the one check of
// which combinations are valid. Everything that accepts a configuration (ShardedModel,
// bench/zero_memory, the examples) asks ZeroConfig::problem, never rules of its own.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dist/zero/placement.h"
#include "optim/adamw.h"

namespace zg::dist {

struct ZeroConfig {
  int stage = 0;                      // 0 = DDP, 1, 2, 3
  // Parameters and gradients; master and Adam state are f32 (f64 for f64). f32 unless asked
  // (FSDP2 casts nothing by default); bf16 or f16 is mixed precision, and then a floating
  // input to the model is cast to it as it enters (FSDP2's cast_forward_inputs).
  DType compute_dtype = DType::f32;
  optim::AdamWOptions adamw{};
  double max_grad_norm = 0;  // global-norm clipping over all shards; 0 disables
  // Gradients are reduced in this dtype (e.g. f32 for bf16 compute: exact sums, twice
  // the traffic), in `communication` buffers, then rounded back. Unset: the compute dtype.
  std::optional<DType> reduce_dtype{};
  // Stages 2, 3: the gradient shard, which sums every micro-batch's reduced gradient until
  // the step, in this dtype -- f32 for bf16 compute keeps the sum exact where bf16 would
  // round at each micro-batch (DeepSpeed issue 2352), at 4 bytes a parameter / N instead of
  // 2. Unset: the compute dtype. Stages 0, 1 accumulate in the full gradient autograd
  // writes, in the compute dtype, and refuse another.
  std::optional<DType> accumulate_dtype{};
  // DDP (stage 0): gradients are all-reduced in buckets of about this many bytes,
  // each started once its last gradient lands and the ones before it have started
  // (PyTorch DDP's default, 25 MiB).
  // ZeRO stages reduce-scatter whole units (a unit's shard layout spans the unit).
  int64_t bucket_bytes = 25 << 20;
  // ZeRO-3: how many units ahead (in forward order, or behind in backward) are
  // all-gathered while the current one computes. 0: gather each just in time.
  int prefetch = 1;
  // ZeRO-Offload: optimizer places the master weights, Adam m and v and the gradient
  // shard in the rank's host pool (page-locked with a GPU), where the CPU AdamW updates
  // them; optimizer+params (stage 3) also the parameter shards, gathered to the device
  // per unit; nvme (ZeRO-Infinity) pages all of them from a file in offload_dir, a few
  // units in host memory at a time. Results are the same bit for bit as without offload.
  Offload offload = Offload::none;
  // offload nvme: the folder of the file tier's files (a fast local disk); unused on meta.
  std::string offload_dir{};
  // ZeRO-Offload's delayed parameter update (DPU), with offload optimizer: after this many
  // exact steps (the paper: 40), step() starts its update on a host thread and returns;
  // the next forward and backward run meanwhile with weights one update behind, and the
  // next step() (or a save, load or gather of the state) lands it first. Not the exact
  // update's numbers (bench/results/delayed-update-2026-11-29.md). -1: off.
  int64_t delayed_update_after = -1;
  // ZeRO-3: units whose gathered weights stay from their forward to their backward
  // (FSDP2's reshard_after_forward=False): 2Ψ elements of traffic a step for them instead
  // of 3Ψ, for holding them whole through the rest of the forward. Unit names as the
  // plan gives them ("transformer.h.11", "root"); {"*"}: every unit.
  std::vector<std::string> keep_after_forward{};
  // ZeRO-3: prefetch also stops before the units it issues would hold more than this many
  // bytes of gathered weights (DeepSpeed's stage3_prefetch_bucket_size, in bytes); 0:
  // `prefetch` alone bounds it.
  int64_t prefetch_bytes = 0;
  // Hybrid sharding (HSDP / MiCS; stages 2, 3): shard within groups of this many
  // consecutive ranks (one node's GPUs) and replicate across the N / S groups -- each
  // unit's gradient is reduce-scattered within its group, then the shard all-reduced
  // across the groups; gathers stay within. Model states per rank follow the formulas
  // with S for N; the inter-group traffic is the gradient shard's all-reduce alone.
  // 0: the whole group (S = N).
  int shard_group_size = 0;
  // Stages 2, 3 under a Pipeline: each unit's full gradient kept over the micro-batches and
  // reduced once, after the last -- 1/M of the gradient traffic for the full gradient's
  // memory. Off: each micro-batch reduce-scattered into the shard. (Stages 0, 1 always.)
  bool reduce_once = false;
  // qwZ (ZeRO++, stage 3): the weight all-gathers sent as blockwise int8, a scale per 2048
  // elements (tensor/quantize.h), dequantized on arrival into the compute dtype: about half
  // of bf16's gather bytes. The master weights, the shards and the optimizer stay exact;
  // summon_full_params() gathers exactly.
  bool quantize_weights = false;
  // hpZ (ZeRO++, stage 3): each unit's compute weights also kept in a secondary partition over
  // the S ranks of this rank's node (2Ψ/S bytes a rank beside the 16Ψ/N), filled from the
  // step's first gather of the unit (the forward's, over all N); every later gather of it until
  // the next step (the backward's) is an all-gather within the node from it. Exact: the same
  // values as the first gather (qwZ's dequantized ones with quantize_weights).
  bool secondary_weights = false;
  // qgZ (ZeRO++, stages 2, 3): the gradient reduce-scatter as two all-to-alls of blockwise
  // quantized gradients (tensor/quantize.h), this many bits (4 or 8; 0: off) -- within the node,
  // then across nodes between the ranks of one node rank -- each dequantized and summed in f32:
  // the paper's hierarchical all-to-all, about bits / 16 of bf16's bytes across nodes.
  int gradient_bits = 0;
  // qgZ's elements a scale: gradients are heavy-tailed, and int4's 7 levels a block zero most
  // of a large block (the tiny GPT after 50 steps at N = 4: 2048 ends 0.46 above the exact
  // loss, 128 0.031, 64 0.010, 32 0.002); 64 costs 4/64 bytes an element in scales.
  int64_t gradient_block = 64;
  // hpZ's and qgZ's node: S consecutive ranks of the shard group sharing one. 0: the mesh's
  // (training_mesh's ranks_per_node over the ranks between two data-parallel ones).
  int ranks_per_node = 0;

  // Every rule a configuration must keep at `world_size` ranks, in one place: "" when it
  // keeps them all, else the first it breaks, in one sentence. ShardedModel, the bench
  // and the examples all ask this one function (a unit plan's own checks are the planner's).
  std::string problem(int world_size) const;
  void check(int world_size) const;  // a zg::Error saying problem(), if any
  std::string zeropp_problem(int world_size) const;  // problem()'s part for hpZ and qgZ
  // The placement policy the stage and offload give (valid ones only: check first).
  Placement placement() const { return Placement::for_stage(stage, offload); }
  DType reduce() const { return reduce_dtype.value_or(compute_dtype); }
  DType accumulate() const { return accumulate_dtype.value_or(compute_dtype); }
};

}  // namespace zg::dist
