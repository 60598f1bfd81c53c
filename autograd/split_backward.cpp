// The split backward: I is one engine pass over the nodes from which an input (or a
// node that runs a backward of its own) is reachable, each following only its edges into
// that set; the engine hands what they leave to W's pass (engine.h), whose roots they are.
// W's nodes all lie outside I's set -- a node with an edge into it would be in it -- so
// none of them waits on I, and each node and leaf hears from the same nodes, in the same
// order (the newest first), as in one backward.
#include "autograd/split_backward.h"

#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "autograd/engine.h"

namespace zg {

namespace {

// Every node reachable from `root`, and for each the nodes with an edge to it.
struct Graph {
  std::vector<std::shared_ptr<Node>> nodes;
  std::unordered_map<const Node*, std::vector<const Node*>> feeders;
};

Graph graph_from(const std::shared_ptr<Node>& root) {
  Graph graph{{root}, {{root.get(), {}}}};
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    for (const Edge& edge : graph.nodes[i]->next_edges()) {
      if (!edge.node) continue;
      const auto [it, fresh] = graph.feeders.try_emplace(edge.node.get());
      it->second.push_back(graph.nodes[i].get());
      if (fresh) graph.nodes.push_back(edge.node);
    }
  return graph;
}

// The accumulators of `inputs`, each checked to be a leaf requiring grad that `graph` reaches.
std::vector<const Node*> input_accumulators(const Graph& graph, const Tensor& output,
                                            const std::vector<Tensor>& inputs) {
  std::vector<const Node*> accumulators;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    ZG_CHECK(x.defined(), "backward_input: input ", i, " is an undefined tensor");
    ZG_CHECK(x.is_leaf() && x.requires_grad(), "backward_input: input ", i, " ", describe(x),
             " is not a leaf that requires grad; pass the stage's inputs as leaves (detach, then set_requires_grad)");
    const std::shared_ptr<AccumulateGrad> accumulator = x.impl().autograd->grad_accumulator.lock();
    ZG_CHECK(accumulator && graph.feeders.contains(accumulator.get()), "backward_input: input ", i, " ", describe(x),
             " is not reachable from the output ", describe(output), "; no gradient of it would flow");
    accumulators.push_back(accumulator.get());
  }
  return accumulators;
}

// The nodes I runs: those from which one of `targets` is reachable (themselves included).
std::unordered_set<const Node*> reaching(const Graph& graph, std::vector<const Node*> targets) {
  std::unordered_set<const Node*> found(targets.begin(), targets.end());
  while (!targets.empty()) {
    const Node* node = targets.back();
    targets.pop_back();
    for (const Node* feeder : graph.feeders.at(node))
      if (found.insert(feeder).second) targets.push_back(feeder);
  }
  return found;
}

// For each node of I that has an edge leading out of I: the edges it follows, those into I.
std::unordered_map<const Node*, std::vector<bool>> edges_into(const std::unordered_set<const Node*>& nodes) {
  std::unordered_map<const Node*, std::vector<bool>> follows;
  for (const Node* node : nodes) {
    const auto& edges = node->next_edges();
    std::vector<bool> into(edges.size());
    bool leaves = false;
    for (size_t e = 0; e < edges.size(); ++e) {
      into[e] = edges[e].node && nodes.contains(edges[e].node.get());
      leaves = leaves || (edges[e].node && !into[e]);
    }
    if (leaves) follows.emplace(node, std::move(into));
  }
  return follows;
}

}  // namespace

struct DeferredWeightGradients::State {
  detail::BackwardPass weights;  // W
  std::thread::id thread = std::this_thread::get_id();
};

DeferredWeightGradients::DeferredWeightGradients(std::unique_ptr<State> state) : state_(std::move(state)) {}
DeferredWeightGradients::DeferredWeightGradients(DeferredWeightGradients&&) noexcept = default;

DeferredWeightGradients& DeferredWeightGradients::operator=(DeferredWeightGradients&& other) noexcept {
  if (this != &other) {
    discard();
    state_ = std::move(other.state_);
  }
  return *this;
}

DeferredWeightGradients::~DeferredWeightGradients() { discard(); }

// Frees the saved tensors W would have read (on another thread, the graph is not ours to touch).
void DeferredWeightGradients::discard() {
  if (state_ && state_->thread == std::this_thread::get_id())
    for (const auto& node : state_->weights.release_at_end) node->release();
  state_.reset();
}

void DeferredWeightGradients::run() {
  ZG_CHECK(state_ != nullptr,
           "DeferredWeightGradients::run: the weight gradients were computed already (or this was moved from); "
           "W runs once");
  ZG_CHECK(state_->thread == std::this_thread::get_id(),
           "DeferredWeightGradients::run: called on another thread than the backward_input that made it; a graph "
           "belongs to one thread");
  ZG_CHECK(!backward_in_progress(),
           "DeferredWeightGradients::run: called inside a backward pass (a hook, formula or callback); run W "
           "outside one");
  const std::unique_ptr<State> state = std::move(state_);
  detail::run_backward(state->weights);
}

bool DeferredWeightGradients::empty() const {
  return !state_ || (!state_->weights.root && state_->weights.resumed.empty());
}

DeferredWeightGradients backward_input(const Tensor& output, const Tensor& grad, const std::vector<Tensor>& inputs) {
  ZG_CHECK(!backward_in_progress(),
           "backward_input: called inside a backward pass (a hook, formula or callback); split a backward outside one");
  const Tensor root_grad = detail::root_gradient("backward_input", output, grad);
  const std::shared_ptr<Node> root = gradient_edge(output);
  const Graph graph = graph_from(root);
  std::vector<const Node*> targets = input_accumulators(graph, output, inputs);
  for (const auto& node : graph.nodes)
    if (node->reenters_graph) targets.push_back(node.get());
  const std::unordered_set<const Node*> input_side = reaching(graph, std::move(targets));

  auto state = std::make_unique<DeferredWeightGradients::State>();
  if (input_side.empty()) {  // (no inputs): W is the whole backward
    state->weights.root = root;
    state->weights.root_grad = root_grad;
  } else {
    detail::BackwardPass input_pass;
    input_pass.root = root;
    input_pass.root_grad = root_grad;
    input_pass.follows = edges_into(input_side);
    input_pass.defer_to = &state->weights;
    detail::run_backward(input_pass);
  }
  auto& release = state->weights.release_at_end;
  release.insert(release.end(), graph.nodes.begin(), graph.nodes.end());
  return DeferredWeightGradients(std::move(state));
}

}  // namespace zg
