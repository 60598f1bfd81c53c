// Autograd: a gradcheck case for every differentiable op (the registry of ops is
// checked against this table, so a new op without a case fails here), and the
// engine's behaviour: accumulation, retain_graph, hooks, grad mode, version checks.
#include <map>

#include "autograd/custom_op.h"
#include "autograd/gradcheck.h"
#include "autograd/record.h"
#include "helpers.h"
#include "nn/checkpoint.h"

namespace zg::test {
namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
struct GradCase {
  std::vector<Tensor> inputs;  // f64; those that require grad are checked
  Fn fn;
  double eps = 1e-6, atol = 1e-6, rtol = 1e-4;
  bool needs_gpu = false;
};

TensorOptions f64_on(Device d) { return TensorOptions(DType::f64).device(d); }
Tensor leaf(Tensor t) { return t.set_requires_grad(true); }
Tensor normal_leaf(const Shape& s, Device d) { return leaf(randn(s, f64_on(d))); }
Tensor positive_leaf(const Shape& s, Device d) { return leaf(uniform(s, 0.5, 2.0, f64_on(d))); }
// Values at least 0.1 apart, so max/min/relu/abs have no tie or kink within eps.
Tensor spread_leaf(const Shape& s, Device d) {
  Tensor t = arange(0.0, static_cast<double>(numel(s)), 1.0, f64_on(d)) * 0.37 - 1.13;
  std::vector<double> v = t.to_vector<double>();
  for (size_t i = 0; i < v.size(); ++i) std::swap(v[i], v[(i * 7919) % v.size()]);
  return leaf(tensor(v, s, f64_on(d)));
}

#define FN [](const std::vector<Tensor>& x) -> Tensor

// Megatron's collectives (dist/comm/differentiable.h) run here over the trivial group,
// where each is the identity; test_tensor_parallel checks them at T = 2 and 4.
dist::ProcessGroup& single_rank() {
  static dist::SingleRank group;
  return group;
}

std::map<std::string, GradCase> grad_cases(Device d) {
  const Tensor idx = tensor<int64_t>({0, 3, 3, 1, 4, 0}, {2, 3}, TensorOptions(DType::i64).device(d));
  const Tensor target = tensor<int64_t>({2, -100, 0, 4}, {4}, TensorOptions(DType::i64).device(d));
  std::map<std::string, GradCase> c;
  c["neg"] = {{normal_leaf({3, 4}, d)}, FN { return neg(x[0]); }};
  c["abs"] = {{spread_leaf({3, 4}, d)}, FN { return abs(x[0]); }};
  c["exp"] = {{normal_leaf({3, 4}, d)}, FN { return exp(x[0]); }};
  c["log"] = {{positive_leaf({3, 4}, d)}, FN { return log(x[0]); }};
  c["sqrt"] = {{positive_leaf({3, 4}, d)}, FN { return sqrt(x[0]); }};
  c["rsqrt"] = {{positive_leaf({3, 4}, d)}, FN { return rsqrt(x[0]); }};
  c["sin"] = {{normal_leaf({3, 4}, d)}, FN { return sin(x[0]); }};
  c["cos"] = {{normal_leaf({3, 4}, d)}, FN { return cos(x[0]); }};
  c["tanh"] = {{normal_leaf({3, 4}, d)}, FN { return tanh(x[0]); }};
  c["sigmoid"] = {{normal_leaf({3, 4}, d)}, FN { return sigmoid(x[0]); }};
  c["relu"] = {{spread_leaf({3, 4}, d)}, FN { return relu(x[0]); }};
  c["gelu"] = {{normal_leaf({3, 4}, d)}, FN { return gelu(x[0]); }};
  c["add"] = {{normal_leaf({2, 3, 4}, d), normal_leaf({3, 1}, d)}, FN { return x[0] + x[1]; }};
  c["sub"] = {{normal_leaf({4, 1}, d), normal_leaf({1, 5}, d)}, FN { return x[0] - x[1]; }};
  c["mul"] = {{normal_leaf({2, 3}, d), normal_leaf({3}, d)}, FN { return x[0] * x[1] * 1.5; }};
  c["div"] = {{normal_leaf({2, 3}, d), positive_leaf({2, 1}, d)}, FN { return x[0] / x[1]; }};
  c["pow"] = {{positive_leaf({2, 3}, d), normal_leaf({2, 3}, d)}, FN { return pow(x[0], x[1]) + pow(x[0], 3.0); }};
  c["maximum"] = {{spread_leaf({3, 4}, d), spread_leaf({4}, d)}, FN { return maximum(x[0], x[1]); }};
  c["minimum"] = {{spread_leaf({3, 4}, d), spread_leaf({3, 1}, d)}, FN { return minimum(x[0], x[1]); }};
  c["where"] = {{normal_leaf({3, 4}, d), normal_leaf({4}, d)},
                FN { return where(gt(x[0], 0.0), x[0], x[1]) + masked_fill(x[1], lt(x[1], 0.0), 2.0); }};
  c["sum"] = {{normal_leaf({2, 3, 4}, d)}, FN { return sum(x[0], {0, 2}, true) + sum(x[0]); }};
  c["mean"] = {{normal_leaf({2, 3, 4}, d)}, FN { return mean(x[0], {1}); }};
  c["max"] = {{spread_leaf({2, 3, 4}, d)}, FN { return max(x[0], {-1}); }};
  c["min"] = {{spread_leaf({2, 3, 4}, d)}, FN { return min(x[0], {0, 1}, true); }};
  c["matmul"] = {{normal_leaf({2, 1, 3, 4}, d), normal_leaf({3, 5, 4}, d), normal_leaf({4}, d)},
                 FN { return matmul(x[0], x[1], false, true) + matmul(x[0], x[2]).unsqueeze(-1); }};
  c["linear"] = {{normal_leaf({2, 3, 5}, d), normal_leaf({4, 5}, d), normal_leaf({4}, d)},
                 FN { return linear(x[0], x[1], x[2], Activation::gelu) + linear(x[0], x[1], x[2]) +
                             linear(x[0], x[1], Tensor(), Activation::gelu); }};
  c["mlp"] = {{normal_leaf({2, 3, 5}, d), normal_leaf({4, 5}, d), normal_leaf({4}, d), normal_leaf({6, 4}, d),
               normal_leaf({6}, d)},
              FN { return mlp(x[0], x[1], x[2], x[3], x[4]) + mlp(x[0], x[1], Tensor(), x[3], Tensor()); }};
  c["softmax"] = {{normal_leaf({3, 4, 5}, d)}, FN { return softmax(x[0], 1); }};
  c["log_softmax"] = {{normal_leaf({3, 5}, d)}, FN { return log_softmax(x[0], -1); }};
  c["layer_norm"] = {{normal_leaf({2, 3, 6}, d), normal_leaf({6}, d), normal_leaf({6}, d)},
                     FN { return layer_norm(x[0], x[1], x[2]) + layer_norm(x[0], Tensor(), Tensor()); }};
  c["add_layer_norm"] = {{normal_leaf({2, 3, 6}, d), normal_leaf({2, 3, 6}, d), normal_leaf({6}, d), normal_leaf({6}, d)},
                         FN {
                           const AddLayerNormOutput r = add_layer_norm(x[0], x[1], x[2], x[3]);
                           return r.sum * r.out;  // the sum's gradient comes both ways
                         }};
  c["embedding"] = {{normal_leaf({5, 3}, d)}, [idx](const std::vector<Tensor>& x) { return embedding(x[0], idx); }};
  c["cross_entropy"] = {{normal_leaf({4, 5}, d)},
                        [target](const std::vector<Tensor>& x) { return cross_entropy(x[0], target); }};
  c["scaled_dot_product_attention"] = {  // k and v broadcast over q's batch (their backward failed)
      {normal_leaf({2, 4, 3}, d), normal_leaf({1, 4, 3}, d), normal_leaf({1, 4, 2}, d)},
      FN { return scaled_dot_product_attention(x[0], x[1], x[2], true) +
                  scaled_dot_product_attention(x[0], x[1], x[2], false); }};
  c["packed_attention"] = {{normal_leaf({2, 3, 12}, d)},
                           FN { return packed_attention(x[0], 2, true) * packed_attention(x[0], 2, false); }};
  const Tensor gather_index = tensor<int64_t>({0, 4, 4, 1, 2, 0}, {2, 3, 1}, TensorOptions(DType::i64).device(d));
  c["scatter_add"] = {{normal_leaf({2, 5, 1}, d), normal_leaf({2, 3, 1}, d)},
                      [gather_index](const std::vector<Tensor>& x) { return scatter_add(x[0], 1, gather_index, x[1]) * x[0]; }};
  c["gather, index_select, stack"] = {{normal_leaf({2, 5, 1}, d)}, [gather_index, idx](const std::vector<Tensor>& x) {
                                        return stack({gather(x[0], 1, gather_index), index_select(x[0], 1, idx.select(0, 0))}, 0);
                                      }};
  c["sort, topk"] = {{spread_leaf({3, 5}, d)}, FN { return sort(x[0], 1, true).values * topk(x[0], 5, 1, false).values; }};
  c["erf"] = {{normal_leaf({3, 4}, d)}, FN { return erf(x[0]) * gelu_exact(x[0]); }};
  c["silu, clamp"] = {{spread_leaf({3, 4}, d)}, FN { return silu(x[0]) + clamp(x[0], -0.5, 0.75); }};
  c["log1p"] = {{positive_leaf({3, 4}, d)}, FN { return log1p(x[0] - 0.45); }};
  c["cumsum"] = {{normal_leaf({2, 3, 4}, d)}, FN { return cumsum(x[0], 1) * cumsum(x[0].transpose(0, 2), -1).transpose(0, 2); }};
  c["softplus, leaky_relu"] = {{spread_leaf({3, 4}, d)},
                               FN { return softplus(x[0], 2.0, 1.5) + softplus(x[0]) * leaky_relu(x[0], 0.2); }};
  c["flip, repeat, chunk, unbind"] = {{normal_leaf({2, 3}, d)}, FN {
                                        const std::vector<Tensor> parts = chunk(flip(x[0], {0, 1}), 2, 1);
                                        return repeat(parts[0], {1, 2}) * unbind(x[0], 1)[0].unsqueeze(1) + sum(parts[1]);
                                      }};
  c["pad"] = {{normal_leaf({2, 3, 4}, d)}, FN {
                return pad(x[0], {1, 2, -1, 1}, PadMode::constant, 0.5) * pad(x[0], {2, 1, 0, 1}, PadMode::reflect).narrow(1, 1, 3) +
                       pad(x[0], {1, 2, 1, 0}, PadMode::replicate).narrow(1, 0, 3);
              }};
  c["norm, normalize"] = {{spread_leaf({3, 4}, d)}, FN {
                            return norm(x[0], 2, {1}) + norm(x[0], 1, {1}) + norm(x[0], 3, {1}) +
                                   norm(x[0], INFINITY, {1}) * sum(normalize(x[0], 2, 1) * x[0], {1});
                          }};
  c["einsum"] = {{normal_leaf({2, 3, 4}, d), normal_leaf({2, 4, 5}, d), normal_leaf({5}, d)}, FN {
                   return einsum("bij,bjk,k->ib", {x[0], x[1], x[2]}) + einsum("bij->ib", {x[0]}) +
                          einsum("bij,k->ib", {x[0], x[2]});
                 }};
  c["logsumexp, var, std"] = {{normal_leaf({2, 3, 4}, d)},
                              FN { return logsumexp(x[0], {1}) + var(x[0], {1}) + std(x[0], {1}, false, 0); }};
  c["tril, triu"] = {{normal_leaf({2, 3, 4}, d)}, FN { return tril(x[0], 1) * triu(x[0]); }};
  c["rms_norm, rotary_embedding"] = {{normal_leaf({2, 3, 6}, d), normal_leaf({6}, d)},
                                     FN { return rotary_embedding(rms_norm(x[0], x[1]), 2); }};
  c["attention dropout, dropout"] = {{normal_leaf({2, 4, 3}, d), normal_leaf({2, 4, 3}, d), normal_leaf({2, 4, 3}, d)},
                                     FN {
                                       manual_seed(3);  // the same masks at every evaluation
                                       return scaled_dot_product_attention(dropout(x[0], 0.25), x[1], x[2], true, 0.3);
                                     }};
  c["grouped-query attention"] = {{normal_leaf({1, 4, 3, 2}, d), normal_leaf({1, 2, 3, 2}, d), normal_leaf({1, 2, 3, 2}, d)},
                                  FN { return scaled_dot_product_attention(x[0], x[1], x[2], true); }};
  c["losses"] = {{normal_leaf({4, 5}, d), uniform(Shape{4, 5}, 0.1, 0.9, f64_on(d)).set_requires_grad(true)},
                 [target](const std::vector<Tensor>& x) {
                   return mse_loss(x[0], x[1]) + nll_loss(log_softmax(x[0]), target) +
                          binary_cross_entropy(x[1], sigmoid(x[0])) + binary_cross_entropy_with_logits(x[0], x[1]);
                 }};
  c["cat"] = {{normal_leaf({2, 3}, d), normal_leaf({2, 2}, d)}, FN { return cat({x[0], x[1] * 2.0}, 1); }};
  c["view"] = {{normal_leaf({2, 6}, d)}, FN { return x[0].view({3, 4}) * x[0].t().reshape({3, 4}); }};
  c["permute"] = {{normal_leaf({2, 3, 4}, d)}, FN { return x[0].permute({2, 0, 1}) * 2.0; }};
  c["transpose"] = {{normal_leaf({2, 3}, d)}, FN { return x[0].transpose(0, 1) * 2.0; }};
  c["narrow"] = {{normal_leaf({4, 3}, d)}, FN { return x[0].narrow(0, 1, 2) * 3.0; }};
  c["slice"] = {{normal_leaf({6, 2}, d)}, FN { return x[0].slice(0, 1, 6, 2) * 3.0; }};
  c["select"] = {{normal_leaf({3, 4}, d)}, FN { return x[0].select(1, 2) * 3.0; }};
  c["expand"] = {{normal_leaf({3, 1}, d)}, FN { return x[0].expand({2, 3, 4}) * 3.0; }};
  c["squeeze"] = {{normal_leaf({3, 1, 2}, d)}, FN { return x[0].squeeze(1) * x[0].squeeze().unsqueeze(1).squeeze(1); }};
  c["unsqueeze"] = {{normal_leaf({3, 2}, d)}, FN { return x[0].unsqueeze(0) * 3.0; }};
  c["clone"] = {{normal_leaf({3, 2}, d)}, FN { return x[0].t().contiguous() * x[0].t().clone(); }};
  c["to_dtype"] = {{normal_leaf({3, 2}, d)}, FN { return x[0].to(DType::f32).to(DType::f64) * 2.0; }, 1e-2, 1e-4, 1e-4};
  c["checkpoint"] = {{normal_leaf({3, 4}, d), normal_leaf({4}, d)}, FN {
                       return nn::checkpoint([](const std::vector<Tensor>& in) { return tanh(in[0] * in[1]) * in[0]; },
                                             {x[0], x[1]});
                     }};
  c["copy_to_group"] = {{normal_leaf({3, 4}, d)}, FN { return dist::copy_to_group(x[0], single_rank()); }};
  c["reduce_from_group"] = {{normal_leaf({3, 4}, d)}, FN { return dist::reduce_from_group(x[0], single_rank()); }};
  c["all_gather_sequence"] = {{normal_leaf({3, 4}, d)}, FN { return dist::all_gather_sequence(x[0], single_rank(), 1); }};
  c["reduce_scatter_sequence"] = {{normal_leaf({3, 4}, d)},
                                  FN { return dist::reduce_scatter_sequence(x[0], single_rank()); }};
  c["gather_last_dim"] = {{normal_leaf({3, 4}, d)}, FN { return dist::gather_last_dim(x[0], single_rank()); }};
  c["split_last_dim"] = {{normal_leaf({3, 4}, d)}, FN { return dist::split_last_dim(x[0], single_rank()); }};
  c["scatter_to_sequence"] = {{normal_leaf({3, 4}, d)},
                              FN { return dist::scatter_to_sequence(x[0], single_rank(), 1); }};
  c["gather_from_sequence"] = {{normal_leaf({3, 4}, d)},
                               FN { return dist::gather_from_sequence(x[0], single_rank()); }};
  c["vocab_parallel_cross_entropy"] = {
      {normal_leaf({4, 5}, d)}, [d](const std::vector<Tensor>& x) {
        const Tensor ids = tensor<int64_t>({2, 0, 4, 1}, {4}, TensorOptions(DType::i64).device(d));
        return dist::vocab_parallel_cross_entropy(x[0], ids, single_rank());
      }};
  c["to_device"] = {{normal_leaf({3, 2}, d)}, FN { return (x[0].to(kCUDA) * 2.0).to(kCPU); }, 1e-6, 1e-6, 1e-4, true};
  return c;
}

}  // namespace

TEST_CASE("every differentiable op has a gradcheck case") {
  const auto cases = grad_cases(kCPU);
  for (const std::string& op : DifferentiableOp::all()) {
    INFO("op without a gradcheck case: " << op);
    CHECK(cases.count(op) == 1);
  }
  CHECK(DifferentiableOp::all().size() >= 40);
  std::map<std::string, int> uses;
  for (const std::string& op : DifferentiableOp::all()) ++uses[op];
  for (const auto& [op, count] : uses) {
    const std::string& name = op;  // INFO's lambda cannot capture a structured binding (Clang)
    INFO("two ops named " << name);
    CHECK(count == 1);
  }
}

TEST_CASE("gradcheck passes for every differentiable op in f64") {
  for (Device device : devices()) {
    manual_seed(99);
    for (const auto& [name, c] : grad_cases(device)) {
      if (c.needs_gpu && devices().size() < 2) continue;
      const GradcheckResult r = gradcheck(c.fn, c.inputs, c.eps, c.atol, c.rtol);
      const std::string& case_name = name;  // INFO's lambda cannot capture a structured binding (Clang)
      INFO(case_name << " on " << device.str() << ": " << r.message);
      CHECK(r.ok);
    }
  }
}

// The custom-op example of autograd/custom_op.h, as a user writes it.
Tensor cube(const Tensor& x) {
  static const CustomOp op("cube");
  Tensor y;
  {
    NoGradGuard no_grad;
    y = x * x * x;
  }
  return op.apply(y, {x}, [saved = SavedTensor(x)](const Tensor& g) {
    const Tensor x = saved.get("cube");
    return std::vector<Tensor>{g * x * x * 3.0};
  });
}

TEST_CASE("a custom op records its formula, passes gradcheck, and is held to one right gradient per input") {
  const Tensor x = randn({3, 4}, DType::f64).set_requires_grad(true);
  CHECK(cube(x).grad_fn()->name() == "cube");
  CHECK(gradcheck(FN { return cube(x[0]); }, {x}).ok);
  CHECK_THROWS_WITH_AS(CustomOp("cube"), "CustomOp: an op named 'cube' exists already; give each op its own name "
                                         "(a function-local static makes one per op)", Error);
  CHECK_THROWS_WITH_AS(CustomOp("matmul"), "CustomOp: 'matmul' is the name of one of zerograd's ops; choose another", Error);

  static const CustomOp two_inputs("test two inputs");
  const Tensor y = randn({4}, DType::f64).set_requires_grad(true);
  const auto run = [&](const std::function<std::vector<Tensor>(const Tensor&)>& formula) {
    Tensor out;
    {
      NoGradGuard no_grad;
      out = x * y;
    }
    sum(two_inputs.apply(out, {x, y}, formula)).backward();
  };
  CHECK_THROWS_WITH_AS(run([](const Tensor& g) { return std::vector<Tensor>{g}; }),
                       "backward of test two inputs: its formula returned 1 gradient for 2 inputs; return one per "
                       "input, an undefined Tensor for an input that gets none", Error);
  CHECK_THROWS_WITH_AS(run([](const Tensor& g) { return std::vector<Tensor>{g, Tensor(), Tensor()}; }),
                       doctest::Contains("returned 3 gradients for 2 inputs"), Error);
  // An error inside the formula names this op, not only the op that raised it.
  CHECK_THROWS_WITH_AS(run([](const Tensor& g) { return std::vector<Tensor>{matmul(g, g), Tensor()}; }),
                       doctest::Contains("backward of test two inputs: matmul: "), Error);
  CHECK_THROWS_WITH_AS(run([](const Tensor& g) { return std::vector<Tensor>{g, g}; }),
                       doctest::Contains("backward's gradient for input 1 is f64[3, 4] on cpu, but the input was f64[4] on cpu"),
                       Error);
  CHECK_THROWS_WITH_AS(run([&](const Tensor& g) { return std::vector<Tensor>{g.to(DType::f32), Tensor()}; }),
                       doctest::Contains("gradient for input 0 is f32[3, 4]"), Error);
  run([&](const Tensor& g) { return std::vector<Tensor>{g * y, Tensor()}; });  // none for y: allowed
  CHECK(x.grad().defined());
  CHECK_FALSE(y.grad().defined());
  CHECK_THROWS_WITH_AS(two_inputs.apply(x, {x}, [](const Tensor& g) { return std::vector<Tensor>{g}; }),
                       doctest::Contains("the output is a leaf that requires grad"), Error);
}

TEST_CASE("gradcheck on f32 inputs says they should be f64") {
  const Tensor x = randn({2, 3}).set_requires_grad(true);
  const GradcheckResult r = gradcheck(FN { return x[0] * x[0] * x[0]; }, {x});
  CHECK_FALSE(r.ok);
  CHECK(r.message.find("need f64 inputs -- pass x.to(DType::f64)") != std::string::npos);
}

TEST_CASE("gradcheck catches a wrong formula") {
  // d/dx of x * stop_gradient(x) is x, not 2x: detach makes backward "wrong" for the true function.
  const Tensor x = normal_leaf({3}, kCPU);
  const GradcheckResult r = gradcheck(FN { return x[0] * x[0].detach(); }, {x});
  CHECK_FALSE(r.ok);
  CHECK(r.message.find("element 0") != std::string::npos);
}

TEST_CASE("gradients accumulate over paths and over backward calls") {
  const Tensor x = leaf(tensor<double>({1, 2, 3}));
  const Tensor y = sum(x * x + x);  // dy/dx = 2x + 1
  y.backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 5, 7});
  sum(x * 2.0).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{5, 7, 9});
  CHECK(x.grad().storage()->category() == MemoryCategory::gradient);
}

TEST_CASE("grad() is a handle: an in-place write zeroes the gradient itself") {
  const Tensor x = leaf(tensor<double>({1, 2, 3}));
  sum(x * x).backward();
  const Tensor before = x.grad();
  x.grad().zero_();  // did not compile: grad() returned a const Tensor&
  CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 0, 0});
  CHECK(x.grad().is_same(before));  // the same tensor, written in place
  sum(x * 2.0).backward();          // accumulates from zero
  CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 2, 2});
}

TEST_CASE("backward of a non-scalar needs its gradient") {
  const Tensor x = leaf(tensor<double>({1, 2}));
  const Tensor y = x * 3.0;
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("f64[2] on cpu has 2 elements; pass the gradient"), Error);
  CHECK_THROWS_WITH_AS(sum(x, {0}, true).narrow(0, 0, 0).backward(), doctest::Contains("has 0 elements"), Error);
  y.backward(tensor<double>({1, 10}));
  CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 30});
  CHECK_THROWS_WITH_AS(tensor<double>({1}).backward(), doctest::Contains("does not require grad"), Error);
}

TEST_CASE("a node's saved tensors are freed as soon as it has run") {
  // They were all freed at the end of the pass: every layer's activations stayed until
  // the first layer's backward. With a checkpoint in the graph, the nodes newer than it
  // still go at once (the recompute reaches only older ones).
  for (bool with_checkpoint : {false, true}) {
    const Tensor x = leaf(tensor<double>({1, 2}));
    Tensor h = with_checkpoint ? nn::checkpoint([](const std::vector<Tensor>& in) { return in[0] * 3.0; }, {x}) : x;
    Tensor e = exp(h * 2.0);  // exp keeps its output for backward
    const std::weak_ptr<Storage> saved = e.storage();
    const Tensor loss = sum(e);
    e = h = Tensor();
    bool freed_before_leaf = false;
    x.register_hook([&](const Tensor&) {
      freed_before_leaf = saved.expired();
      return Tensor();
    });
    loss.backward();
    CHECK(freed_before_leaf);
  }
}

TEST_CASE("cross_entropy writes its gradient over logits that nothing else reads") {
  // As llm.c: once the caller has dropped the logits, their buffer takes the gradient,
  // and backward needs no second buffer the size of the largest activation. Logits the
  // caller holds, or a graph it retains, keep theirs. The gradients are the same.
  for (Device d : devices()) {
    const Tensor x = randn({3, 8}, TensorOptions().device(d));
    const Tensor w0 = randn({8, 700}, TensorOptions().device(d));  // more classes than a CUDA block has threads
    const Tensor target = tensor<int64_t>({5, 699, 0}).to(d);
    std::vector<float> reference;
    for (const std::string use : {"held", "dropped", "retained"}) {
      CAPTURE(use);
      const Tensor w = leaf(w0.clone());
      Tensor logits = matmul(x, w);
      const void* logits_data = logits.data_ptr();
      const void* grad_data = nullptr;
      logits.register_hook([&](const Tensor& g) {
        grad_data = g.data_ptr();
        return Tensor();
      });
      const Tensor loss = cross_entropy(logits, target);
      const Tensor held = use == "held" ? logits : Tensor();
      const std::vector<float> before = logits.to_vector<float>();
      logits = Tensor();
      const bool retain = use == "retained";
      loss.backward(Tensor(), retain);
      CHECK((grad_data == logits_data) == (use == "dropped"));
      if (held.defined()) CHECK(held.to_vector<float>() == before);
      if (retain) {  // the second pass finds the logits as the first left them, and frees them
        loss.backward();
        CHECK(grad_data == logits_data);
      }
      const std::vector<float> grad = (retain ? w.grad() * 0.5 : w.grad()).to_vector<float>();
      if (reference.empty()) reference = grad;
      else CHECK(grad == reference);
    }
  }
}

TEST_CASE("retain_graph") {
  const Tensor x = leaf(tensor<double>({2}));
  const Tensor y = sum(exp(x));
  y.backward(Tensor(), true);
  y.backward();
  CHECK(x.grad().item<double>() == doctest::Approx(2 * std::exp(2.0)));
  // The message names the op the caller wrote (a reduction is recorded in its own shape).
  CHECK_THROWS_WITH_AS(y.backward(), "backward: the graph through sum was freed by an earlier backward(); pass "
                       "retain_graph=true to go through it twice", Error);
  const Tensor z = mean(exp(x), {0}, true);
  z.backward(ones_like(z));
  CHECK_THROWS_WITH_AS(z.backward(ones_like(z)), doctest::Contains("the graph through mean was freed"), Error);
  const Tensor s = sum(leaf(tensor<double>({3}, {})));  // 0-d in, 0-d out
  CHECK(s.shape() == Shape{});
  s.backward();
  CHECK_THROWS_WITH_AS(s.backward(), doctest::Contains("the graph through sum was freed"), Error);
}

TEST_CASE("grad mode, detach and requires_grad propagation") {
  const Tensor x = leaf(tensor<double>({1, 2}));
  const Tensor c = tensor<double>({5, 6});
  CHECK((x * c).requires_grad());
  CHECK_FALSE((c * c).requires_grad());
  CHECK_FALSE(x.detach().requires_grad());
  CHECK(x.detach().storage() == x.storage());
  {
    NoGradGuard no_grad;
    CHECK_FALSE((x * c).requires_grad());
  }
  CHECK((x * c).grad_fn()->name() == "mul");
  CHECK(x.is_leaf());
  CHECK_FALSE((x * c).is_leaf());
  CHECK_THROWS_WITH_AS((x * c).set_requires_grad(true), doctest::Contains("only leaf tensors"), Error);
  CHECK_THROWS_WITH_AS(tensor<int64_t>({1}).set_requires_grad(true),
                       "set_requires_grad: only floating-point tensors can require grad, got i64[1] on cpu", Error);
  CHECK_THROWS_WITH_AS(Tensor(x).fill_(0), doctest::Contains("fill_: in-place write to f64[2] on cpu, which requires grad"),
                       Error);
}

TEST_CASE("a saved tensor modified in place makes backward throw") {
  const Tensor w = leaf(tensor<double>({1, 2}));
  Tensor x = tensor<double>({3, 4});
  const Tensor y = sum(w * x);  // saves x
  x.fill_(0);
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("backward of mul: a tensor saved for it (f64[2] on cpu) was "
                                                       "modified in place after it was saved (version 0 -> 1)"),
                       Error);
}

TEST_CASE("tensor hooks and post-accumulate-grad hooks") {
  const Tensor x = leaf(tensor<double>({1, 2}));
  const Tensor h = x * 2.0;
  h.register_hook([](const Tensor& g) { return g * 10.0; });  // replaces the gradient flowing into h
  int calls = 0;
  std::vector<double> seen;
  x.register_post_accumulate_grad_hook([&](const Tensor& p) {
    ++calls;
    seen = p.grad().to_vector<double>();
  });
  sum(h).backward();
  CHECK(calls == 1);
  CHECK(seen == std::vector<double>{20, 20});
  x.register_hook([](const Tensor& g) { return g * 0.5; });  // leaf hook: before accumulation
  sum(x * 1.0).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{20.5, 20.5});

  // A replacement must fit the gradient (was: broadcast or cast silently on a leaf, an
  // error from deep inside a backward formula on a node).
  const Tensor y = leaf(tensor<double>({1, 2, 3}));
  y.register_hook([](const Tensor&) { return full({1}, 7.0, DType::f64); });
  CHECK_THROWS_WITH_AS(sum(y * 1.0).backward(),
                       "backward: a tensor hook on a leaf f64[3] on cpu returned f64[1] on cpu for the gradient f64[3] "
                       "on cpu; a hook returns a tensor of the gradient's shape, dtype and device, or none", Error);
  const Tensor z = leaf(tensor<double>({1, 2, 3})) * 3.0;
  z.register_hook([](const Tensor& g) { return g.to(DType::f32); });
  CHECK_THROWS_WITH_AS(sum(z).backward(), doctest::Contains("a tensor hook on the output of mul returned f32[3]"), Error);
}

TEST_CASE("of the ready nodes a parameter's AccumulateGrad runs first, then the newest") {
  // A layer's input hook must find the layer's parameters' gradients landed: ZeRO-3
  // reduces a unit's gradient there. In matmul(x, w) the gradient of x (edge 0) and of
  // w become ready together; the queue was first-in first-out, so x's hook ran first.
  const Tensor a = leaf(tensor<double>({1, 2, 3, 4}).reshape({2, 2}));
  const Tensor w = leaf(tensor<double>({1, 0, 0, 1}).reshape({2, 2}));
  const Tensor x = a * 2.0;
  bool w_grad_landed = false;
  x.register_hook([&](const Tensor&) {
    w_grad_landed = w.grad().defined();
    return Tensor();
  });
  // Two branches from x: the newer (recorded later) runs first, whichever was queued first.
  std::vector<std::string> order;
  const Tensor older = x * 3.0, newer = exp(x);
  older.register_hook([&](const Tensor&) {
    order.push_back("older");
    return Tensor();
  });
  newer.register_hook([&](const Tensor&) {
    order.push_back("newer");
    return Tensor();
  });
  sum(matmul(x, w) + newer + older).backward();
  CHECK(w_grad_landed);
  CHECK(order == std::vector<std::string>{"newer", "older"});
}

TEST_CASE("retain_grad keeps a non-leaf's gradient, after its hooks, summed over backward calls") {
  const Tensor x = leaf(tensor<double>({1, 2}));
  const Tensor h = x * 3.0;
  const Tensor loss = sum(h * h);
  CHECK_FALSE(h.retains_grad());
  h.retain_grad();
  loss.retain_grad();
  CHECK(h.retains_grad());
  CHECK_FALSE(x.retains_grad());  // a leaf keeps its gradient without it
  x.retain_grad();
  h.register_hook([](const Tensor& g) { return g * 0.5; });  // registered later, still runs first
  loss.backward(Tensor(), /*retain_graph=*/true);
  CHECK(loss.grad().to_vector<double>() == std::vector<double>{1});
  CHECK(h.grad().to_vector<double>() == std::vector<double>{3, 6});  // 2h/2
  CHECK(x.grad().to_vector<double>() == std::vector<double>{9, 18});
  const Tensor first = h.grad();
  loss.backward();
  CHECK(h.grad().to_vector<double>() == std::vector<double>{6, 12});
  CHECK(first.to_vector<double>() == std::vector<double>{3, 6});  // a new tensor: the one held is unchanged
  CHECK_THROWS_WITH_AS(tensor<double>({1}).retain_grad(),
                       "retain_grad: f64[1] on cpu does not require grad", Error);
}

TEST_CASE("backward called from a hook: on its own graph it runs, on the running graph it is refused") {
  const Tensor x = leaf(tensor<double>({1, 2}));
  const Tensor h = x * 2.0;
  const Tensor loss = sum(h);
  const Tensor y = leaf(tensor<double>({3}));
  h.register_hook([&](const Tensor& g) {
    GradModeGuard record(true);  // a backward pass records nothing unless asked
    sum(y * 4.0).backward();     // a separate graph: a nested pass, as a checkpoint's recompute runs
    return g;
  });
  loss.backward(Tensor(), /*retain_graph=*/true);
  CHECK(y.grad().to_vector<double>() == std::vector<double>{4});
  CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 2});

  // Before, this recursed until the stack overflowed.
  h.register_hook([&](const Tensor& g) {
    loss.backward(Tensor(), true);
    return g;
  });
  CHECK_THROWS_WITH_AS(loss.backward(Tensor(), true), doctest::Contains("called again from within the backward of"),
                       Error);
  // The failed pass left no state behind: the next pass runs.
  const Tensor x2 = leaf(tensor<double>({5}));
  sum(x2 * 3.0).backward();
  CHECK(x2.grad().to_vector<double>() == std::vector<double>{3});
  CHECK_FALSE(backward_in_progress());
}

TEST_CASE("a grad that is a view into a flat buffer is accumulated in place") {
  const Tensor flat_grad = zeros({5}, DType::f64);
  const Tensor a = leaf(tensor<double>({1, 2}));
  const Tensor b = leaf(tensor<double>({3, 4, 5}));
  a.set_grad(flat_grad.narrow(0, 0, 2));
  b.set_grad(flat_grad.narrow(0, 2, 3));
  sum(a * b.narrow(0, 0, 2)).backward();
  CHECK(flat_grad.to_vector<double>() == std::vector<double>{3, 4, 1, 2, 0});
  CHECK(a.grad().storage() == flat_grad.storage());
}

TEST_CASE("set_data re-points a parameter into a flat buffer, keeping its autograd state") {
  const Tensor flat = arange(0.0, 6.0, 1.0, DType::f64);
  const Tensor p = leaf(zeros({2, 2}, DType::f64));
  p.set_data(flat.narrow(0, 2, 4).view({2, 2}));
  CHECK(p.requires_grad());
  CHECK(p.to_vector<double>() == std::vector<double>{2, 3, 4, 5});
  sum(p * p).backward();
  CHECK(p.grad().to_vector<double>() == std::vector<double>{4, 6, 8, 10});
}

TEST_CASE("checkpoint of a function whose result does not depend on its inputs gives them no gradient") {
  // The output requires grad (fn ran without a graph, so that is known only at
  // recompute); backward then finds nothing to differentiate and adds nothing.
  const Tensor x = normal_leaf({3}, kCPU);
  const Tensor out = nn::checkpoint([](const std::vector<Tensor>& in) { return in[0].detach() * 2.0; }, {x});
  CHECK(out.requires_grad());
  sum(out + x).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 1, 1});
  // A function that computes something else the second time (its error named neither).
  const Tensor y = nn::checkpoint(
      [](const std::vector<Tensor>& in) { return backward_in_progress() ? in[0].narrow(0, 0, 1) : in[0] * 1.0; }, {x});
  CHECK_THROWS_WITH_AS(sum(y).backward(),
                       "checkpoint: the recompute in backward returned f64[1] on cpu where the forward returned "
                       "f64[3] on cpu; fn must compute the same thing each time it runs",
                       Error);
}

TEST_CASE("a cast to an integer type or bool is not differentiable") {
  // Its gradient passed through as if rounding were the identity: d/dx sum(x * int(x))
  // was x + int(x) instead of int(x), and sum(int(x) * 2.7) had a gradient of 2.
  const Tensor x = tensor<double>({1.5, 2.5}).set_requires_grad(true);
  CHECK_FALSE(x.to(DType::i64).requires_grad());
  CHECK_FALSE(x.to(DType::boolean).requires_grad());
  sum(x * x.to(DType::i64).to(DType::f64)).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 2});
  CHECK_THROWS_AS(sum(x.to(DType::i64).to(DType::f64) * 2.7).backward(), Error);
}

TEST_CASE("checkpoint of a function that captures a tensor of the outer graph") {
  // The recompute's backward goes on into the outer graph through h; it freed those
  // nodes, so the outer backward failed when it came to them after the checkpoint.
  const auto run = [](const std::function<Tensor(const Tensor& w, const Tensor& x, const Tensor& h)>& loss, bool twice) {
    const Tensor w = tensor<double>({1, 2}).set_requires_grad(true), x = tensor<double>({3, 4}).set_requires_grad(true);
    const Tensor l = loss(w, x, w * 2.0);
    l.backward(Tensor(), twice);
    if (twice) l.backward();
    return std::pair{w.grad().to_vector<double>(), x.grad().to_vector<double>()};
  };
  const auto times_h = [](const Tensor& h) {
    return [h](const std::vector<Tensor>& in) { return in[0] * h; };
  };
  // L = sum(x * h) + sum(h), h = 2w: dL/dw = 2x + 2, dL/dx = h.
  for (bool checkpoint_first : {true, false}) {
    const auto [w_grad, x_grad] = run(
        [&](const Tensor&, const Tensor& x, const Tensor& h) {
          const Tensor y = sum(nn::checkpoint(times_h(h), {x}));
          return checkpoint_first ? y + sum(h) : sum(h) + y;
        },
        false);
    CHECK(w_grad == std::vector<double>{8, 10});
    CHECK(x_grad == std::vector<double>{2, 4});
  }
  // Two checkpoints capturing one h, and an outer backward run twice with retain_graph.
  const auto [w_grad, x_grad] = run(
      [&](const Tensor&, const Tensor& x, const Tensor& h) {
        return sum(nn::checkpoint(times_h(h), {x})) + sum(nn::checkpoint(times_h(h), {x}));
      },
      true);
  CHECK(w_grad == std::vector<double>{24, 32});
  CHECK(x_grad == std::vector<double>{8, 16});
  // An h used only inside the checkpoint: the outer pass never reaches its graph, so
  // the recompute's pass frees it when the outer pass ends (as one backward over both
  // graphs would) -- unless the outer pass retains its graph.
  for (bool retain : {false, true}) {
    const Tensor w = tensor<double>({1, 2}).set_requires_grad(true), x = tensor<double>({3, 4}).set_requires_grad(true);
    const Tensor h = exp(w);
    sum(nn::checkpoint(times_h(h), {x})).backward(Tensor(), retain);
    if (retain) sum(h).backward();
    else CHECK_THROWS_WITH_AS(sum(h).backward(), doctest::Contains("the graph through exp was freed"), Error);
  }
}

TEST_CASE("gradcheck differentiates copies of its inputs, in any grad mode") {
  const Tensor a = normal_leaf({3}, kCPU);
  const Tensor before = ones({3}, DType::f64);
  a.set_grad(before);
  const Tensor non_leaf = a * 2.0;
  {
    NoGradGuard no_grad;  // the caller's mode does not matter
    CHECK(gradcheck(FN { return x[0] * x[1]; }, {a, a}).ok);  // one tensor twice: two inputs
  }
  CHECK(gradcheck(FN { return sin(x[0]); }, {non_leaf}).ok);
  CHECK(a.grad().is_same(before));  // the caller's .grad is left alone
  CHECK(before.to_vector<double>() == std::vector<double>{1, 1, 1});
  CHECK_THROWS_WITH_AS(gradcheck(FN { return x[0]; }, {a}, 0.0), "gradcheck: eps must be positive and finite, got 0",
                       Error);
  CHECK_THROWS_WITH_AS(gradcheck(FN { return gt(x[0], 0.0); }, {a}),
                       "gradcheck: fn must return a floating-point tensor, got bool[3] on cpu", Error);
}

TEST_CASE("queue_backward_callback runs once the outermost backward pass has run its last node") {
  CHECK_THROWS_WITH_AS(queue_backward_callback([] {}), "queue_backward_callback: called outside a backward pass", Error);
  const Tensor x = normal_leaf({2}, kCPU), w = normal_leaf({2}, kCPU);
  std::vector<std::string> order;
  bool fail = false;
  w.register_post_accumulate_grad_hook([&](const Tensor&) {
    order.push_back("accumulated");
    queue_backward_callback([&] {
      order.push_back("end of pass");
      CHECK(GradMode::is_enabled());  // the caller's mode, not the pass's no-grad
    });
    if (fail) throw Error("hook failed");
  });
  // w accumulates inside the checkpoint's recompute (a nested pass) and outside it:
  // both callbacks wait for the outer pass.
  const Tensor y = nn::checkpoint([&w](const std::vector<Tensor>& in) { return in[0] * w; }, {x});
  sum(y + w).backward();
  CHECK(order == std::vector<std::string>{"accumulated", "accumulated", "end of pass", "end of pass"});
  // A pass that throws drops what it queued.
  order.clear();
  fail = true;
  CHECK_THROWS_AS(sum(w * 2.0).backward(), Error);
  fail = false;
  sum(w * 2.0).backward();
  CHECK(order == std::vector<std::string>{"accumulated", "accumulated", "end of pass"});
}

TEST_CASE("a graph 300000 ops deep is freed, with or without a backward, without overflowing the stack") {
  // Freed recursively, each node's destructor nested the next one's: about 200000 ops
  // overflowed an 8 MB stack (a segfault).
  const Tensor x = ones({1}).set_requires_grad(true);
  for (const bool backward : {false, true}) {
    CAPTURE(backward);
    Tensor y = x;
    for (int i = 0; i < 300000; ++i) y = y * 1.0;
    if (backward) y.backward();
    y = Tensor();  // the whole graph goes here
  }
  CHECK(x.grad().item<float>() == 1.0f);
}

}  // namespace zg::test
