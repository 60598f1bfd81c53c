// "Write your own model" from README.md, compiled and run by the tests so it stays true:
// a two-layer MLP module learns XOR-like labels with AdamW over flat parameters.
#include <cstdio>

#include "nn/layers.h"
#include "optim/adamw.h"
#include "zerograd.h"

using namespace zg;

struct MLP : nn::Module {
  std::shared_ptr<nn::Linear> fc1, fc2;
  MLP(int64_t in, int64_t hidden, int64_t out) {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(in, hidden, true, 0.5));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(hidden, out, true, 0.5));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)(gelu((*fc1)(x))); }
};

int main() {
  manual_seed(0);
  MLP model(2, 32, 2);
  optim::FlatParameters params(model.named_parameters(), DType::f32);  // weights and grads in flat buffers
  optim::AdamW adamw(params, {.weight_decay = 0.0});

  const Tensor x = randn({256, 2});
  const Tensor labels = ne(gt(x.select(1, 0), 0.0), gt(x.select(1, 1), 0.0)).to(DType::i64);  // XOR of signs

  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    params.zero_grad();
    const Tensor loss = cross_entropy(model(x), labels);
    loss.backward();
    adamw.step(1e-2);
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  std::printf("%s", memory_report(memory_stats(), "memory by category").c_str());
  std::printf("loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1;
}
