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
// Gradients are reduced from post-accumulate-grad hooks once a bucket (DDP) or a unit
// (ZeRO) has all its gradients and the buckets before it in the one order every rank
// uses have been reduced: the collective runs on the group's communication worker while
// the backward of the next unit goes on. The backward's end reduces every bucket still
// waiting, so every reduction has finished when backward() returns. The optimizer sees spans of the
// whole buffers for DDP, of the local slices for ZeRO.
//
// ZeRO-3 gathers a unit around each use (dist/parameter_gather.cpp): before a
// block's forward (prefetching the next `prefetch` blocks) and, if its backward
// reads weights, when the gradient of its output arrives (prefetching the blocks
// before it); it frees the gathered copy after the forward and after the block's
// backward. The root unit is gathered around the modules that use it (UnitPlan).
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/graph.h"
#include "dist/comm/process_group.h"
#include "nn/module.h"
#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "tensor/safetensors.h"

namespace zg::dist {

struct ZeroConfig {
  int stage = 0;                      // 0 = DDP, 1, 2, 3
  DType compute_dtype = DType::bf16;  // parameters and gradients; master and Adam state are f32 (f64 for f64)
  optim::AdamWOptions adamw{};
  double max_grad_norm = 0;  // global-norm clipping over all shards; 0 disables
  // Gradients are reduced in this dtype (e.g. f32 for bf16 compute: exact sums, twice
  // the traffic), in `communication` buffers, then rounded back. Unset: the compute dtype.
  std::optional<DType> reduce_dtype{};
  // DDP (stage 0): gradients are all-reduced in buckets of about this many bytes,
  // each started once its last gradient lands and the ones before it have started
  // (PyTorch DDP's default, 25 MiB).
  // ZeRO stages reduce-scatter whole units (a unit's shard layout spans the unit).
  int64_t bucket_bytes = 25 << 20;
  // ZeRO-3: how many units ahead (in forward order, or behind in backward) are
  // all-gathered while the current one computes. 0: gather each just in time.
  int prefetch = 1;
};

// How a model's parameters are split into units, and where the forward uses the rest.
struct UnitPlan {
  // Submodules that become units, in forward order (for a GPT: each block).
  std::vector<std::string> units{};
  // Every other parameter forms the root unit. ZeRO-3 gathers it around the modules
  // that use it: `root_before` run before the units (a GPT's token and position
  // embeddings), `root_after` after them (the final norm; the tied head follows it).
  // The root is gathered for root_before and freed after them, gathered again for
  // root_after and kept through their backward (which comes next), then freed. With
  // neither given, prepare_forward() gathers it and it is kept until the backward ends.
  std::vector<std::string> root_before{}, root_after{};
};

struct StepResult {
  double grad_norm = 0;  // global, unscaled, before clipping (identical on every rank)
  bool stepped = true;   // false when the gradients held inf/NaN (the step was skipped)
};

class ShardedModel final : public ParameterOwner {
 public:
  // Every rank must pass a model of the same shape and the same config (checked, as far
  // as the units' and buffers' names and shapes: collectives, which every rank reaches
  // even when another's plan is refused); rank 0's initial parameters and buffers become
  // every rank's, as PyTorch DDP broadcasts its module states. (A forward that changes a
  // buffer changes it on its own rank: PyTorch DDP broadcasts buffers before each
  // forward, this does not.) Parameters frozen now (requires_grad false) get no gradient,
  // master or Adam state and are held in the compute dtype, untrained (unfreezing one
  // later is refused by step()): at stages 0-2 every rank holds them whole, and a unit
  // whose parameters are all frozen drops out of the plan; at stage 3 each unit shards
  // its frozen parameters in a buffer of their own, gathered with its trained ones.
  // While it lives it is the parameters' ParameterOwner: the model's zero_grad() calls
  // this one's, and moving the parameters elsewhere (Module::to, load_state) is refused.
  // Destroyed, it leaves stages 0-2's parameters holding the compute weights; ZeRO-3's
  // are left unmaterialized (each rank held a shard), so save or export first.
  ShardedModel(nn::Module& model, const UnitPlan& plan, ProcessGroup& group, ZeroConfig config);
  ~ShardedModel() override;
  std::string describe() const override;  // "a ZeRO-2 ShardedModel"

  // Call before each forward: with ZeRO-3 it frees units left gathered by an earlier
  // forward that had no backward, and gathers a root unit that has no modules in the plan.
  void prepare_forward();
  // Gradient accumulation: with sync off, stages 0 and 1 keep accumulating full
  // gradients locally; turn it back on for the last micro-batch (step() refuses to run
  // after a backward whose gradients were never reduced). Leaving it on for every
  // micro-batch is correct too, at the cost of a reduction per micro-batch. Stages 2 and
  // 3 ignore it: keeping no full gradient between micro-batches is the memory they save,
  // so each micro-batch is reduce-scattered and added into the rank's shard.
  void set_gradient_sync(bool sync) { sync_ = sync; }
  // Also what the model's Module::zero_grad() calls (ParameterOwner).
  void zero_grad() override;
  // Norm (reduced across ranks), inf/NaN check, clipping, AdamW on the local slices,
  // then (stages 1, 2) all-gather of the updated compute weights.
  StepResult step(double lr, optim::GradScaler* scaler = nullptr);

  // Every trained parameter's master weights (f32; f64 for f64 compute), gathered from
  // all ranks (a collective): a copy, which later steps leave as it is.
  nn::NamedTensors gathered_master();

  // ZeRO-3: every unit's full compute weights, gathered (into `communication`, a
  // collective) and kept while the returned scope lives, as FSDP's summon_full_params:
  // the model's parameters hold their values, to be read, and the forwards and backwards
  // under it (evaluation, generation) gather nothing; a step() under it gathers the
  // updated weights. They are copies, released when the scope ends, so a write to one
  // would be lost: step() refuses to run after one, on every rank, until a load() (as it
  // refuses a write to 16-bit compute weights at stages 0-2). At stages 0-2 the full
  // weights are always there: the scope does nothing. Scopes nest.
  class FullParameters {
   public:
    FullParameters(FullParameters&& other) noexcept : model_(std::exchange(other.model_, nullptr)), alive_(other.alive_) {}
    FullParameters(const FullParameters&) = delete;
    FullParameters& operator=(const FullParameters&) = delete;
    ~FullParameters();

   private:
    friend class ShardedModel;
    explicit FullParameters(ShardedModel* model) : model_(model), alive_(model ? model->alive() : std::weak_ptr<ParameterOwner>()) {}
    ShardedModel* model_;  // null: nothing to release
    std::weak_ptr<ParameterOwner> alive_;
  };
  [[nodiscard]] FullParameters summon_full_params();

  // Sharded checkpoints (dist/sharded_checkpoint.cpp). save() writes, from every rank,
  // `dir/rank-RRRRR-of-NNNNN.safetensors` (zero-padded) with the parts of each parameter's
  // master weights and Adam m, v that the rank owns (and at stage 3 of the frozen weights
  // it holds), named by parameter and element offset, so load() works at any world size
  // and stage: each rank reads the pieces that overlap what it holds now. Rank 0's file
  // also holds the frozen parameters every rank holds whole, and the buffers.
  //  - A parameter trained in the save and frozen in the model loads its master weights.
  //  - A save replaces the checkpoint in `dir`, whatever its world size: once every rank
  //    has written its file, rank 0 removes the files of an earlier save of another N.
  //  - The files of one save share an id: load() refuses files of different saves.
  //  - With a GradScaler, its scale and count are saved, and loaded into an enabled
  //    scaler (as optim::save_checkpoint and load_checkpoint).
  //  - The generator state is saved per rank; at a larger world size, the ranks the save
  //    did not have take the last saved rank's (reseed them if they need streams apart).
  void save(const std::string& dir, const Metadata& extra = {}, const optim::GradScaler* scaler = nullptr);
  Metadata load(const std::string& dir, optim::GradScaler* scaler = nullptr);
  // The whole model, gathered on every rank (a collective), by name: every parameter's
  // weights -- the master weights of the trained ones, the frozen ones in the master
  // dtype -- and the buffers; what nn::load_state reads. A copy, which later steps leave
  // as it is (FSDP's full state dict).
  nn::NamedTensors consolidated_state();
  // consolidated_state() in one safetensors file, written by rank 0 a unit at a time as
  // the units are gathered: no rank holds more than one unit's weights at once (a
  // collective).
  void export_consolidated(const std::string& path);
  int64_t num_parameters() const;  // Ψ, without padding
  const ZeroConfig& config() const { return config_; }

  struct ShardedWeights;
  struct Unit;
  struct Bucket;
  struct Use;

 private:
  // The consolidated state a unit at a time (a collective): fn(name, weights) for each
  // of its tensors, in consolidated_layout()'s order. `weights` lives during the call
  // only: at stages 1-3 a view of one unit's buffer, all-gathered into `communication`
  // and released once the unit is done.
  void for_each_consolidated(const std::function<void(const std::string&, const Tensor&)>& fn);
  std::vector<SafetensorsWriter::Layout> consolidated_layout() const;  // names, dtypes, shapes
  // `shard` of every rank, whole, in a new buffer of `category` (a collective, tagged `tag`).
  Tensor all_gathered(const Tensor& shard, int64_t tag, MemoryCategory category);
  void plan_units(nn::Module& model, const nn::NamedTensors& parameters, const UnitPlan& plan,
                  const std::vector<std::pair<std::string, nn::Module*>>& modules);
  void build_unit(Unit& unit);
  int64_t padded_to_ranks(int64_t numel) const;  // rounded up to a multiple of N
  Tensor rank0_values(const std::vector<optim::FlatParameters::Entry>& entries, int64_t padded, DType dtype,
                      Device device, int64_t tag);
  void place_weights(ShardedWeights& weights, const std::vector<optim::FlatParameters::Entry>& entries,
                     const Tensor& values);
  DType reduce_dtype() const { return config_.reduce_dtype.value_or(config_.compute_dtype); }

  // Gradient reduction (dist/gradient_reduction.cpp).
  void plan_buckets(Unit& unit);
  void plan_reduce_order(const nn::NamedTensors& parameters);  // reduce_order_
  void allocate_grad_full(Unit& unit);                          // stages 2, 3
  void note_backward();  // queues the backward's end, once per pass
  void on_grad_arrival(Unit& unit, size_t entry);
  void reduce_after_backward(Unit& unit);  // ZeRO-3: the unit's backward is done
  void reduce_bucket(Unit& unit, Bucket& bucket);
  void finish_reductions(size_t keep_in_flight = 0);
  void reduce_the_rest();  // of this backward's buckets, in reduce_order_
  void end_of_backward();  // queued by a backward's first gradient (queue_backward_callback)

  // ZeRO-3 parameter gathering (dist/parameter_gather.cpp).
  // The uses of each unit in forward order (checks the plan's module paths; hooks nothing).
  void plan_uses(const UnitPlan& plan, const std::vector<std::pair<std::string, nn::Module*>>& modules,
                 bool root_replicated);
  void hook_use(size_t index);  // gathers and releases uses_[index]'s unit around its forward and backward
  void hook_holders(const std::vector<std::pair<std::string, nn::Module*>>& modules);  // checks the plan covers them
  static bool is_current(Unit& unit);
  static std::string release_note(const Unit& unit);  // when a unit's full weights exist
  void gather_unit(Unit& unit);
  void prefetch_unit(Unit& unit);
  void prefetch(ShardedWeights& weights);
  void finish_gathers(Unit& unit);  // waits for its gathers in flight
  void release_unit(Unit& unit);
  void prefetch_from(size_t use, int direction);

  // Frozen parameters held whole on every rank (stages 0-2; at 3 those of an integer
  // dtype), then buffers, each keyed as checkpoints name it: "frozen/<name>", "buffer/<name>".
  nn::NamedTensors replicated() const;
  void broadcast_replicated();  // rank 0's, to every rank
  void refresh_compute();    // compute weights from master after a load
  // With 16-bit compute, step() rewrites the compute weights from the master, so a write
  // to a parameter since our last write (fill_, copy_, an init) would be lost: step()
  // refuses it on every rank alike. Stages 0-2 (at 3, weights exist only in use).
  bool compute_written_by_others() const;
  void mark_compute_current();  // and, while summoned (ZeRO-3), gathers the units again
  void end_summon();            // the last FullParameters scope ended: release, noting writes

  ProcessGroup& group_;
  ZeroConfig config_;
  // The model's replicated frozen parameters (in the compute dtype, if floating) and
  // buffers: the same on every rank from construction on, and saved, loaded and exported
  // with the trained parameters.
  nn::NamedTensors frozen_, buffers_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<Use> uses_;  // ZeRO-3: where the forward uses each unit, in forward order
  // Reductions issued and not yet finished, oldest first; each finishes with `then`
  // (rounding a reduce-dtype result back, adding a shard into the gradient shard).
  struct InFlight {
    WorkHandle work;
    std::function<void()> then;
  };
  std::deque<InFlight> in_flight_;
  // Every bucket, in the one order all ranks reduce them in (plan_reduce_order); the
  // first `reduced_` have been reduced in this backward.
  std::vector<std::pair<Unit*, Bucket*>> reduce_order_;
  size_t reduced_ = 0;
  bool in_backward_ = false;  // a gradient has landed since the last backward's end
  std::weak_ptr<void> end_of_backward_queued_;  // live while this backward's end is queued
  bool sync_ = true;
  bool unsynced_ = false;  // stages 0, 1: the last backward kept its gradients local (sync off)
  int summoned_ = 0;       // ZeRO-3: FullParameters scopes alive; while > 0 no unit is released
  bool written_while_summoned_ = false;  // ZeRO-3: a summoned unit's weights were written (lost)
  int64_t step_ = 0;
};

// A GPT's plan: units transformer.h.0 ... transformer.h.{n_layer-1}; the root (tied
// token embedding and head, position embedding, final norm) used by wte and wpe
// before the blocks and by ln_f (and the head) after them.
UnitPlan gpt_unit_plan(int64_t n_layer);

}  // namespace zg::dist
