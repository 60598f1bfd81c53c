// zero_memory --plan: which setting trains a model fastest on a cluster, answered by the
// real code. Every way to split the global batch over the GPUs -- the mesh dp_replicate x
// dp_shard x cp x tp x pp, the ZeRO stage, offload, activation checkpointing, the
// micro-batch -- is a candidate; each is evaluated by a dry run on the meta device (the training step's
// own code, every byte counted: the peak is exact) whose recorded kernels and collectives the
// step-time model replays (dist/comm/step_model.h), and the candidates are ranked: those
// that fit the GPU's memory by predicted tokens/s, then those that do not.
//
//   candidates  tp within a node dividing the heads, key/value heads and the MLP; pp dividing
//               the layers; cp (each variant Ulysses' heads allow) where each rank keeps at
//               least 8,192 of a sequence's tokens; dp = N / (tp cp pp) dividing the global
//               batch's sequences; S = dp, or
//               one node's data-parallel ranks (hybrid sharding, stages 2, 3); a micro-batch
//               of b rows, M = (sequences / dp) / b of them a step (accumulated, or a 1F1B
//               pipeline's); offload only where the same setting without it does not fit
//   a candidate one dry run of rank 0 (pp > 1: and of the last stage's first rank, whose
//               head and loss weigh more); two steps, the second replayed; tensor
//               parallelism with sequence parallelism (the same bytes sent, fewer kept)
//   cost        nothing repeats between candidates (each is another program); the search
//               runs them on every core, each in a Context of its own
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "bench/model_shape.h"
#include "dist/comm/step_model.h"
#include "dist/tensor/context_parallel.h"
#include "dist/zero/zero_config.h"

namespace zg::bench {

struct Cluster {
  int gpus = 8, gpus_per_node = 8;
  int64_t gpu_memory = 80'000'000'000;  // bytes a GPU may allocate
  int64_t host_memory = 0;              // bytes of host memory a node, for offload's host pool (0: not checked)
  double peak_flops = 989e12;           // a GPU's dense bf16 peak (H100 SXM), for MFU
};

struct PlanRequest {
  ModelShape model;
  Cluster cluster;
  int64_t seq = 8192, sequences = 128;  // the global batch: sequences of seq tokens a step
};

// One way to train: the mesh, the ZeRO setting and the micro-batches.
struct Candidate {
  int tp = 1, pp = 1, dp = 1, shard_group = 1;  // dp = N / (tp cp pp) ranks, sharding over S = shard_group of them
  int cp = 1;                                   // context-parallel ranks a sequence, by cp_variant's attention
  dist::ContextVariant cp_variant = dist::ContextVariant::ring;
  int stage = 0;
  dist::Offload offload = dist::Offload::none;
  bool checkpointing = false;
  int64_t rows = 1;       // sequences a micro-batch
  int micro_batches = 1;  // a step: dp x rows x micro_batches = the global batch
  std::string setting() const;  // "ZeRO-3", "ZeRO-2 S=8", "ZeRO-1 offload optimizer", "ZeRO-3 ring"
  std::string mesh() const;     // "8x8x1x1": dp_replicate x dp_shard x tp x pp; "1x1x1x1 cp8"
};

// A candidate's dry runs and predicted step. `error`: why the code refused it (not ranked).
struct Evaluation {
  int64_t peak = 0, host_peak = 0;         // the most a rank allocates (device; host pool)
  int64_t sent_within = 0, sent_across = 0;  // bytes rank 0 sends a step within its node, across
  dist::StepTime time;                     // rank 0's step (pipeline: its wait included, as idle)
  double idle = 0;
  double tokens_per_second = 0, mfu = 0;   // the cluster's, and per GPU over its peak
  bool fits = false;       // the peak within the GPU's memory and, checked, G host pools within a node's
  bool host_fits = true;   // the G ranks' host pools within the node's --host-memory
  std::string error;
};

struct PlannedSetting {
  Candidate candidate;
  Evaluation evaluation;
};

using Evaluate = std::function<Evaluation(const Candidate&)>;

// The candidates without offload, for the model on the cluster.
std::vector<Candidate> plan_candidates(const PlanRequest& request);
// Every candidate evaluated (on `threads` threads), offload tried where a setting did not fit,
// refused ones dropped; ranked: fitting by tokens/s, then the rest by peak.
std::vector<PlannedSetting> plan(const PlanRequest& request, const Evaluate& evaluate, int threads,
                                 int* refused = nullptr);
// Why the first fitting setting wins, in sentences: its margin over the next setting of
// another kind, the part of the step that makes it, and a faster setting that does not fit.
std::string why_it_wins(const PlanRequest& request, const std::vector<PlannedSetting>& ranked);
void print_plan(const PlanRequest& request, const dist::Machine& machine, const std::vector<PlannedSetting>& ranked,
                int top, int refused, double seconds);
std::string plan_json(const PlanRequest& request, const std::vector<PlannedSetting>& ranked);
// Each setting a point: its peak (x) against tokens/s a GPU (y), the memory limit a line.
std::string plan_svg(const PlanRequest& request, const std::vector<PlannedSetting>& ranked);

}  // namespace zg::bench
