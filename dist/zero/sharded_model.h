// ShardedModel: a model's parameters stored in flat, sharded units -- the heart
// of the design (docs/design.md, "Parameters live in flat, sharded units").
//
// Each unit (by default: each transformer block, plus a root unit with everything
// else: embeddings, a final norm, a tied head) owns one flat buffer per
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
// The ranks are a device mesh of dp_replicate x dp_shard (dist/comm/device_mesh.h): the
// units shard over dp_shard's S ranks, the table's N read as S, and with hybrid sharding
// (HSDP / MiCS, R = N / S > 1, stages 2-3) each gradient shard is also all-reduced across
// dp_replicate's R groups. Given a group and ZeroConfig::shard_group_size, the model
// makes that mesh itself.
//
// ZeRO-3 gathers a unit around each use (dist/zero/gather_scheduler.h). Which
// parameters form which unit is the planner's (dist/zero/planner.h); what each stage
// keeps where is the placement policy's (dist/zero/placement.h); the unit
// (dist/zero/unit.h) owns its buffers and their lifecycle; the schedulers
// (gradient_reducer.h, gather_scheduler.h) decide when. This class is built in
// sharded_model.cpp, steps in sharded_step.cpp, and saves and loads in
// sharded_checkpoint.cpp. One rank is the same code with a group of one
// (dist::SingleRank): there is one training path.
//
// A model built under DeferredInit (nothing allocated) is materialised here unit by
// unit, each rank allocating only what the placement gives it: its initial values are
// a one-rank build's at any N (Philox: element i depends on the seed, the parameter
// and i only).
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "autograd/graph.h"
#include "dist/comm/device_mesh.h"
#include "dist/comm/process_group.h"
#include "dist/zero/placement.h"
#include "dist/zero/zero_config.h"
#include "nn/module.h"
#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "tensor/file_tier.h"
#include "tensor/safetensors.h"

namespace zg::dist {

using nn::UnitPlan;
// dist/zero/unit.h, gradient_reducer.h, gather_scheduler.h: the library's own.
class Unit;
struct UnitContext;
class GradientReducer;
class UpdateWorker;
class GatherScheduler;
struct ShardingPlan;
namespace checkpoint {
struct PieceIndex;
}

struct StepResult {
  double grad_norm = 0;  // global, unscaled, before clipping (identical on every rank)
  bool stepped = true;   // false when the gradients held inf/NaN (the step was skipped)
};

class ShardedModel final : public ParameterOwner {
 public:
  // Every rank must pass a model of the same shape and the same config (checked, as far
  // as the units' and buffers' names and shapes: collectives, which every rank reaches
  // even when another's plan is refused). A model built under DeferredInit is
  // materialised here, each rank allocating and filling only what it holds; otherwise
  // rank 0's initial parameters and buffers become every rank's, as PyTorch DDP
  // broadcasts its module states. (A forward that changes a
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
  // The units come from the model's own plan (Module::unit_plan), or from `plan`.
  //   Over a DeviceMesh, the units shard over its dp_shard dimension and replicate over
  // dp_replicate (which may be missing: size 1); config.shard_group_size is then dp_shard's
  // size (0 or that size; another is refused). Over a group, the mesh is dp_replicate N / S
  // x dp_shard S, S = shard_group_size (0: N). The group or mesh must outlive the model: a
  // model used after its groups were destroyed throws zg::Error (as it ends, it uses none).
  //   Tensor parallelism: a mesh may also have a tp dimension (innermost), over whose group
  // the model was cut by dist::parallelize_module first. Each rank's slices are then its
  // parameters, sharded over the data-parallel dimensions like any others, and the gradient
  // norm is the whole model's (the cut parameters' squares summed over tp, the ones every
  // tp rank holds counted once).
  //   Context parallelism: a mesh may also have a cp dimension (right after dp_shard), over
  // whose group dist::parallelize_context cut the model's sequences. The units then shard
  // over dp_shard x cp, its gradients averaged over both.
  //   Pipeline parallelism: a mesh may also have a pp dimension (outermost), each rank's
  // model then being the chunks it runs (dist::join_chunks, dist/pipeline/stages.h). The
  // model shards over the other dimensions; the gradient norm, and so clipping and the loss
  // scaler's inf check, is the whole pipeline's; the plan's tied units (UnitPlan::tied: a
  // tied embedding) have their reduced gradients summed between the first and the last pp
  // rank before the step, so both copies take the same step.
  ShardedModel(nn::Module& model, ProcessGroup& group, ZeroConfig config = {});
  ShardedModel(nn::Module& model, const UnitPlan& plan, ProcessGroup& group, ZeroConfig config = {});
  ShardedModel(nn::Module& model, DeviceMesh& mesh, ZeroConfig config = {});
  ShardedModel(nn::Module& model, const UnitPlan& plan, DeviceMesh& mesh, ZeroConfig config = {});
  ~ShardedModel() override;
  std::string describe() const override;  // "a ZeRO-2 ShardedModel"

  // Gradient accumulation (FSDP2's set_requires_gradient_sync): with sync off a backward
  // reduces nothing and each unit keeps its full gradient (at ZeRO-2, 3 too: memory for
  // traffic); the last micro-batch, synced, reduces the sum once. step() refuses to run
  // after an unsynced backward.
  void set_gradient_sync(bool sync);
  bool gradient_sync() const;
  // Whether a Pipeline turns sync off for all but a step's last backward: stages 0, 1
  // always; stages 2, 3 with ZeroConfig::reduce_once.
  bool reduces_once() const { return !placement().frees_full_gradients() || config_.reduce_once; }
  // Also what the model's Module::zero_grad() calls (ParameterOwner).
  void zero_grad() override;
  // Norm (reduced across ranks), inf/NaN check, clipping, AdamW on the local slices,
  // then (stages 1, 2) all-gather of the updated compute weights.
  StepResult step(double lr, optim::GradScaler* scaler = nullptr);
  // The same step without reading anything back: the global norm and the clipping
  // coefficient stay on the device, so a GPU step issues its kernels and returns (no loss
  // scaler: its inf check needs the host; a non-finite norm updates unclipped). Returns
  // the norm, one element of the master dtype (f32; f64 for f64 compute), for the caller
  // to read when it chooses.
  Tensor step_on_device(double lr);
  // ZeRO-Offload's overlap on the host side: the next backward runs each unit's AdamW with
  // `lr` as soon as its gradient shard has landed, on a host thread of its own (the CPU
  // AdamW, offloaded), while the backward goes on; step(lr) then waits for the last update
  // and finishes (ZeRO-1, 2's gathers, the step count, the norm it reports). The same bits
  // as step(lr) after the backward. Only where no update must wait for all the gradients:
  // no clipping (ZeroConfig::max_grad_norm 0), no loss scaler, stages 1-3, gradient sync
  // on, no pipeline, no file tier (yet). A non-finite gradient is applied, as there is no
  // norm to check first; a backward that throws leaves some units updated (load a checkpoint).
  void step_in_backward(double lr);

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

  // Sharded checkpoints (dist/zero/sharded_checkpoint.cpp, checkpoint/). save()
  // writes, from every rank, `dir/<save>/rank-RRRRR-of-NNNNN.safetensors` (zero-padded),
  // <save> = step-<step>-<id>, with the parts of each parameter's master weights and Adam
  // m, v that the rank owns (and at stage 3 of the frozen weights it holds), named by
  // parameter and element offset, so load() works at any world size and stage: each rank
  // reads the pieces that overlap what it holds now. Rank 0's file also holds the frozen
  // parameters every rank holds whole, and the buffers.
  //  - Saves are committed whole: once every rank's file is durable, rank 0 renames
  //    `dir/latest` to name the new save; only then are older saves removed (all but the
  //    newest `keep`) and folders of saves killed part-way. A kill at any moment leaves
  //    the previous save or the new one loadable. A save that fails on any rank (a full
  //    disk) removes its folder, with the files other ranks finished.
  //  - One job writes a folder: save() holds its CheckpointWriterLock (writer_lock.h) for
  //    the save, shared with one the job holds for its life; another job's is refused.
  //  - load(dir) reads the save `dir/latest` names (current_save(dir) says which; the
  //    returned metadata's "path" too); `dir` may also be one save's folder, or a
  //    directory of rank files of an earlier version.
  //  - Loads are all-or-nothing: every file's header, every shape and dtype, and the
  //    checksum of every byte a rank will read are checked before anything changes; then
  //    either every rank loads or every rank throws, with the failing rank's reason.
  //  - A parameter trained in the save and frozen in the model loads its master weights.
  //  - With a GradScaler, its scale and count are saved, and loaded into an enabled
  //    scaler (a disabled one has no state).
  //  - The generator state is saved per rank; at a larger world size, the ranks the save
  //    did not have take the last saved rank's (reseed them if they need streams apart).
  //  - Hybrid sharding: a file per rank of the shard group (NNNNN = S), written by the first
  //    group alone (the others hold the same slices); its generator states are that group's.
  //  - Tensor parallelism: a file per tp rank and shard rank (NNNNN = T S); a cut
  //    parameter's pieces are numbered in the order of its slices one after another, its
  //    cut recorded (checkpoint/slice_order.h), so a save loads at any other tp, 1 included.
  //  - load() also takes, as `dir`, the single file of the former optim::save_checkpoint
  //    (format zerograd-training-checkpoint-1), at any world size and stage.
  void save(const std::string& dir, const Metadata& extra = {}, const optim::GradScaler* scaler = nullptr,
            int keep = 1);
  Metadata load(const std::string& dir, optim::GradScaler* scaler = nullptr);
  // The save load(dir) reads: the folder `dir/latest` names, or `dir` itself (a save's
  // folder, or a single file); a zg::Error when `dir` holds no complete save.
  static std::string current_save(const std::string& dir);
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
  // Offload nvme: the file tier's figures (the bytes it holds, read and written, and how
  // long); all zeros without one.
  FileTierStats file_tier_stats() const;
  // Elements of the largest unit's slice on this rank: a unit's state at offload nvme is
  // this times 12 bytes (master, m, v) plus the gradient shard's.
  int64_t largest_shard() const;
  int64_t steps() const { return step_; }  // optimizer updates taken (a resumed run: the saved count)
  const ZeroConfig& config() const { return config_; }
  const Placement& placement() const;
  // The groups the units use: the mesh's dp_shard (S ranks; dp_shard x cp with a cp
  // dimension) and dp_replicate (N / S
  // ranks; null without hybrid sharding). Their bytes_sent() split the traffic into within
  // and across shard groups.
  const DeviceMesh& mesh() const { return mesh_; }
  ProcessGroup& shard_group() const { return **shard_; }
  ProcessGroup* replica_group() const { return replicas_ ? &**replicas_ : nullptr; }
  ProcessGroup* tensor_parallel_group() const { return tp_ ? &**tp_ : nullptr; }  // the mesh's tp; null at T = 1
  ProcessGroup* pipeline_group() const { return pp_ ? &**pp_ : nullptr; }  // the mesh's pp; null at P = 1
  // hpZ, qgZ (null without them): the shard group's ranks on this rank's node, whose
  // bytes_sent() stay within it, and those of its node rank on every node, whose go across.
  ProcessGroup* node_group() const { return node_.get(); }
  ProcessGroup* across_group() const { return across_.get(); }

 private:
  // The consolidated state a unit at a time (a collective): fn(name, weights) for each
  // of its tensors, unit by unit (consolidated_layout() puts them in the model's order). `weights` lives during the call
  // only: at stages 1-3 a view of one unit's buffer, all-gathered into `communication`
  // and released once the unit is done.
  void for_each_consolidated(const std::function<void(const std::string&, const Tensor&)>& fn);
  std::vector<SafetensorsWriter::Layout> consolidated_layout() const;  // names, dtypes, shapes
  Shape whole_shape(const std::string& name, Shape shape) const;       // a cut parameter's before the cut
  Tensor begin_step(double lr, const optim::GradScaler* scaler);  // checks; the global squared norm
  double gradient_multiplier(const optim::GradScaler* scaler) const;
  void update(double lr, double grad_scale, const Tensor& device_scale);
  // `shard` of every rank, whole, in a new buffer of `category` (a collective, tagged `tag`).
  Tensor all_gathered(const Tensor& shard, int64_t tag, MemoryCategory category);
  ShardedModel(nn::Module& model, const UnitPlan& plan, DeviceMesh* mesh, std::unique_ptr<DeviceMesh> own,
               ZeroConfig config);
  // The config checked and the model planned into units (the planner), on every rank
  // alike before any parameter moves; then the units, their buffers and the schedulers.
  void build(nn::Module& model, const UnitPlan& plan);
  void make_node_groups();
  void make_units(nn::Module& model, const UnitPlan& plan, ShardingPlan planned, Device device);
  void agree_on_plan(Device device);  // every rank built the same units from the same config
  void materialize(Unit& unit);
  void plan_tensor_parallel_norm();  // norm_runs_
  Tensor squared_norm(size_t unit) const;  // of this rank's gradient shard of units_[unit], weighted (f64)
  Tensor global_squared_norm();            // summed over the units and across ranks (a collective)
  void find_tied_units(const UnitPlan& plan);
  void check_stages_cover(const checkpoint::PieceIndex& index) const;  // load(), with pp
  void sum_tied_gradients();  // with the other end of the pipeline: the same sum on both
  ProcessGroup& data_group() const { return data_ ? **data_ : *group_; }

  // Frozen parameters held whole on every rank (stages 0-2; at 3 those of an integer
  // dtype), then buffers, each keyed as checkpoints name it: "frozen/<name>", "buffer/<name>".
  nn::NamedTensors replicated() const;
  void materialize_replicated();  // deferred ones filled; eager ones rank 0's, on every rank
  // With 16-bit compute, step() rewrites the compute weights from the master, so a write
  // to a parameter since our last write (fill_, copy_, an init) would be lost: step()
  // refuses it on every rank alike. Stages 0-2 (at 3, weights exist only in use).
  bool compute_written_by_others() const;
  void mark_compute_current();  // and, while summoned (ZeRO-3), gathers the units again
  void end_summon();            // the last FullParameters scope ended: release, noting writes
  // Changes whenever gradients are written: a backward pass, or (stages 0, 1) an in-place
  // write to a .grad. step() refuses to run when it has not changed since the last step or
  // zero_grad(): a step without gradients would still apply weight decay and momentum.
  uint64_t gradient_mark() const;
  std::vector<Unit*> units() const;

  std::unique_ptr<DeviceMesh> own_mesh_;  // the mesh made from a group and shard_group_size
  DeviceMesh& mesh_;
  GroupRef group_;  // one pipeline stage's ranks (the mesh's world without pp): every data-parallel rank, x tp
  std::optional<GroupRef> shard_;     // dp_shard
  std::optional<GroupRef> replicas_;  // dp_replicate, when hybrid
  std::optional<GroupRef> tp_;        // tp, when T > 1
  std::optional<GroupRef> pp_;        // pp, when P > 1; group_ is then one stage's ranks
  // hpZ, qgZ: dp_shard's ranks on this rank's node, and those of its node rank on every node.
  std::unique_ptr<ProcessGroup> node_, across_;
  int ranks_per_node_ = 0;  // of dp_shard, for them
  // Units tied with the other end of the pipeline (UnitPlan::tied), in the plan's order;
  // counted in the norm by the first pp rank only.
  std::vector<size_t> tied_units_;
  std::optional<GroupRef> data_;      // with tp: the data-parallel dimensions as one (initial values broadcast)
  // With tp: the parameters the model's plan cut (Module::named_splits), and per unit the
  // runs of this rank's gradient shard with their weight in the squared norm (1 for a cut
  // parameter, 1 / T for one every tp rank holds).
  std::unordered_map<std::string, nn::TensorSplit> splits_;
  struct NormRun {
    int64_t begin, count;
    double weight;
  };
  std::vector<std::vector<NormRun>> norm_runs_;
  ZeroConfig config_;
  std::unique_ptr<UnitContext> context_;  // what the units share: the group, the placement policy, dtypes
  // The model's replicated frozen parameters (in the compute dtype, if floating) and
  // buffers: the same on every rank from construction on, and saved, loaded and exported
  // with the trained parameters.
  nn::NamedTensors frozen_, buffers_;
  // Each name's place in named_parameters(), then named_buffers(): the order of
  // consolidated_state() and the export, as the model lists its tensors.
  std::unordered_map<std::string, size_t> state_order_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<GatherScheduler> gatherer_;  // ZeRO-3 only
  bool written_while_summoned_ = false;  // ZeRO-3: a summoned unit's weights were written (lost)
  int64_t step_ = 0;
  uint64_t gradients_used_ = 0;  // gradient_mark() after the last step or zero_grad()
  // step_in_backward: the thread running the units' updates, their lr, how many were queued.
  std::shared_ptr<UpdateWorker> early_;
  double early_lr_ = 0;
  size_t early_updates_ = 0;
  void update_early(Unit& unit);
  // The delayed parameter update (ZeroConfig::delayed_update_after): the one in flight, landed
  // (its compute weights copied up and, ZeRO-1, 2, gathered) before anything reads the state.
  std::shared_ptr<UpdateWorker> delayed_worker_;
  bool delayed_pending_ = false;
  void update_delayed(double lr, double grad_scale, const Tensor& device_scale);
  void land_delayed_update();
  StepResult finish_early_step(double lr, const optim::GradScaler* scaler);
};

}  // namespace zg::dist
