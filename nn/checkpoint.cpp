#include "nn/checkpoint.h"

#include "autograd/record.h"
#include "tensor/context.h"

namespace zg::nn {

namespace {
const DifferentiableOp kCheckpoint("checkpoint");
}

Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn, const std::vector<Tensor>& inputs) {
  const Generator& generator = Generator::current();
  const uint64_t seed = generator.seed(), offset = generator.offset();
  Tensor out;
  {
    NoGradGuard no_grad;  // nothing inside is saved for backward
    out = fn(inputs);
  }
  ZG_CHECK(out.defined(), "checkpoint: the function returned an undefined tensor");
  // A fresh handle on the result: fn may return an input or a captured parameter as it
  // is (an eval-mode dropout does), and recording onto that would make it a non-leaf.
  out = out.detach();
  // Recorded even when no input requires grad: the parameters inside fn may.
  if (!GradMode::is_enabled()) return out;
  std::vector<SavedTensor> saved;
  std::vector<bool> input_needs_grad;
  for (const Tensor& x : inputs) {
    saved.emplace_back(x);
    input_needs_grad.push_back(x.defined() && x.requires_grad());
  }
  record(out, kCheckpoint, inputs, [fn, saved, input_needs_grad, seed, offset](const Tensor& g) {
    std::vector<Tensor> replay;
    for (size_t i = 0; i < saved.size(); ++i) {
      Tensor x = saved[i].get("checkpoint");
      if (x.defined()) x = x.detach();
      if (input_needs_grad[i]) x.set_requires_grad(true);
      replay.push_back(x);
    }
    Generator forward_state(seed, offset);  // the forward's random numbers (dropout masks), again
    const uint64_t first_recomputed = Node::next_sequence_nr();
    Tensor recomputed;
    {
      GeneratorGuard replaying(forward_state);
      GradModeGuard grad_on(true);
      recomputed = fn(replay);
    }
    ZG_CHECK(recomputed.defined() && recomputed.shape() == g.shape() && recomputed.dtype() == g.dtype(),
             "checkpoint: the recompute in backward returned ", describe(recomputed), " where the forward returned ",
             describe(g), "; fn must compute the same thing each time it runs");
    if (recomputed.requires_grad()) {
      // fn may use a tensor of the outer graph it did not take as an input (a captured
      // h = f(x)): this pass then goes on into that graph, whose nodes the outer pass may
      // still run. So it frees what the recompute made now, the rest when the outer pass ends.
      recomputed.backward(g, /*retain_graph=*/true);
      release_nested_graph(recomputed.grad_fn(), first_recomputed);
    }
    std::vector<Tensor> grads;
    for (const Tensor& x : replay) grads.push_back(x.defined() && x.requires_grad() ? x.grad() : Tensor());
    return grads;
  });
  if (const auto node = out.grad_fn()) node->reenters_graph = true;  // (none for a non-floating result)
  return out;
}

}  // namespace zg::nn
