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
#include <algorithm>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "autograd/functions.h"
#include "autograd/graph.h"
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
thread_local bool outermost_retains_graph = false;  // the outermost pass's retain_graph
thread_local bool formula_is_last_use = false;      // last_use_of_saved_tensors()

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

// One pass over the graph from `root` (steps 1-3 above).
void run_graph(const std::shared_ptr<Node>& root, const Tensor& root_grad, bool retain_graph) {
  NoGradGuard no_grad;
  TraceRange range("backward");
  // Gradients in flight are activation-sized temporaries; only what lands in .grad is `gradient`.
  MemoryScope scope(MemoryCategory::activation);
  // last_use_of_saved_tensors() holds only inside a node's formula: not in this pass's
  // hooks, nor in a recompute's forward that calls it (restored when the pass ends).
  struct LastUseScope {
    bool outer = std::exchange(formula_is_last_use, false);
    ~LastUseScope() { formula_is_last_use = outer; }
  } last_use_scope;

  std::unordered_map<Node*, int> dependencies;
  std::vector<std::shared_ptr<Node>> visited{root};
  std::unordered_set<Node*> seen{root.get()};
  for (size_t i = 0; i < visited.size(); ++i) {
    for (const Edge& edge : visited[i]->next_edges()) {
      if (!edge.node) continue;
      ++dependencies[edge.node.get()];
      if (seen.insert(edge.node.get()).second) visited.push_back(edge.node);
    }
  }
  // A node whose formula runs a backward of its own (a checkpoint's recompute) may reach
  // nodes older than itself (fn captured a tensor of this graph): those keep their saved
  // tensors until every such node has run. Others free theirs as soon as they have run.
  uint64_t newest_reentrant = 0;
  int reentrant_left = 0;
  for (const auto& node : visited)
    if (node->reenters_graph) {
      newest_reentrant = std::max(newest_reentrant, node->sequence_nr() + 1);
      ++reentrant_left;
    }
  for (Node* running : running_nodes)
    ZG_CHECK(!seen.contains(running), "backward: called again from within the backward of ", running->name(),
             " (a hook or formula) on a graph that reaches that node; it would run it again without end");

  std::unordered_map<Node*, Tensor> pending{{root.get(), root_grad}};
  struct Ready {
    bool accumulates;  // an AccumulateGrad
    uint64_t sequence_nr;
    std::shared_ptr<Node> node;
    bool operator<(const Ready& o) const {  // the queue's top is the largest
      return std::tie(accumulates, sequence_nr) < std::tie(o.accumulates, o.sequence_nr);
    }
  };
  const auto ready_entry = [](const std::shared_ptr<Node>& node) {
    return Ready{dynamic_cast<const AccumulateGrad*>(node.get()) != nullptr, node->sequence_nr(), node};
  };
  std::priority_queue<Ready> ready;
  ready.push(ready_entry(root));
  while (!ready.empty()) {
    const std::shared_ptr<Node> node = ready.top().node;
    ready.pop();
    Tensor grad = std::move(pending[node.get()]);
    pending.erase(node.get());
    std::vector<Tensor> input_grads;
    if (grad.defined()) {
      running_nodes.push_back(node.get());
      struct Done {
        ~Done() { running_nodes.pop_back(); }
      } done;
      if (!node->pre_hooks.empty())
        grad = run_tensor_hooks(node->pre_hooks, std::move(grad), "the output of " + node->name());
      keep_retained_grad(*node, grad);
      TraceRange range(node->name(), node->forward_path());  // nested in "backward" on a profiler's timeline
      // Its saved tensors go as soon as it has run, not at the end of the pass (as
      // PyTorch): a layer's activations are freed as its backward finishes, so the peak
      // stays at the forward's. Its formula may then write over them (get_for_overwrite).
      if (node->reenters_graph) --reentrant_left;
      const bool frees_saved = !retain_graph && (reentrant_left == 0 || node->sequence_nr() >= newest_reentrant);
      formula_is_last_use = frees_saved;
      input_grads = node->apply(grad);  // (a throw ends the pass; last_use_scope restores the flag)
      formula_is_last_use = false;
      if (frees_saved) node->release();
      check_gradient_count(*node, input_grads.size());
    }
    const auto& edges = node->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      Node* next = edges[i].node.get();
      if (!next) continue;
      if (!input_grads.empty() && input_grads[i].defined()) {
        const Tensor grad_in = fit_to_edge(std::move(input_grads[i]), edges[i], *node, i);
        Tensor& slot = pending[next];
        slot = slot.defined() ? add(slot, grad_in) : grad_in;
      }
      if (--dependencies[next] == 0) ready.push(ready_entry(edges[i].node));
    }
  }
  if (!retain_graph)  // and those of the nodes no gradient reached
    for (const auto& node : visited) node->release();
}

// A pass, and once the outermost pass of this thread has run its graph, the callbacks
// queued during it -- in the caller's grad mode and memory category. A callback may queue
// another or run a backward of its own: they run until none is left. A throw (from the
// pass or a callback) drops those not yet run.
void run_backward(const std::shared_ptr<Node>& root, const Tensor& root_grad, bool retain_graph) {
  struct Depth {
    explicit Depth(bool retain_graph) {
      if (backward_depth++ == 0) outermost_retains_graph = retain_graph;
    }
    ~Depth() {
      if (--backward_depth == 0) end_of_pass_callbacks.clear();
    }
  } depth(retain_graph);
  run_graph(root, root_grad, retain_graph);
  while (backward_depth == 1 && !end_of_pass_callbacks.empty()) {
    const std::function<void()> callback = std::move(end_of_pass_callbacks.front());
    end_of_pass_callbacks.erase(end_of_pass_callbacks.begin());
    callback();
  }
}

}  // namespace

bool backward_in_progress() { return backward_depth > 0; }

bool last_use_of_saved_tensors() { return formula_is_last_use; }

void queue_backward_callback(std::function<void()> fn) {
  ZG_CHECK(backward_depth > 0, "queue_backward_callback: called outside a backward pass");
  end_of_pass_callbacks.push_back(std::move(fn));
}

void release_nested_graph(const std::shared_ptr<Node>& root, uint64_t first) {
  ZG_CHECK(backward_depth > 0, "release_nested_graph: called outside a backward pass");
  if (!root) return;
  std::vector<std::shared_ptr<Node>> visited{root}, older;
  std::unordered_set<Node*> seen{root.get()};
  for (size_t i = 0; i < visited.size(); ++i) {
    Node& node = *visited[i];
    if (node.sequence_nr() >= first) node.release();
    else if (!node.next_edges().empty()) older.push_back(visited[i]);  // (an AccumulateGrad holds nothing)
    for (const Edge& edge : node.next_edges())
      if (edge.node && seen.insert(edge.node.get()).second) visited.push_back(edge.node);
  }
  if (!older.empty() && !outermost_retains_graph)
    end_of_pass_callbacks.push_back([older = std::move(older)] {
      for (const auto& node : older) node->release();
    });
}

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  ZG_CHECK(requires_grad(), "backward: ", describe(*this), " does not require grad (no recorded op leads to it)");
  Tensor root_grad = grad;
  if (!root_grad.defined()) {
    ZG_CHECK(numel() == 1, "backward: ", describe(*this), " has ", numel(),
             " elements; pass the gradient of the output (only a single element gets 1)");
    root_grad = ones_like(*this);
  }
  ZG_CHECK(root_grad.shape() == shape() && root_grad.dtype() == dtype() && root_grad.device() == device(),
           "backward: gradient ", describe(root_grad), " does not match the output ", describe(*this));
  run_backward(gradient_edge(*this), root_grad, retain_graph);
}

}  // namespace zg
