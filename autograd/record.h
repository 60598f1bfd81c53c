// The library's own ops record themselves here: not installed. A user's op is a
// CustomOp (autograd/custom_op.h), whose backward is held to one right gradient per
// input; these are the engine's own, whose formulas may return a broadcast shape or
// another dtype (the engine sums or casts it back: engine.cpp's fit_to_edge). Every
// formula, either kind, returns one gradient per input (the engine checks).
#pragma once

#include <string>
#include <vector>

#include "autograd/graph.h"

namespace zg {

// The names of all differentiable ops, each registered once by the op's source
// file; the gradcheck test checks that every one of them has a case and that no two
// share a name.
class DifferentiableOp {
 public:
  explicit DifferentiableOp(const char* name);
  const char* name() const { return name_; }
  static const std::vector<std::string>& all();

 private:
  const char* name_;
};

// Makes `out` the output of a node for `op` with these inputs and backward formula;
// an `out` that is not floating-point is left as it is (not differentiable).
void record(const Tensor& out, const DifferentiableOp& op, const std::vector<Tensor>& inputs,
            Node::Backward backward);
void record(const Tensor& out, std::string name, const std::vector<Tensor>& inputs, Node::Backward backward);

// Records `op` on `out` when grad mode is on and an input requires grad; returns out.
// Ops read as: return differentiable(forward..., op, {inputs}, backward);
Tensor differentiable(const Tensor& out, const DifferentiableOp& op, const std::vector<Tensor>& inputs,
                      Node::Backward backward);

}  // namespace zg
