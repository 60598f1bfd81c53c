// The "Using it" example of README.md, compiled with the build so it stays true.
#include <iostream>

#include <zerograd.h>
using namespace zg;

int main() {
  manual_seed(0);
  Tensor x = randn({4, 8});                          // f32 on the CPU
  Tensor w = normal({8, 3}, 0.0, 0.02, f64).to(f32);
  Tensor logits = matmul(x, w);                      // [4, 3]
  Tensor loss = cross_entropy(logits, tensor<int64_t>({0, 2, 1, 0}));
  std::cout << softmax(logits, -1) << "\nloss " << loss.item<float>() << "\n";

  MemoryScope scope(MemoryCategory::activation);    // tag what is allocated here
  Tensor h = gelu(x.t().contiguous());
  std::cout << memory_report(memory_stats(), "rank 0");
}
