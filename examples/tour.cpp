// A tour of zerograd's tensor core and of the memory figures the rest of the
// library is built around. Run: build/examples/tour [--device cpu|meta|cuda]
//
// 1. Tensors: views share storage, broadcasting, reductions, printing.
// 2. A two-layer MLP step's memory, category by category, read from the
//    allocator: parameters, gradients, optimizer state, activations.
// 3. The same bookkeeping for GPT-2 124M on the meta device: mixed-precision
//    AdamW keeps 16 bytes per parameter (bf16 weights and grads, fp32 master,
//    m and v) -- the 16Ψ that ZeRO then divides across ranks.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "zerograd.h"

using namespace zg;

namespace {

void tensors_section() {
  std::cout << "== tensors ==\n";
  const Tensor x = arange(0.0, 6.0, 1.0, DType::f32).view({2, 3});
  std::cout << "x = " << x << "\n";
  std::cout << "x.t() is a view: " << x.t() << "\n";
  x.t().select(0, 0).fill_(-1);  // writes through the view into x
  std::cout << "after x.t()[0] = -1, x = " << x << "\n";
  std::cout << "x + [10, 20, 30] = " << (x + tensor<float>({10, 20, 30})) << "\n";
  std::cout << "softmax(x, 1) = " << softmax(x, 1) << "\n";
  std::cout << "sum over dim 0 = " << sum(x, {0}) << "\n\n";
}

// Forward of a 2-layer MLP with cross-entropy, and the buffers a training step keeps.
void mlp_section(Device device) {
  Context rank;  // a fresh rank context: its own allocator and figures
  ContextGuard guard(rank);
  manual_seed(0);
  const int64_t batch = 64, d_in = 512, d_hidden = 2048, classes = 10;
  const TensorOptions opt = TensorOptions(DType::f32).device(device);

  Tensor w1, w2, g1, g2, m1, v1, m2, v2;
  {
    MemoryScope scope(MemoryCategory::parameter);
    w1 = normal({d_in, d_hidden}, 0.0, 0.02, opt);
    w2 = normal({d_hidden, classes}, 0.0, 0.02, opt);
  }
  {
    MemoryScope scope(MemoryCategory::gradient);
    g1 = zeros_like(w1);
    g2 = zeros_like(w2);
  }
  {
    MemoryScope scope(MemoryCategory::optimizer_state);
    m1 = zeros_like(w1), v1 = zeros_like(w1), m2 = zeros_like(w2), v2 = zeros_like(w2);
  }
  Tensor loss;
  {
    MemoryScope scope(MemoryCategory::activation);
    const Tensor x = randn({batch, d_in}, opt);
    const Tensor target = mul(rand({batch}, opt), static_cast<double>(classes)).to(DType::i64);
    const Tensor h = gelu(matmul(x, w1));
    const Tensor logits = matmul(layer_norm(h, Tensor(), Tensor()), w2);
    loss = cross_entropy(logits, target);
  }
  std::cout << "== a 2-layer MLP (" << numel(w1.shape()) + numel(w2.shape()) << " parameters) on "
            << device.str() << " ==\n";
  if (device.type != DeviceType::meta) std::cout << "loss = " << loss.item<float>() << "\n";
  std::cout << memory_report(memory_stats(device), "memory of rank 0 on " + device.str()) << "\n";
}

// GPT-2 124M's parameter count, and 16 bytes of model state per parameter.
void gpt2_section() {
  Context rank;
  ContextGuard guard(rank);
  const int64_t vocab = 50304, block = 1024, d = 768, layers = 12;
  std::vector<Shape> shapes = {{vocab, d}, {block, d}, {d}, {d}};  // wte, wpe, ln_f
  for (int64_t l = 0; l < layers; ++l) {
    for (const Shape& s : std::vector<Shape>{{d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d},
                                             {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}})
      shapes.push_back(s);
  }
  int64_t params = 0;
  std::vector<Tensor> keep;
  const auto make = [&](MemoryCategory category, DType dtype) {
    MemoryScope scope(category);
    for (const Shape& s : shapes) keep.push_back(empty(s, TensorOptions(dtype).device(kMeta)));
  };
  for (const Shape& s : shapes) params += numel(s);
  make(MemoryCategory::parameter, DType::bf16);        // compute weights
  make(MemoryCategory::gradient, DType::bf16);         // gradients
  for (int i = 0; i < 3; ++i) make(MemoryCategory::optimizer_state, DType::f32);  // master, m, v
  const MemoryStats s = memory_stats(kMeta);
  std::cout << "== GPT-2 124M model states on the meta device (nothing allocated) ==\n";
  std::cout << "parameters Ψ = " << params << "\n" << memory_report(s, "meta");
  std::printf("bytes per parameter = %.2f  (2 + 2 + 12 = 16: what DDP keeps on every rank)\n\n",
              static_cast<double>(s.allocated_total) / static_cast<double>(params));
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cpu";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
      device = argv[++i];
    } else {
      std::cout << "usage: tour [--device cpu|meta|cuda]\n"
                   "A tour of zerograd tensors and of per-category memory accounting.\n";
      return std::strcmp(argv[i], "--help") == 0 ? 0 : 2;
    }
  }
  try {
    tensors_section();
    mlp_section(Device(device));
    gpt2_section();
  } catch (const Error& e) {
    std::cerr << "tour: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
