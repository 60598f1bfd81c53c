// The backward engine. Gradients flow from the root through the recorded nodes in
// dependency order: a node runs once every node that feeds it has run, so its
// incoming gradient is complete (the sum over all paths) when it runs.
//
//   1. count, for every node reachable from the root, the edges that point to it;
//   2. start with the root; run a ready node's backward formula, add each result
//      into the pending gradient of the node its edge leads to, and when that
//      node's count reaches zero, it is ready;
//   3. leaves are reached through AccumulateGrad nodes, which add into .grad.
// Of the ready nodes, an AccumulateGrad runs first, then the newest (the highest
// sequence number), as in PyTorch: the backward goes through the forward in reverse,
// and a parameter's gradient lands as soon as it is complete. So when the gradient of
// a layer's input arrives (its hook runs), every node the layer's forward recorded has
// run and its parameters' gradients are in .grad -- the moment ZeRO-3 reduces a unit.
//
// A pass may follow only some of a node's edges, and start from several roots
// (engine.h's BackwardPass): the split backward's I and W (split_backward.h).
#include "autograd/engine.h"

#include <algorithm>
#include <queue>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "autograd/functions.h"
#include "tensor/trace.h"

namespace zg {

namespace {

thread_local int backward_depth = 0;  // nested passes: a checkpoint recompute runs its own
// The node each enclosing pass of this thread is running (its hooks or its formula). A
// nested pass is fine on a graph of its own (a checkpoint's recompute); one that reaches
// a node an enclosing pass is still running would run that node again, and its hook
// again, without end.
thread_local std::vector<Node*> running_nodes;
// queue_backward_callback's, run when the outermost pass ends.
thread_local std::vector<std::function<void()>> end_of_pass_callbacks;
// release_nested_graph's older nodes, freed when the outermost pass has run its graph.
thread_local std::vector<std::shared_ptr<Node>> nested_older_nodes;
thread_local bool outermost_retains_graph = false;  // the outermost pass's retain_graph
thread_local bool formula_is_last_use = false;      // last_use_of_saved_tensors()
// The inputs the running formula is asked for (needs_input_grad); null: all of them.
thread_local const std::vector<bool>* asked_inputs = nullptr;

// A formula's gradient for input i, held to what that input was when the op recorded
// it (as PyTorch's validate_outputs): a gradient of a shape the input broadcasts to is
// summed back to it, another dtype is cast to the input's; any other shape, or another
// device, is a wrong formula (a custom op's), refused with the op's name.
Tensor fit_to_edge(Tensor grad, const Edge& edge, const Node& node, size_t i) {
  const auto wrong = [&](const std::string& what) {
    fail("backward of ", node.name(), ": the gradient for input ", i, " is ", describe(grad), ", but that input was ",
         name(edge.dtype), shape_str(edge.shape), " on ", edge.device.str(), " (", what, ")");
  };
  if (grad.device() != edge.device) wrong("another device");
  if (grad.shape() != edge.shape) {
    const auto& to = edge.shape;
    const auto& from = grad.shape();
    bool expandable = to.size() <= from.size();
    for (size_t d = 0; expandable && d < to.size(); ++d) {
      const int64_t t = to[to.size() - 1 - d], f = from[from.size() - 1 - d];
      expandable = t == f || t == 1;
    }
    if (!expandable) wrong("a shape it does not broadcast to");
    grad = sum_to(grad, to);
  }
  return grad.dtype() == edge.dtype ? grad : grad.to(edge.dtype);
}

// A formula returns one gradient per input (PyTorch's validate_outputs): with fewer, an
// input would silently get none.
void check_gradient_count(const Node& node, size_t returned) {
  const size_t inputs = node.next_edges().size();
  ZG_CHECK(returned == inputs, "backward of ", node.name(), ": its formula returned ", returned,
           returned == 1 ? " gradient" : " gradients", " for ", inputs, inputs == 1 ? " input" : " inputs",
           "; return one per input, an undefined Tensor for an input that gets none");
}

// A non-leaf that retains its gradient (Tensor::retain_grad) adds what reached it, after
// its hooks, into its .grad: a new tensor each time (out of place, as PyTorch), since a
// caller may hold the last one.
void keep_retained_grad(const Node& node, const Tensor& grad) {
  const std::shared_ptr<AutogradMeta> output = node.retained_output.lock();
  if (!output) return;
  MemoryScope scope(MemoryCategory::gradient);
  output->grad = output->grad.defined() ? add(output->grad, grad) : grad.clone();
}

// Sets a thread-local for a scope and restores it after.
template <typename T>
struct Setting {
  Setting(T& variable, T value) : variable_(variable), outer_(std::exchange(variable, value)) {}
  ~Setting() { variable_ = outer_; }
  Setting(const Setting&) = delete;
  Setting& operator=(const Setting&) = delete;

 private:
  T& variable_;
  T outer_;
};

// One pass over a graph (steps 1-3 above), from its roots along the edges it follows.
class GraphTask {
 public:
  explicit GraphTask(detail::BackwardPass& pass) : pass_(pass) {}
  void run();

 private:
  struct Ready {
    bool accumulates;  // an AccumulateGrad
    uint64_t sequence_nr;
    std::shared_ptr<Node> node;
    bool operator<(const Ready& o) const {  // the queue's top is the largest
      return std::tie(accumulates, sequence_nr) < std::tie(o.accumulates, o.sequence_nr);
    }
  };
  static Ready ready_entry(const std::shared_ptr<Node>& node) {
    return Ready{dynamic_cast<const AccumulateGrad*>(node.get()) != nullptr, node->sequence_nr(), node};
  }

  // The edges `node` follows in this pass; null: all of them.
  const std::vector<bool>* follows(const Node& node) const {
    if (pass_.follows.empty()) return nullptr;
    const auto it = pass_.follows.find(&node);
    return it == pass_.follows.end() ? nullptr : &it->second;
  }
  detail::ResumedNode* resumed(const Node& node) {
    if (resumed_.empty()) return nullptr;
    const auto it = resumed_.find(&node);
    return it == resumed_.end() ? nullptr : it->second;
  }
  void count_dependencies();
  void start(const std::shared_ptr<Node>& node, Tensor grad);
  std::vector<Tensor> evaluate(const std::shared_ptr<Node>& node, Tensor grad);
  void defer(const std::shared_ptr<Node>& node, const Tensor& grad, std::vector<Tensor>& grads,
             const std::vector<bool>& followed);
  void route(const std::shared_ptr<Node>& node, std::vector<Tensor> grads);

  detail::BackwardPass& pass_;
  std::vector<std::shared_ptr<Node>> visited_;
  std::unordered_set<Node*> seen_;
  std::unordered_map<Node*, int> dependencies_;
  std::unordered_map<Node*, Tensor> pending_;
  std::unordered_map<const Node*, detail::ResumedNode*> resumed_;
  std::unordered_set<Node*> kept_;  // deferred with their saved tensors: not freed by this pass
  std::priority_queue<Ready> ready_;
  // A node whose formula runs a backward of its own (a checkpoint's recompute) may reach
  // nodes older than itself (fn captured a tensor of this graph): those keep their saved
  // tensors until every such node has run. Others free theirs as soon as they have run.
  uint64_t newest_reentrant_ = 0;
  int reentrant_left_ = 0;
};

void GraphTask::count_dependencies() {
  if (pass_.root) visited_.push_back(pass_.root);
  for (detail::ResumedNode& r : pass_.resumed) {
    visited_.push_back(r.node);
    resumed_[r.node.get()] = &r;
  }
  for (const auto& node : visited_) seen_.insert(node.get());
  for (size_t i = 0; i < visited_.size(); ++i) {
    const std::vector<bool>* followed = follows(*visited_[i]);
    const auto& edges = visited_[i]->next_edges();
    for (size_t e = 0; e < edges.size(); ++e) {
      if (!edges[e].node || (followed && !(*followed)[e])) continue;
      ++dependencies_[edges[e].node.get()];
      if (seen_.insert(edges[e].node.get()).second) visited_.push_back(edges[e].node);
    }
  }
  for (const auto& node : visited_) {
    const detail::ResumedNode* r = resumed(*node);
    if (node->reenters_graph && !(r && !r->computed.empty())) {  // (a node whose gradients are computed does not run)
      newest_reentrant_ = std::max(newest_reentrant_, node->sequence_nr() + 1);
      ++reentrant_left_;
    }
  }
  for (Node* running : running_nodes)
    ZG_CHECK(!seen_.contains(running), "backward: called again from within the backward of ", running->name(),
             " (a hook or formula) on a graph that reaches that node; it would run it again without end");
}

void GraphTask::start(const std::shared_ptr<Node>& node, Tensor grad) {
  pending_[node.get()] = std::move(grad);
  if (dependencies_[node.get()] == 0) ready_.push(ready_entry(node));
}

void GraphTask::run() {
  NoGradGuard no_grad;
  TraceRange range("backward");
  // Gradients in flight are activation-sized temporaries; only what lands in .grad is `gradient`.
  MemoryScope scope(MemoryCategory::activation);
  // last_use_of_saved_tensors() holds only inside a node's formula: not in this pass's
  // hooks, nor in a recompute's forward that calls it (restored when the pass ends).
  const Setting<bool> last_use(formula_is_last_use, false);
  count_dependencies();
  if (pass_.root) start(pass_.root, pass_.root_grad);
  for (detail::ResumedNode& r : pass_.resumed) start(r.node, std::move(r.grad));
  while (!ready_.empty()) {
    const std::shared_ptr<Node> node = ready_.top().node;
    ready_.pop();
    Tensor grad = std::move(pending_[node.get()]);
    pending_.erase(node.get());
    detail::ResumedNode* r = resumed(*node);
    std::vector<Tensor> grads;
    if (r && !r->computed.empty()) grads = std::move(r->computed);
    else if (grad.defined()) grads = evaluate(node, std::move(grad));
    route(node, std::move(grads));
  }
  if (pass_.retain_graph) return;
  for (const auto& node : visited_)  // and those of the nodes no gradient reached
    if (!kept_.contains(node.get())) node->release();
  for (const auto& node : pass_.release_at_end) node->release();
}

// Runs a node with its complete incoming gradient: its tensor hooks and retained grad
// (done already for a resumed node), then its formula, asked for the edges it follows.
std::vector<Tensor> GraphTask::evaluate(const std::shared_ptr<Node>& node, Tensor grad) {
  running_nodes.push_back(node.get());
  struct Done {
    ~Done() { running_nodes.pop_back(); }
  } done;
  if (!resumed(*node)) {
    if (!node->pre_hooks.empty())
      grad = run_tensor_hooks(node->pre_hooks, std::move(grad), "the output of " + node->name());
    keep_retained_grad(*node, grad);
  }
  TraceRange range(node->name(), node->forward_path());  // nested in "backward" on a profiler's timeline
  const std::vector<bool>* followed = follows(*node);
  const bool defers = pass_.defer_to != nullptr && followed != nullptr;  // (I lists only nodes that leave edges)
  // Its saved tensors go as soon as it has run, not at the end of the pass (as
  // PyTorch): a layer's activations are freed as its backward finishes, so the peak
  // stays at the forward's. Its formula may then write over them (get_for_overwrite).
  if (node->reenters_graph) --reentrant_left_;
  const bool frees_saved = !pass_.retain_graph && (reentrant_left_ == 0 || node->sequence_nr() >= newest_reentrant_);
  std::vector<Tensor> grads;
  {
    const Setting<bool> last_use(formula_is_last_use, frees_saved && !defers);
    // (One that runs a backward of its own is asked for all: it runs once, its pass having
    // added into leaves.)
    const Setting<const std::vector<bool>*> asked(asked_inputs, node->reenters_graph ? nullptr : followed);
    grads = node->apply(grad);
  }
  check_gradient_count(*node, grads.size());
  if (defers) defer(node, grad, grads, *followed);
  if (frees_saved && !kept_.contains(node.get())) node->release();
  return grads;
}

// Hands what `node` owes along the edges it did not follow to the pass that follows
// them: the gradients, where its formula returned them all (one that does not ask
// needs_input_grad) or runs a backward of its own, else the node itself, with its
// gradient and saved tensors, to run again.
void GraphTask::defer(const std::shared_ptr<Node>& node, const Tensor& grad, std::vector<Tensor>& grads,
                      const std::vector<bool>& followed) {
  const auto& edges = node->next_edges();
  std::vector<bool> owed(edges.size());
  bool all_returned = true;
  for (size_t e = 0; e < edges.size(); ++e) {
    owed[e] = edges[e].node && !followed[e];
    all_returned = all_returned && (!owed[e] || grads[e].defined());
  }
  detail::ResumedNode later{node, Tensor(), {}};
  if (all_returned || node->reenters_graph) {
    later.computed.resize(edges.size());
    for (size_t e = 0; e < edges.size(); ++e)
      if (owed[e] && grads[e].defined()) later.computed[e] = fit_to_edge(std::move(grads[e]), edges[e], *node, e);
  } else {
    later.grad = grad;
    kept_.insert(node.get());
  }
  pass_.defer_to->follows.emplace(node.get(), std::move(owed));
  pass_.defer_to->resumed.push_back(std::move(later));
}

// Adds a node's gradients into the pending gradients of the nodes its followed edges
// lead to, and readies those that have heard from every node that feeds them.
void GraphTask::route(const std::shared_ptr<Node>& node, std::vector<Tensor> grads) {
  const std::vector<bool>* followed = follows(*node);
  const auto& edges = node->next_edges();
  for (size_t e = 0; e < edges.size(); ++e) {
    Node* next = edges[e].node.get();
    if (!next || (followed && !(*followed)[e])) continue;
    if (!grads.empty() && grads[e].defined()) {
      const Tensor grad = fit_to_edge(std::move(grads[e]), edges[e], *node, e);
      Tensor& slot = pending_[next];
      slot = slot.defined() ? add(slot, grad) : grad;
    }
    if (--dependencies_[next] == 0) ready_.push(ready_entry(edges[e].node));
  }
}

}  // namespace

// A pass, and once the outermost pass of this thread has run its graph, the older nodes
// nested passes reached (freed, or handed to the pass this one defers to) and the
// callbacks queued during it -- in the caller's grad mode and memory category. A
// callback may queue another or run a backward of its own: they run until none is
// left. A throw (from the pass or a callback) drops those not yet run.
void detail::run_backward(BackwardPass& pass) {
  struct Depth {
    explicit Depth(bool retain_graph) {
      if (backward_depth++ == 0) outermost_retains_graph = retain_graph;
    }
    ~Depth() {
      if (--backward_depth > 0) return;
      end_of_pass_callbacks.clear();
      nested_older_nodes.clear();
    }
  } depth(pass.retain_graph);
  GraphTask(pass).run();
  if (backward_depth == 1) {
    std::vector<std::shared_ptr<Node>> older = std::exchange(nested_older_nodes, {});
    if (!pass.defer_to) {
      for (const auto& node : older) node->release();
    } else {
      auto& later = pass.defer_to->release_at_end;
      later.insert(later.end(), older.begin(), older.end());
    }
  }
  while (backward_depth == 1 && !end_of_pass_callbacks.empty()) {
    const std::function<void()> callback = std::move(end_of_pass_callbacks.front());
    end_of_pass_callbacks.erase(end_of_pass_callbacks.begin());
    callback();
  }
}

Tensor detail::root_gradient(const char* op, const Tensor& output, const Tensor& grad) {
  ZG_CHECK(output.requires_grad(), op, ": ", describe(output), " does not require grad (no recorded op leads to it)");
  if (!grad.defined()) {
    ZG_CHECK(output.numel() == 1, op, ": ", describe(output), " has ", output.numel(),
             " elements; pass the gradient of the output (only a single element gets 1)");
    return ones_like(output);
  }
  ZG_CHECK(grad.shape() == output.shape() && grad.dtype() == output.dtype() && grad.device() == output.device(), op,
           ": gradient ", describe(grad), " does not match the output ", describe(output));
  return grad;
}

bool backward_in_progress() { return backward_depth > 0; }

bool last_use_of_saved_tensors() { return formula_is_last_use; }

bool needs_input_grad(size_t i) { return !asked_inputs || (i < asked_inputs->size() && (*asked_inputs)[i]); }

void queue_backward_callback(std::function<void()> fn) {
  ZG_CHECK(backward_depth > 0, "queue_backward_callback: called outside a backward pass");
  end_of_pass_callbacks.push_back(std::move(fn));
}

void release_nested_graph(const std::shared_ptr<Node>& root, uint64_t first) {
  ZG_CHECK(backward_depth > 0, "release_nested_graph: called outside a backward pass");
  if (!root) return;
  std::vector<std::shared_ptr<Node>> visited{root};
  std::unordered_set<Node*> seen{root.get()};
  for (size_t i = 0; i < visited.size(); ++i) {
    Node& node = *visited[i];
    if (node.sequence_nr() >= first) node.release();
    else if (!node.next_edges().empty() && !outermost_retains_graph)  // (an AccumulateGrad holds nothing)
      nested_older_nodes.push_back(visited[i]);
    for (const Edge& edge : node.next_edges())
      if (edge.node && seen.insert(edge.node.get()).second) visited.push_back(edge.node);
  }
}

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  detail::BackwardPass pass;
  pass.root_grad = detail::root_gradient("backward", *this, grad);
  pass.root = gradient_edge(*this);
  pass.retain_graph = retain_graph;
  detail::run_backward(pass);
}

}  // namespace zg
