// ShardedModel: a model's parameters stored in flat, sharded units -- the heart
// of the design (../shared/DESIGN.md, "Parameters live in flat, sharded units").
//
// Each unit (by default: each transformer block, plus a root unit with everything
// else -- for a GPT the tied embedding/head, wpe and ln_f) owns one flat buffer per
// role, padded to a multiple of the world size N; rank r owns slice r of length
// S = padded / N. The stages differ only in which roles are sharded and when full
// buffers exist (bytes per parameter per rank, bf16 compute):
//
//   stage  compute params        grads                                  master+m+v (f32)
//   0 DDP  full                  full, all-reduced                      full       2 + 2 + 12
//   1      full                  full, reduce-scattered into slice r    shard      4 + 12/N
//   2      full                  full unit only during its backward,    shard      2 + 14/N
//                                then reduce-scattered and freed
//   3      shard; full unit gathered (`communication`) before its       shard      16/N
//          forward and again before its backward, freed after each
//
// Gradients are reduced from post-accumulate-grad hooks as soon as a unit's last
// parameter gradient has landed, so the collective of one unit overlaps the
// backward of the next. The optimizer sees only spans of the local slices.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "nn/module.h"
#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "tensor/safetensors.h"

namespace zg::dist {

struct ZeroConfig {
  int stage = 0;                      // 0 = DDP, 1, 2, 3
  DType compute_dtype = DType::bf16;  // parameters and gradients; master and Adam state are f32 (f64 for f64)
  optim::AdamWOptions adamw;
  double max_grad_norm = 0;  // global-norm clipping over all shards; 0 disables
};

struct StepResult {
  double grad_norm = 0;  // global, unscaled, before clipping (identical on every rank)
  bool stepped = true;   // false when the gradients held inf/NaN (the step was skipped)
};

class ShardedModel {
 public:
  // `unit_modules`: paths of the submodules that become units, in forward order; every
  // parameter outside them goes to the root unit. Every rank must pass the same model
  // (same initial values: seed every rank alike).
  ShardedModel(nn::Module& model, std::vector<std::string> unit_modules, ProcessGroup& group, ZeroConfig config);
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  // Call before each forward: with ZeRO-3 it gathers the root unit.
  void prepare_forward();
  // Gradient accumulation: with sync off, stages 0 and 1 keep accumulating full
  // gradients locally; turn it back on for the last micro-batch.
  void set_gradient_sync(bool sync) { sync_ = sync; }
  void zero_grad();
  // Norm (reduced across ranks), inf/NaN check, clipping, AdamW on the local slices,
  // then (stages 1, 2) all-gather of the updated compute weights.
  StepResult step(double lr, optim::GradScaler* scaler = nullptr);

  // Every parameter's f32 master weights, gathered from all ranks (a collective).
  nn::NamedTensors gathered_master();

  // Sharded checkpoints (dist/sharded_checkpoint.cpp). save() writes, from every rank,
  // `dir/rank-R-of-N.safetensors` with the parts of each parameter's master weights and
  // Adam m, v that the rank owns, named by parameter and element offset, so load() works
  // at any world size and stage: each rank reads the pieces that overlap what it owns now.
  void save(const std::string& dir, const Metadata& extra = {});
  Metadata load(const std::string& dir);
  // One safetensors file of the full f32 weights by parameter name, written by rank 0.
  void export_consolidated(const std::string& path);
  int64_t num_parameters() const;  // Ψ, without padding
  const ZeroConfig& config() const { return config_; }

  struct Unit;

 private:
  void build_unit(Unit& unit);
  void on_grad_arrival(Unit& unit);
  void reduce_unit(Unit& unit);
  void gather_unit(Unit& unit);
  void release_unit(Unit& unit);
  void refresh_compute();  // compute weights from master after a load

  nn::Module& model_;
  ProcessGroup& group_;
  ZeroConfig config_;
  std::vector<std::unique_ptr<Unit>> units_;
  bool sync_ = true;
  int64_t step_ = 0;
  // The hooks left on the model's parameters and modules hold a weak reference to this:
  // after the ShardedModel is gone they do nothing.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

// The default units of a GPT: transformer.h.0 ... transformer.h.{n_layer-1}.
std::vector<std::string> gpt_block_units(int64_t n_layer);

}  // namespace zg::dist
