// The split backward (autograd/split_backward.h): I then W puts into every .grad what one
// backward() does, bit for bit; I asks the formulas for the inputs' paths only (no weight
// GEMM) and W for the weights'; hooks, callbacks, checkpointed segments and refusals.
#include <thread>

#include "autograd/custom_op.h"
#include "autograd/split_backward.h"
#include "helpers.h"
#include "nn/checkpoint.h"
#include "nn/gpt.h"
#include "tensor/backend.h"

namespace zg::test {
namespace {

const TensorOptions kF64 = TensorOptions(DType::f64);

Tensor leaf(Tensor t) { return t.set_requires_grad(true); }

void clear_grads(const std::vector<Tensor>& leaves) {
  for (const Tensor& t : leaves) t.set_grad(Tensor());
}

std::vector<Tensor> concat(std::vector<Tensor> a, const std::vector<Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A first pass of f: the CPU kernels' thread-local row scratch (a softmax's f64 row) grows
// to its size, and with it where its sums start to vectorise: the same op on the same
// values rounds the same only from then on.
void warm_up(const std::function<Tensor()>& f, const Tensor& grad) { f().backward(grad); }

// Runs f's graph backward whole, then a new graph of f split: the inputs' .grad is
// complete after I, the weights' after W (those in `in_i` -- a checkpointed segment's --
// after I already; the others untouched until W), each identical to backward()'s.
void check_split(const std::function<Tensor()>& f, const Tensor& grad, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor>& weights, const std::vector<Tensor>& in_i = {}) {
  const std::vector<Tensor> leaves = concat(concat(inputs, weights), in_i);
  warm_up(f, grad);
  clear_grads(leaves);
  f().backward(grad);
  std::vector<Tensor> want;
  for (const Tensor& t : leaves) want.push_back(t.grad().clone());
  clear_grads(leaves);

  DeferredWeightGradients w = backward_input(f(), grad, inputs);
  CHECK(w.empty() == weights.empty());
  for (size_t i = 0; i < leaves.size(); ++i) {
    const bool in_w = i >= inputs.size() && i < inputs.size() + weights.size();
    if (in_w) CHECK_FALSE(leaves[i].grad().defined());
    else check_identical(leaves[i].grad(), want[i], "after I: leaf " + std::to_string(i));
  }
  w.run();
  for (size_t i = 0; i < leaves.size(); ++i) check_identical(leaves[i].grad(), want[i], "leaf " + std::to_string(i));
}

TEST_CASE("split backward: a 3-layer MLP's I then W equals backward(), bit for bit") {
  nn::Linear fc1(8, 16, true, std::nullopt, kF64, Activation::gelu), fc2(16, 16, true, std::nullopt, kF64),
      fc3(16, 4, true, std::nullopt, kF64);
  const std::vector<Tensor> weights = concat(concat(fc1.parameters(), fc2.parameters()), fc3.parameters());
  const Tensor x = leaf(randn({2, 3, 8}, kF64)), dy = randn({2, 3, 4}, kF64);
  const auto f = [&] { return fc3.forward(gelu(fc2.forward(fc1.forward(x)))); };
  check_split(f, dy, {x}, weights);

  SUBCASE("W adds into the weights' existing .grad, which I leaves as it is") {
    clear_grads(concat({x}, weights));
    f().backward(dy);
    std::vector<Tensor> want;
    for (const Tensor& p : weights) want.push_back(p.grad() + 0.5);
    for (const Tensor& p : weights) p.set_grad(full_like(p, 0.5));
    x.set_grad(Tensor());
    DeferredWeightGradients w = backward_input(f(), dy, {x});
    for (const Tensor& p : weights) check_identical(p.grad(), full_like(p, 0.5), "after I");
    w.run();
    for (size_t i = 0; i < weights.size(); ++i) check_identical(weights[i].grad(), want[i], "after W");
  }
}

TEST_CASE("split backward: a tied weight, one through a view, a transposed use and a broadcast bias") {
  const Tensor x = leaf(randn({4, 6}, kF64)), x2 = leaf(randn({4, 6}, kF64));
  const Tensor w = leaf(randn({6, 6}, kF64)), b = leaf(randn({6}, kF64)), v = leaf(randn({12}, kF64));
  const auto f = [&] {
    const Tensor h = gelu(matmul(x, w) + b);     // bias broadcast over the rows
    const Tensor h2 = matmul(h * x2, w.t());     // w again, transposed (a column-major operand)
    return matmul(v.view({3, 4}), h2) + sum(w);  // v through a view; w a third time, on no input path
  };
  check_split(f, randn({3, 6}, kF64), {x, x2}, {w, b, v});
  check_split(f, randn({3, 6}, kF64), {x2}, {w, b, v, x});  // x now a weight: W's own
  check_split(f, randn({3, 6}, kF64), {}, {w, b, v, x, x2});  // no input: I runs nothing, W the whole backward
}

namespace {
nn::GPTConfig small_gpt(int64_t layers, bool checkpointing) {
  nn::GPTConfig config;
  config.n_layer = layers, config.n_head = 2, config.n_embd = 16, config.vocab_size = 32, config.block_size = 8;
  config.activation_checkpointing = checkpointing;
  return config;
}
}  // namespace

TEST_CASE("split backward: a GPT block fed an activation that requires grad") {
  nn::Block block(small_gpt(1, false), TensorOptions(DType::f32));
  const Tensor x = leaf(randn({2, 8, 16})), dy = randn({2, 8, 16});
  check_split([&] { return block.forward(x); }, dy, {x}, block.parameters());
}

TEST_CASE("split backward: a checkpointed segment on the input's path runs whole in I") {
  nn::Linear fc1(8, 16, true, std::nullopt, kF64), fc2(16, 16, true, std::nullopt, kF64, Activation::gelu),
      fc3(16, 4, true, std::nullopt, kF64);
  const Tensor x = leaf(randn({5, 8}, kF64)), dy = randn({5, 4}, kF64);
  const auto f = [&] {
    const Tensor h =
        nn::checkpoint([&](const std::vector<Tensor>& in) { return fc2.forward(in[0]); }, {gelu(fc1.forward(x))});
    return fc3.forward(h);
  };
  check_split(f, dy, {x}, concat(fc1.parameters(), fc3.parameters()), fc2.parameters());

  SUBCASE("with no input (a first stage): I runs the checkpointed blocks, W the rest") {
    nn::GPT gpt(small_gpt(2, true), kF64);
    const Tensor idx = randint(0, 32, {2, 8}), targets = randint(0, 32, {2, 8});
    const std::vector<Tensor> params = gpt.parameters();
    const auto loss = [&] { return gpt.forward(idx, targets).loss; };
    warm_up(loss, Tensor());
    clear_grads(params);
    loss().backward();
    std::vector<Tensor> want;
    for (const Tensor& p : params) want.push_back(p.grad().clone());
    clear_grads(params);
    DeferredWeightGradients w = backward_input(loss(), Tensor(), {});
    CHECK_FALSE(w.empty());
    w.run();
    for (size_t i = 0; i < params.size(); ++i) check_identical(params[i].grad(), want[i], std::to_string(i));
  }
}

// Logs which gradients each run of its formula was asked for, and computes only those.
Tensor logged_matmul(const Tensor& a, const Tensor& b, std::vector<std::pair<bool, bool>>& log) {
  static const CustomOp op("split_backward_logged_matmul");
  Tensor out;
  {
    NoGradGuard no_grad;
    out = matmul(a, b);
  }
  return op.apply(out, {a, b}, [a = SavedTensor(a), b = SavedTensor(b), &log](const Tensor& g) {
    log.emplace_back(needs_input_grad(0), needs_input_grad(1));
    const Tensor A = a.get("logged"), B = b.get("logged");
    return std::vector<Tensor>{needs_input_grad(0) ? matmul(g, B, false, true) : Tensor(),
                               needs_input_grad(1) ? matmul(A, g, true, false) : Tensor()};
  });
}

// a * b, whose formula computes both gradients whatever it is asked, counting its runs.
Tensor counted_mul(const Tensor& a, const Tensor& b, int& runs) {
  static const CustomOp op("split_backward_counted_mul");
  Tensor out;
  {
    NoGradGuard no_grad;
    out = a * b;
  }
  return op.apply(out, {a, b}, [a = SavedTensor(a), b = SavedTensor(b), &runs](const Tensor& g) {
    ++runs;
    return std::vector<Tensor>{g * b.get("counted"), g * a.get("counted")};
  });
}

TEST_CASE("split backward: a formula is asked for the inputs' paths in I and the weights' in W") {
  const Tensor x = leaf(randn({3, 4}, kF64)), w = leaf(randn({4, 5}, kF64)), s = leaf(randn({3, 5}, kF64));
  std::vector<std::pair<bool, bool>> log;
  int runs = 0;
  const auto f = [&] { return counted_mul(logged_matmul(x, w, log), s, runs); };
  const Tensor dy = randn({3, 5}, kF64);
  check_split(f, dy, {x}, {w, s});
  using Asked = std::vector<std::pair<bool, bool>>;
  CHECK(log == Asked{{true, true}, {true, true}, {true, false}, {false, true}});  // 2 backward(), then I, then W
  CHECK(runs == 3);  // once in each backward(), once in I: W takes the gradient I's run returned for s
}

// The CPU backend, counting the GEMMs of the input gradients (matmul) and of the weights'
// (linear_weight_grad) while it is installed.
class CountingBackend final : public Backend {
 public:
  CountingBackend() : inner_(backend(kCPU)) { register_backend(DeviceType::cpu, this); }
  ~CountingBackend() override { register_backend(DeviceType::cpu, &inner_); }
  int matmuls = 0, weight_grads = 0;

  std::shared_ptr<Allocator> make_allocator(Device d) override { return inner_.make_allocator(d); }
  void fill(const Tensor& out, double v) override { inner_.fill(out, v); }
  void fill_random(const Tensor& out, const RandomSpec& s) override { inner_.fill_random(out, s); }
  void copy(const Tensor& src, const Tensor& dst) override { inner_.copy(src, dst); }
  void unary(UnaryOp op, const Tensor& in, const Tensor& out) override { inner_.unary(op, in, out); }
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override {
    inner_.binary(op, a, b, out);
  }
  void where(const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& out) override {
    inner_.where(c, a, b, out);
  }
  void reduce(ReduceOp op, const Tensor& in, const Tensor& out) override { inner_.reduce(op, in, out); }
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out) override {
    ++matmuls;
    inner_.matmul(a, b, out);
  }
  void linear(const Tensor& x, const Tensor& w, const Tensor& b, Activation act, const Tensor& out,
              const Tensor& pre) override {
    inner_.linear(x, w, b, act, out, pre);
  }
  void linear_weight_grad(const Tensor& g, const Tensor& x, const Tensor& gw, const Tensor& gb) override {
    ++weight_grads;
    inner_.linear_weight_grad(g, x, gw, gb);
  }
  void softmax(const Tensor& in, bool log, const Tensor& out) override { inner_.softmax(in, log, out); }
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& out, const Tensor& mean,
                  const Tensor& rstd) override {
    inner_.layer_norm(x, w, b, eps, out, mean, rstd);
  }
  void layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                           const Tensor& gx, const Tensor& gw, const Tensor& gb) override {
    inner_.layer_norm_backward(g, x, w, mean, rstd, gx, gw, gb);
  }
  void embedding(const Tensor& w, const Tensor& idx, const Tensor& out) override { inner_.embedding(w, idx, out); }
  void adamw(const Tensor& master, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& compute,
             const AdamWStep& step) override {
    inner_.adamw(master, g, m, v, compute, step);
  }
  void embedding_backward(const Tensor& g, const Tensor& idx, const Tensor& gw) override {
    inner_.embedding_backward(g, idx, gw);
  }
  void quantize_blocks(const Tensor& in, int bits, int64_t block, int64_t segment, const Tensor& q,
                       const Tensor& s) override {
    inner_.quantize_blocks(in, bits, block, segment, q, s);
  }
  void dequantize_blocks(const Tensor& q, const Tensor& s, int bits, int64_t block, int64_t segment,
                         const Tensor& out) override {
    inner_.dequantize_blocks(q, s, bits, block, segment, out);
  }
  void sort_rows(const Tensor& in, bool descending, const Tensor& idx) override {
    inner_.sort_rows(in, descending, idx);
  }
  void cumsum_rows(const Tensor& in, const Tensor& out) override { inner_.cumsum_rows(in, out); }
  void cross_entropy(const Tensor& x, const Tensor& t, int64_t ignore, const Tensor& loss) override {
    inner_.cross_entropy(x, t, ignore, loss);
  }
  void cross_entropy_backward(const Tensor& x, const Tensor& t, int64_t ignore, const Tensor& loss, const Tensor& g,
                              const Tensor& gx) override {
    inner_.cross_entropy_backward(x, t, ignore, loss, g, gx);
  }

 private:
  Backend& inner_;
};

TEST_CASE("split backward: I runs no weight GEMM, W no input GEMM") {
  nn::Linear fc1(8, 16, true, std::nullopt, kF64, Activation::gelu), fc2(16, 4, false, std::nullopt, kF64);
  const Tensor x = leaf(randn({5, 8}, kF64)), w1 = leaf(randn({12, 4}, kF64)), b1 = leaf(randn({12}, kF64)),
               w2 = leaf(randn({4, 12}, kF64)), b2 = leaf(randn({4}, kF64));
  // Linear layers, then the fused mlp (whose weight gradients need dh = g W2: W computes it again).
  const Tensor out = mlp(fc2.forward(fc1.forward(x)), w1, b1, w2, b2);
  CountingBackend counting;
  DeferredWeightGradients w = backward_input(out, randn({5, 4}, kF64), {x});
  CHECK(counting.weight_grads == 0);
  CHECK(counting.matmuls == 4);  // dx of fc1, fc2, and the mlp's dh and dx
  counting.matmuls = 0;
  w.run();
  CHECK(counting.weight_grads == 4);
  CHECK(counting.matmuls == 1);  // the mlp's dh
}

TEST_CASE("split backward: hooks, retained grads and end-of-pass callbacks run in the pass that completes them") {
  const Tensor x = leaf(randn({3, 4}, kF64)), w1 = leaf(randn({4, 4}, kF64)), w2 = leaf(randn({4, 2}, kF64));
  std::vector<std::string> events;
  std::string pass;
  const auto note = [&](const std::string& what) { events.push_back(pass + ": " + what); };
  x.register_post_accumulate_grad_hook([&](const Tensor&) {
    note("x accumulated");
    queue_backward_callback([&] { note("callback queued by x"); });
  });
  w1.register_post_accumulate_grad_hook([&](const Tensor&) {
    note("w1 accumulated");
    queue_backward_callback([&] { note("callback queued by w1"); });
  });
  const Tensor h = gelu(matmul(x, w1));
  h.register_hook([&](const Tensor& g) {
    note("h's hook");
    return g;
  });
  const Tensor w2_scaled = w2 * 2.0;  // on no path to x
  w2_scaled.retain_grad();
  w2_scaled.register_hook([&](const Tensor& g) {
    note("w2_scaled's hook");
    return g;
  });
  const Tensor out = sum(matmul(h, w2_scaled));
  pass = "I";
  DeferredWeightGradients w = backward_input(out, Tensor(), {x});
  CHECK_FALSE(w2_scaled.grad().defined());
  pass = "W";
  w.run();
  CHECK(w2_scaled.grad().defined());
  CHECK(events == std::vector<std::string>{"I: h's hook", "I: x accumulated", "I: callback queued by x",
                                           "W: w2_scaled's hook", "W: w1 accumulated", "W: callback queued by w1"});
}

TEST_CASE("split backward: refusals") {
  const Tensor x = leaf(randn({3, 4}, kF64)), w = leaf(randn({4, 2}, kF64)), unused = leaf(randn({2}, kF64));
  const auto graph = [&] { return sum(matmul(x, w)); };
  CHECK_THROWS_WITH_AS(
      backward_input(graph(), Tensor(), {unused}),
      "backward_input: input 0 f64[2] on cpu is not reachable from the output f64[] on cpu; no gradient "
      "of it would flow",
      Error);
  CHECK_THROWS_WITH_AS(backward_input(graph(), Tensor(), {x, x * 2.0}),
                       doctest::Contains("backward_input: input 1 f64[3, 4]"), Error);
  CHECK_THROWS_WITH_AS(backward_input(graph(), Tensor(), {x, x * 2.0}),
                       doctest::Contains("is not a leaf that requires grad"), Error);
  CHECK_THROWS_WITH_AS(backward_input(graph(), Tensor(), {randn({2})}),
                       doctest::Contains("is not a leaf that requires grad"), Error);
  CHECK_THROWS_WITH_AS(backward_input(randn({2}), Tensor(), {x}),
                       "backward_input: f32[2] on cpu does not require grad (no recorded op leads to it)", Error);
  CHECK_THROWS_WITH_AS(backward_input(matmul(x, w), Tensor(), {x}),
                       doctest::Contains("pass the gradient of the output"), Error);

  DeferredWeightGradients once = backward_input(graph(), Tensor(), {x});
  once.run();
  CHECK(once.empty());
  const char* again =
      "DeferredWeightGradients::run: the weight gradients were computed already (or this was moved from); W runs once";
  CHECK_THROWS_WITH_AS(once.run(), again, Error);
  DeferredWeightGradients moved = backward_input(graph(), Tensor(), {x});
  DeferredWeightGradients to = std::move(moved);
  CHECK_THROWS_WITH_AS(moved.run(), again, Error);

  std::string elsewhere;
  std::thread([&] {
    try {
      to.run();
    } catch (const Error& e) {
      elsewhere = e.what();
    }
  }).join();
  CHECK(elsewhere.find("called on another thread") != std::string::npos);
  to.run();  // still runnable on its own thread

  const Tensor h = matmul(x, w);
  h.register_hook([&](const Tensor& g) {
    backward_input(sum(x * 2.0), Tensor(), {x});
    return g;
  });
  CHECK_THROWS_WITH_AS(sum(h).backward(), doctest::Contains("backward_input: called inside a backward pass"), Error);
}

TEST_CASE("split backward: without weights W is empty, and one not run frees the graph") {
  const Tensor x = leaf(randn({3, 4}, kF64)), w = leaf(randn({4, 2}, kF64));
  CHECK(backward_input(sum(x * x), Tensor(), {x}).empty());
  const Tensor out = sum(matmul(x, w));
  { const DeferredWeightGradients dropped = backward_input(out, Tensor(), {x}); }
  CHECK_FALSE(w.grad().defined());
  CHECK_THROWS_WITH_AS(out.backward(), doctest::Contains("was freed by an earlier backward()"), Error);
}

}  // namespace
}  // namespace zg::test
