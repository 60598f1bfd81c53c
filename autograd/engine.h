// The engine's passes as data (not installed): Tensor::backward runs one pass over every
// edge; the split backward (split_backward.cpp) runs I over the edges that reach its
// inputs, which fills the W pass it runs later from the nodes I left edges to.
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "autograd/graph.h"

namespace zg::detail {

// A W root: a node I ran (its hooks and retained grad are done) that owes the gradients
// of the edges W follows from it. Either its formula runs again on `grad`, asked for those
// edges only, or -- where I's formula returned them all anyway, or ran a backward of its
// own (a checkpoint: it runs once) -- they are `computed`.
struct ResumedNode {
  std::shared_ptr<Node> node;
  Tensor grad;
  std::vector<Tensor> computed;  // one per edge (fitted to it), or empty
};

struct BackwardPass {
  std::shared_ptr<Node> root;  // a fresh root (its hooks run), or none
  Tensor root_grad;
  std::vector<ResumedNode> resumed;
  // The edges a node follows, where not all: I's nodes, only those into I's subgraph (I
  // lists exactly its nodes that leave an edge); a resumed node, only those it owes.
  // needs_input_grad() answers from it.
  std::unordered_map<const Node*, std::vector<bool>> follows;
  bool retain_graph = false;
  // I: the pass that gets what this one leaves -- each node that ran with unfollowed
  // edges leading somewhere (kept, saved tensors and all, for its formula to run again,
  // unless it computed them), and the older nodes its checkpoints' recomputes reached
  // (release_nested_graph), which W may still run.
  BackwardPass* defer_to = nullptr;
  // Freed when this pass ends, unless it retains its graph (W: the graph I started from).
  std::vector<std::shared_ptr<Node>> release_at_end;
};

// A pass, then -- as the outermost pass of its thread -- the callbacks queued during it.
void run_backward(BackwardPass& pass);

// The gradient a backward of `output` starts from: `grad`, or 1 for a one-element output;
// refused (naming `op`) when output does not require grad or grad does not match it.
Tensor root_gradient(const char* op, const Tensor& output, const Tensor& grad);

}  // namespace zg::detail
