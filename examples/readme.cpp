// "Write your own model" from README.md, compiled and run by the tests so it stays true:
// a two-layer MLP module learns XOR-like labels with AdamW. One device is a ShardedModel
// over a group of one: the same training path as N ranks.
#include <cstdio>

#include "dist/comm/fake_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/layers.h"
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
  dist::SingleRank one;  // weights, grads and AdamW state in flat buffers, as at N ranks
  dist::ShardedModel trainer(model, one, {.compute_dtype = DType::f32, .adamw = {.weight_decay = 0.0}});

  const Tensor x = randn({256, 2});
  const Tensor labels = ne(gt(x.select(1, 0), 0.0), gt(x.select(1, 1), 0.0)).to(DType::i64);  // XOR of signs

  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    trainer.zero_grad();
    const Tensor loss = cross_entropy(model(x), labels);
    loss.backward();
    trainer.step(1e-2);
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  std::printf("%s", memory_report(memory_stats(), "memory by category").c_str());
  std::printf("loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1;
}
