// The autograd graph: grad mode, the graph node, saved tensors with their version
// check. The library's ops record their nodes through record.h (not installed), a
// user's through CustomOp (custom_op.h); they keep forward and backward side by side
// (functions/*.cpp; Tensor's views in tensor_methods.cpp); engine.cpp runs a backward
// pass over them.
//
// Threads: grad mode and a running pass are per thread, and each thread may record
// and run backward on graphs of its own (the local group's ranks each train their
// own model). Two threads must not run backward into the same leaf at once: its
// .grad is accumulated without a lock (PyTorch takes one; here nothing needs it).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensor/memory_timeline.h"
#include "tensor/tensor.h"

namespace zg {

// Thread-local switch: with grad mode off, ops record nothing.
class GradMode {
 public:
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

// Sets grad mode for a scope and restores it after.
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : previous_(GradMode::is_enabled()) { GradMode::set_enabled(enabled); }
  ~GradModeGuard() { GradMode::set_enabled(previous_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

class NoGradGuard : public GradModeGuard {
 public:
  NoGradGuard() : GradModeGuard(false) {}
};

// True on a thread that is inside a backward pass (e.g. an activation-checkpointing
// recompute, whose forward hooks then know they are not in the first forward).
bool backward_in_progress();

// True while a node's formula runs whose saved tensors the engine frees as soon as it
// returns: a pass without retain_graph, with no checkpoint recompute left that could
// reach the node. Such a formula is their last reader.
bool last_use_of_saved_tensors();

// Inside a node's formula: whether this pass wants the gradient for its input i (as
// torch's ctx.needs_input_grad). backward() wants every one; a split backward's I only
// those on the path to its inputs, W only the rest (split_backward.h). A formula may
// skip an unwanted gradient -- a GEMM -- and return an undefined Tensor for it (one it
// returns anyway goes nowhere in this pass: I hands it to W). Outside a formula: true.
bool needs_input_grad(size_t i);

// Runs `fn` once the backward pass this thread is in has run its last node (the
// outermost pass, when checkpoint recomputes nest), in the grad mode and memory
// category of the caller of backward(), as PyTorch's queue_callback: DDP and ZeRO
// finish a backward's reductions there -- including buckets some of whose parameters
// got no gradient. A pass or a callback that throws drops the callbacks not yet run.
// Outside a backward pass: zg::Error.
void queue_backward_callback(std::function<void()> fn);

// Activation offload (PyTorch's save_on_cpu): while one lives on this thread, each tensor
// saved for backward whose bytes are an activation's (memory category activation or other,
// not a parameter's, gradient's or gathered weights') is copied into the rank's host pool as
// it is saved and back to its device when the backward reads it, so between the forward
// and the backward the device holds none of them. The host pool counts them as activations.
class OffloadSavedTensors {
 public:
  OffloadSavedTensors();
  ~OffloadSavedTensors();
  OffloadSavedTensors(const OffloadSavedTensors&) = delete;
  OffloadSavedTensors& operator=(const OffloadSavedTensors&) = delete;
  static bool active();

 private:
  bool previous_;
};

// A tensor kept for backward, with the storage version it had when saved.
class SavedTensor {
 public:
  SavedTensor() = default;
  // Keeps a detached handle: the same storage (so re-materialising it revives the
  // saved tensor) without the autograd links that would make a reference cycle; under
  // OffloadSavedTensors, an activation's copy in the host pool instead.
  explicit SavedTensor(const Tensor& t);
  // The tensor; throws if it was modified in place since it was saved.
  Tensor get(const std::string& op) const;
  // The tensor, for a formula that writes its result over it (cross_entropy's gradient
  // over the logits, as llm.c does: no second buffer the size of the largest activation),
  // or undefined -- and the formula allocates -- unless no one can read it again: this
  // saved tensor holds the only reference to its storage, and the running node's saved
  // tensors are freed as soon as its formula returns (last_use_of_saved_tensors).
  Tensor get_for_overwrite(const std::string& op) const;

 private:
  mutable Tensor tensor_;  // offloaded: the copy back, once the backward has read it
  uint64_t version_ = 0;
  Tensor host_;                      // offloaded: the copy in the host pool
  Device device_;                    // offloaded: where it goes back to
  std::weak_ptr<Storage> original_;  // offloaded: the saved storage, for the version check while it lives
};

class Node;
struct AutogradMeta;  // below
// Where an input's gradient goes, and what that input was when the op recorded it: the
// engine holds each gradient a formula returns to it (shape, dtype, device), as
// PyTorch's validate_outputs does.
struct Edge {
  Edge() = default;  // this input needs no gradient
  Edge(std::shared_ptr<Node> to, const Tensor& input)
      : node(std::move(to)), shape(input.shape()), dtype(input.dtype()), device(input.device()) {}
  std::shared_ptr<Node> node;
  Shape shape;
  DType dtype = DType::f32;
  Device device;
};

// One recorded op: its backward formula and one edge per input. An op has one
// differentiable output, so a node takes one incoming gradient.
class Node {
 public:
  using Backward = std::function<std::vector<Tensor>(const Tensor& grad)>;

  Node(std::string name, std::vector<Edge> next, Backward backward)
      : name_(std::move(name)), next_(std::move(next)), backward_(std::move(backward)),
        sequence_nr_(take_sequence_nr()), forward_path_(current_trace_path()) {}
  virtual ~Node();  // iterative: a graph of any depth is freed without deep recursion

  const std::string& name() const { return name_; }
  // Nodes are numbered in the order they are made, across threads: a node numbered at
  // least next_sequence_nr() read at some moment was made after that moment.
  uint64_t sequence_nr() const { return sequence_nr_; }
  // On a recording memory timeline: the ranges open when the op ran forward (its module),
  // which its backward is drawn under.
  TracePath forward_path() const { return forward_path_; }
  static uint64_t next_sequence_nr();
  const std::vector<Edge>& next_edges() const { return next_; }
  // Gradients for the inputs, one per edge (undefined where an input needs none).
  virtual std::vector<Tensor> apply(const Tensor& grad);
  // Frees the saved tensors (after a backward without retain_graph).
  virtual void release();

  // Tensor hooks of the output this node produced: each may replace the gradient.
  std::vector<std::function<Tensor(const Tensor&)>> pre_hooks;
  // Set on a node whose formula runs a backward pass of its own that may reach older
  // nodes of the graph it is in (a checkpoint's recompute): the engine keeps those
  // nodes' saved tensors until it has run.
  bool reenters_graph = false;
  // The output's autograd state while it retains its gradient (Tensor::retain_grad):
  // after the hooks, the engine adds the gradient into its .grad. Weak: the output
  // holds this node, not the other way round.
  std::weak_ptr<AutogradMeta> retained_output;

 private:
  static uint64_t take_sequence_nr();

  std::string name_;
  std::vector<Edge> next_;
  Backward backward_;
  uint64_t sequence_nr_;
  TracePath forward_path_;
};

// The node at the end of every path to a leaf: adds the gradient into leaf.grad()
// (in place when .grad exists, so a grad that is a view into a flat buffer stays
// one), then runs the leaf's post-accumulate-grad hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::weak_ptr<TensorImpl> leaf) : Node("AccumulateGrad", {}, nullptr), leaf_(leaf) {}
  std::vector<Tensor> apply(const Tensor& grad) override;
  void release() override {}

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

class ParameterOwner;  // below

struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;                  // set for outputs of recorded ops
  std::weak_ptr<AccumulateGrad> grad_accumulator;  // leaves: shared by every use in a graph
  // Leaves keep their hooks here (non-leaves on grad_fn), so they outlive any one graph.
  std::vector<std::function<Tensor(const Tensor&)>> hooks;
  std::vector<std::function<void(const Tensor&)>> post_accumulate_hooks;
  std::weak_ptr<ParameterOwner> owner;  // set while a ShardedModel holds it
};

// ---- Parameters that live in someone else's buffers ----
// dist::ShardedModel makes each parameter's data, and its
// .grad, views into flat buffers they own: backward accumulates into one buffer and
// the optimizer updates another. Pointing such a parameter anywhere else -- set_data,
// set_grad, Module::to, a zero_grad that drops .grad -- would leave the optimizer
// working on buffers the model no longer reads, and training would silently stop. So
// the owner is recorded on each of its parameters while it lives: those calls are
// refused, and Module::zero_grad() asks the owner to zero its gradients instead.
class ParameterOwner {
 public:
  ParameterOwner(const ParameterOwner&) = delete;
  ParameterOwner& operator=(const ParameterOwner&) = delete;
  virtual ~ParameterOwner() = default;

  // The live owner of `param`, or nullptr. A plain pointer: valid while the owner lives,
  // which is the caller's to ensure (the same thread that would destroy it).
  static ParameterOwner* of(const Tensor& param);
  virtual std::string describe() const = 0;  // names it in errors: "a ZeRO-2 ShardedModel"
  virtual void zero_grad() = 0;              // every gradient it owns
  int64_t num_owned() const { return owned_; }

 protected:
  ParameterOwner() = default;
  // Records this as the owner of `param`. One at a time: the caller has refused a
  // parameter that already has one (ShardedModel checks before packing).
  void own(const Tensor& param);
  // set_data and set_grad without the ownership check: the owner repointing its own.
  static void point_data(const Tensor& param, const Tensor& data);
  static void point_grad(const Tensor& param, const Tensor& grad);
  // Expires when the owner is destroyed: hooks it leaves on the model hold this and do
  // nothing after.
  std::weak_ptr<ParameterOwner> alive() const { return alive_; }

 private:
  // Points at this object but shares the lifetime of its own control block, which only
  // this member holds: the parameters' weak references expire exactly when it goes.
  std::shared_ptr<ParameterOwner> alive_{std::make_shared<char>(), this};
  int64_t owned_ = 0;
};

// Runs tensor hooks on a gradient arriving at `where` (a node's or leaf's name): each
// may replace it, with a tensor of the same shape, dtype and device (else zg::Error).
Tensor run_tensor_hooks(const std::vector<std::function<Tensor(const Tensor&)>>& hooks, Tensor grad,
                        const std::string& where);

// Where a gradient for `t` enters the graph: its grad_fn, or a leaf's accumulator.
std::shared_ptr<Node> gradient_edge(const Tensor& t);

// True when grad mode is on and any of `inputs` requires grad.
bool needs_grad(std::initializer_list<const Tensor*> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);
// For a pass nested in another (a checkpoint's recompute), run with retain_graph on a
// graph of its own that may reach into older nodes (a tensor fn captured): frees the
// saved tensors of the nodes reachable from `root` numbered `first` or later
// (Node::next_sequence_nr() read before they were made) now, and those of the older
// nodes it reached when the outermost pass has run its graph (a split backward's I: when
// W has) -- unless that pass retains its graph -- as one backward over both graphs would.
void release_nested_graph(const std::shared_ptr<Node>& root, uint64_t first);

// Sums a gradient over the dims that broadcasting expanded, back to `shape`.
Tensor sum_to(const Tensor& grad, const Shape& shape);

}  // namespace zg
