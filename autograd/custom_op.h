// Differentiable ops of your own, as torch.autograd.Function: compute the output with
// any ops (or a kernel of your own), then record it with the gradient formula beside it.
//
//   // y = x^3:  dx = 3 x^2 g
//   Tensor cube(const Tensor& x) {
//     static const zg::CustomOp op("cube");  // a name no other op has
//     Tensor y;
//     { zg::NoGradGuard no_grad; y = x * x * x; }  // the forward records nothing itself
//     return op.apply(y, {x}, [saved = zg::SavedTensor(x)](const zg::Tensor& g) {
//       const zg::Tensor x = saved.get("cube");
//       return std::vector<zg::Tensor>{g * x * x * 3.0};  // one per input, each of its shape and dtype
//     });
//   }
//
// apply() records when grad mode is on and an input requires grad; the formula runs in
// backward (with grad mode off unless create_graph) and must return one gradient per input
// -- an undefined Tensor for none -- of that input's shape, dtype and device. Anything else
// is a zg::Error naming the op, the input and what was wrong (the engine's own ops may
// return a broadcast shape or another dtype; a custom op may not), and so is an error
// raised inside the formula: "backward of cube: matmul: ...". SavedTensor keeps an
// input for backward and refuses it if it was written in place since. Check the formula
// with gradcheck (autograd/gradcheck.h) on f64 inputs. A formula may ask needs_input_grad(i)
// (graph.h) and skip work for gradients the pass does not want (a split backward's I wants
// only the stage inputs').
#pragma once

#include <string>
#include <vector>

#include "autograd/graph.h"

namespace zg {

class CustomOp {
 public:
  // Throws zg::Error when an op of that name exists (zerograd's or another CustomOp):
  // make it a function-local static, so a clash reaches the caller as an exception.
  explicit CustomOp(std::string name);
  const std::string& name() const { return name_; }

  Tensor apply(const Tensor& out, const std::vector<Tensor>& inputs, Node::Backward backward) const;

 private:
  std::string name_;
};

}  // namespace zg
