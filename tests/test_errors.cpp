// Bad input gives a zg::Error whose exact text names the op and what was wrong.
#include <functional>

#include "autograd/record.h"
#include "helpers.h"

namespace zg::test {

TEST_CASE("shape, dtype and device mismatches") {
  const Tensor a = zeros({2, 3});
  CHECK_THROWS_WITH_AS(add(a, zeros({4})), "add: cannot broadcast shapes [2, 3] and [4]", Error);
  CHECK_THROWS_WITH_AS(mul(a, zeros({2, 3}, DType::f64)),
                       "mul: dtype mismatch: f32[2, 3] on cpu and f64[2, 3] on cpu", Error);
  CHECK_THROWS_WITH_AS(sub(a, zeros({2, 3}, kMeta)), "sub: device mismatch: f32[2, 3] on cpu and f32[2, 3] on meta",
                       Error);
  CHECK_THROWS_WITH_AS(matmul(a, zeros({4, 5})), "matmul: shapes [2, 3] and [4, 5] cannot be multiplied (3 != 4)",
                       Error);
  CHECK_THROWS_WITH_AS(matmul(zeros({2, 3}, DType::i64), zeros({3, 2}, DType::i64)),
                       "matmul: expected a floating-point tensor, got i64[2, 3] on cpu", Error);
  CHECK_THROWS_WITH_AS(exp(zeros({3}, DType::i32)), "exp: expected a floating-point tensor, got i32[3] on cpu", Error);
  CHECK_THROWS_WITH_AS(where(a, a, a), "where: expected a bool condition, got f32[2, 3] on cpu", Error);
  CHECK_THROWS_WITH_AS(cat({a, zeros({3, 3})}, 1), "cat: shapes [2, 3] and [3, 3] differ outside dim 1", Error);
  CHECK_THROWS_WITH_AS(layer_norm(a, zeros({4}), Tensor()),
                       "layer_norm: expected weight and bias of shape [3], got f32[4] on cpu for input f32[2, 3] on cpu",
                       Error);
  CHECK_THROWS_WITH_AS(cross_entropy(a, zeros({3}, DType::i64)),
                       "cross_entropy: logits f32[2, 3] on cpu need targets of shape [2], got i64[3] on cpu", Error);
  CHECK_THROWS_WITH_AS(add(a, Tensor()), "add: got an undefined tensor", Error);
  CHECK_THROWS_WITH_AS(linear(a, zeros({4, 2}), Tensor()),
                       "linear: input f32[2, 3] on cpu does not end in the 2 features of weight f32[4, 2] on cpu ([out, in])",
                       Error);
  CHECK_THROWS_WITH_AS(linear(a, zeros({4, 3}), zeros({3})), "linear: bias f32[3] on cpu must be [4]", Error);
  // mlp checks both layers, the second against the first's output [2, 4].
  CHECK_THROWS_WITH_AS(mlp(a, zeros({4, 3}), Tensor(), zeros({3, 5}), Tensor()),
                       "mlp: input f32[2, 4] on cpu does not end in the 5 features of weight f32[3, 5] on cpu ([out, in])",
                       Error);
  CHECK_THROWS_WITH_AS(mlp(a, zeros({4, 3}), Tensor(), zeros({3, 4}, DType::f64), Tensor()),
                       doctest::Contains("mlp: "), Error);
}

TEST_CASE("bad dims and out-of-range indices") {
  const Tensor a = zeros({2, 3});
  CHECK_THROWS_WITH_AS(sum(a, {2}), "sum: dim 2 is out of range for a tensor of rank 2", Error);
  CHECK_THROWS_WITH_AS(sum(a, {1, -1}), "sum: dim -1 appears more than once in the dims [1, -1] of f32[2, 3] on cpu",
                       Error);  // before, the repeat was ignored
  CHECK_THROWS_WITH_AS(softmax(a, -3), "softmax: dim -3 is out of range for a tensor of rank 2", Error);
  CHECK_THROWS_WITH_AS(a.transpose(0, 5), "transpose: dim 5 is out of range for a tensor of rank 2", Error);
  CHECK_THROWS_WITH_AS(a.select(1, 3), "select: index 3 is out of range for dim 1 of size 3", Error);
  CHECK_THROWS_WITH_AS(a.narrow(1, 2, 2), "narrow: start 2 and length 2 are out of range for dim 1 of size 3 (shape [2, 3])",
                       Error);
  CHECK_THROWS_WITH_AS(a.permute({0, 0}), "permute: dims [0, 0] are not a permutation (dim 0 repeats)", Error);
  CHECK_THROWS_WITH_AS(max(zeros({0, 3}), {0}), "max: cannot reduce over a zero-size dimension (f32[0, 3] on cpu)",
                       Error);
  CHECK_THROWS_WITH_AS(embedding(zeros({5, 2}), tensor<int64_t>({1, 5})),
                       "embedding: index 5 is out of range for a weight of 5 rows (f32[5, 2] on cpu)", Error);
  CHECK_THROWS_WITH_AS(embedding(zeros({5, 2}), tensor<int32_t>({-1})),
                       "embedding: index -1 is out of range for a weight of 5 rows (f32[5, 2] on cpu)", Error);
  CHECK_THROWS_WITH_AS(cross_entropy(zeros({2, 3}), tensor<int64_t>({0, 3})),
                       "cross_entropy: target 3 is out of range for 3 classes (row 1)", Error);
  CHECK_THROWS_WITH_AS(a.item<float>(), "item: expected a tensor with exactly 1 element, got f32[2, 3] on cpu", Error);
}

TEST_CASE("sizes whose sums or products overflow int64 are refused, not wrapped into a view over no memory") {
  const Tensor a = zeros({4});
  const int64_t huge = int64_t{1} << 62;
  CHECK_THROWS_WITH_AS(a.narrow(0, 1, INT64_MAX),
                       doctest::Contains("narrow: start 1 and length 9223372036854775807 are out of range"), Error);
  CHECK_THROWS_WITH_AS(zeros({0}).view({huge, 4}),
                       "view: shape [4611686018427387904, 4] has more elements than an int64 can count", Error);
  CHECK_THROWS_WITH_AS(zeros({0}).reshape({int64_t{1} << 32, int64_t{1} << 32}),
                       doctest::Contains("has more elements than an int64 can count"), Error);
  CHECK_THROWS_WITH_AS(ones({1}).expand({huge + 1, 4}),
                       "expand: shape [4611686018427387905, 4] has more elements than an int64 can count", Error);
  CHECK_THROWS_AS(zeros({huge, 4}), Error);
  CHECK(zeros({0}).view({0, huge}).numel() == 0);  // empty, and its strides still fit
}

TEST_CASE("views that strides cannot express") {
  const Tensor a = zeros({2, 3});
  CHECK_THROWS_WITH_AS(a.t().view({6}),
                       "view: cannot view a tensor of shape [3, 2] and strides [1, 3] as shape [6]; call contiguous() "
                       "first or use reshape()",
                       Error);
  CHECK_THROWS_WITH_AS(a.view({4, -1}), "view: shape [4, -1] is invalid for a tensor of 6 elements", Error);
  CHECK_THROWS_WITH_AS(a.view({-1, -1}), "view: only one dimension can be -1, got [-1, -1]", Error);
  CHECK_THROWS_WITH_AS(a.expand({4, 3}), "expand: cannot expand shape [2, 3] to [4, 3]", Error);
  CHECK_THROWS_WITH_AS(zeros({3, 1}).expand({3, 4}).fill_(1),
                       "fill_: the destination f32[3, 4] on cpu has broadcast (stride 0) dims, so several elements "
                       "share one memory location",
                       Error);
  CHECK_THROWS_WITH_AS(zeros({3, 1}).expand({3, 4}).copy_(zeros({3, 4})),
                       "copy_: the destination f32[3, 4] on cpu has broadcast (stride 0) dims, so several elements "
                       "share one memory location",
                       Error);
  // add_ and mul_ into a broadcast view updated one value several times; set_grad
  // handed backward such a tensor to accumulate into.
  CHECK_THROWS_WITH_AS(zeros({3, 1}).expand({3, 4}).add_(ones({3, 4})),
                       "add_: the destination f32[3, 4] on cpu has broadcast (stride 0) dims, so several elements "
                       "share one memory location",
                       Error);
  CHECK_THROWS_WITH_AS(ones({1}).expand({4}).mul_(2.0), doctest::Contains("mul_: the destination f32[4] on cpu has broadcast"),
                       Error);
  CHECK_THROWS_WITH_AS(zeros({4}).set_requires_grad(true).set_grad(zeros({1}).expand({4})),
                       "set_grad: the gradient f32[4] on cpu has broadcast (stride 0) dims, so several elements "
                       "share one memory location",
                       Error);
  CHECK_NOTHROW(ones({1, 4}).expand({1, 4}).mul_(2.0));  // a size-1 dim's stride is never used
  // An in-place write from a source that requires grad dropped its gradient silently.
  const Tensor w = ones({3}).set_requires_grad(true);
  CHECK_THROWS_WITH_AS(zeros({3}).copy_(w),
                       "copy_: the source f32[3] on cpu requires grad, and an in-place write records no gradient for "
                       "it; use an op that does (clone(), to(), +), or write a detach()ed source or under NoGradGuard",
                       Error);
  CHECK_THROWS_WITH_AS(zeros({3}).add_(w * 2.0), doctest::Contains("add_: the source f32[3] on cpu requires grad"), Error);
  CHECK_NOTHROW(zeros({3}).copy_(w.detach()));
  {
    NoGradGuard no_grad;
    CHECK_NOTHROW(zeros({3}).add_(w));
  }
  // A leaf whose data changed shape after the graph was recorded got the old gradient broadcast into it.
  {
    const Tensor leaf = ones({3}).set_requires_grad(true);
    const Tensor y = sum(leaf * 2.0);
    leaf.set_data(zeros({2, 3}));
    CHECK_THROWS_WITH_AS(y.backward(),
                         "backward: the gradient f32[3] on cpu does not fit the leaf f32[2, 3] on cpu: its data was "
                         "replaced (set_data) after the graph through it was recorded",
                         Error);
  }
  // set_data could make an integer tensor require grad.
  CHECK_THROWS_WITH_AS(w.set_data(zeros({3}, DType::i64)),
                       "set_data: f32[3] on cpu requires grad, so its data must be floating-point, not i64[3] on cpu",
                       Error);
  // Infinite bounds drew NaN (inf - inf); a huge broadcast view's byte count overflowed.
  CHECK_THROWS_WITH_AS(uniform({2}, -INFINITY, INFINITY),
                       "uniform: needs finite low <= high whose difference is finite, got low -inf and high inf", Error);
  CHECK_THROWS_WITH_AS(uniform({2}, -1e308, 1e308), doctest::Contains("uniform: needs finite low <= high"), Error);
  CHECK_THROWS_WITH_AS(normal({2}, NAN, 1.0), "normal: needs a finite mean and a finite std >= 0, got mean nan and std 1",
                       Error);
  CHECK_THROWS_WITH_AS(zeros({1}).expand({int64_t(1) << 62}).nbytes(),
                       "nbytes: f32[4611686018427387904] on cpu has more bytes than an int64 can count", Error);
  // A scalar takes the tensor's dtype; one the dtype cannot hold was silently changed:
  // lt(ints, 2.5) compared with 2, mul(ints, 1e30) saturated, an f16 mask value became inf.
  const Tensor ints = tensor<int64_t>({1, 2, 3});
  CHECK_THROWS_WITH_AS(lt(ints, 2.5),
                       "lt: the scalar 2.5 does not fit i64[3] on cpu (a scalar takes the tensor's dtype); convert the "
                       "tensor first, e.g. to(DType::f32)",
                       Error);
  CHECK_THROWS_WITH_AS(mul(ints, 1e30), doctest::Contains("mul: the scalar 1e+30 does not fit i64[3]"), Error);
  CHECK_THROWS_WITH_AS(add(ints, NAN), doctest::Contains("add: the scalar nan does not fit"), Error);
  CHECK_THROWS_WITH_AS(masked_fill(zeros({2}, DType::f16), tensor<bool>({true, false}), -1e9),
                       doctest::Contains("masked_fill: the scalar -1e+09 does not fit f16[2] on cpu"), Error);
  CHECK_THROWS_WITH_AS(tensor<int64_t>({1}).add_(tensor<int64_t>({1}), 0.5),
                       doctest::Contains("add_: the scalar 0.5 does not fit i64[1]"), Error);
  CHECK_THROWS_WITH_AS(eq(tensor<bool>({true}), 2.0), doctest::Contains("eq: the scalar 2 does not fit bool[1]"), Error);
  CHECK(lt(ints, 2.0).to_vector<bool>() == std::vector<bool>{true, false, false});
  CHECK(lt(lt(ints, 3.0), 1.0).to_vector<bool>() == std::vector<bool>{false, false, true});
  CHECK(std::isinf(masked_fill(zeros({2}, DType::f16), tensor<bool>({true, false}), -INFINITY).to_vector<float>()[0]));
  // A category from outside the enum indexed past the statistics' arrays.
  CHECK_THROWS_WITH_AS(MemoryScope(static_cast<MemoryCategory>(7)), "MemoryScope: 7 is not a memory category (0 to 6)",
                       Error);
  // Philox's offset wrapped around and repeated earlier numbers.
  {
    Context rank;
    ContextGuard guard(rank);
    Generator::current().set_offset(UINT64_MAX - 1);
    CHECK_THROWS_WITH_AS(rand({8}), doctest::Contains("random: the generator at offset 18446744073709551614 cannot "
                                                      "reserve 2 more counter blocks without wrapping around"),
                         Error);
    CHECK(rand({4}).numel() == 4);  // one block still fits
  }
  CHECK_THROWS_WITH_AS(zeros({-1}), "empty: negative size in shape [-1]", Error);
  CHECK_THROWS_WITH_AS(zeros({1, 3}).expand({2, -3}), "expand: cannot expand shape [1, 3] to [2, -3]", Error);
  CHECK_THROWS_WITH_AS(empty({int64_t(1) << 40, int64_t(1) << 40}),
                       "empty: shape [1099511627776, 1099511627776] of f32 is too large (its size in bytes overflows 64 bits)",
                       Error);
  CHECK_THROWS_AS(empty({int64_t(1) << 60}, DType::boolean), OutOfMemory);  // an exabyte: the system says no
  CHECK_THROWS_WITH_AS(tensor<float>({1, 2, 3}, {2, 2}), "tensor: 3 values do not fill shape [2, 2]", Error);
}

TEST_CASE("devices") {
  CHECK(Device("cuda:3") == Device(DeviceType::cuda, 3));
  CHECK(Device("cuda").index == 0);
  CHECK(Device("meta") == kMeta);
  CHECK_THROWS_WITH_AS(Device("gpu"), "device: cannot parse 'gpu' (expected cpu, meta, cuda or cuda:N)", Error);
  CHECK_THROWS_WITH_AS(Device("cuda:x"), "device: cannot parse 'cuda:x' (expected cpu, meta, cuda or cuda:N)", Error);
  if (!has_cuda()) CHECK_THROWS_AS(zeros({2}, kCUDA), Error);
}

}  // namespace zg::test

namespace zg::test {

// Random misuse: random shapes (empty ones and 0-dim included), dtypes, strided
// views, dims and sizes, thrown at every op. Each call either works or throws
// zg::Error; any other exception escapes and fails the test, and a crash or a bad
// memory access is caught when the suite runs under the sanitizers.
TEST_CASE("random misuse throws zg::Error and nothing else") {
  uint64_t state = 0x2545F4914F6CDD1Dull;
  auto pick = [&](int lo, int hi) {  // xorshift: the same sequence on every platform
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return lo + static_cast<int>(state % static_cast<uint64_t>(hi - lo + 1));
  };
  auto random_shape = [&] {
    Shape shape(pick(0, 3));
    for (int64_t& s : shape) s = pick(0, 3);
    return shape;
  };
  const DType dtypes[] = {DType::f64, DType::f32, DType::bf16, DType::i64, DType::i32, DType::boolean};
  auto random_tensor = [&] {
    Tensor t = ones(random_shape(), dtypes[pick(0, 5)]);
    if (t.dim() >= 2 && pick(0, 2) == 0) t = t.transpose(0, -1);
    return t;
  };
  using Op = std::function<void(const Tensor&, const Tensor&, int64_t, int64_t)>;
  const std::vector<Op> ops = {
      [](auto& a, auto& b, auto, auto) { add(a, b); },
      [](auto& a, auto& b, auto, auto) { div(a, b); },
      [](auto& a, auto& b, auto, auto) { lt(a, b); },
      [](auto& a, auto& b, auto, auto) { logical_and(a, b); },
      [](auto& a, auto&, auto, auto) { exp(a); },
      [](auto& a, auto&, auto, auto) { neg(a); },
      [](auto& a, auto& b, auto, auto) { where(a, b, b); },
      [](auto& a, auto& b, auto, auto) { masked_fill(a, b, 1.0); },
      [](auto& a, auto&, auto d, auto) { sum(a, {d}); },
      [](auto& a, auto&, auto d, auto k) { mean(a, {d}, k > 0); },
      [](auto& a, auto&, auto d, auto) { max(a, {d}); },
      [](auto& a, auto&, auto d, auto) { argmax(a, d); },
      [](auto& a, auto& b, auto, auto) { matmul(a, b); },
      [](auto& a, auto& b, auto d, auto) { matmul(a, b, d > 0, d < 0); },
      [](auto& a, auto&, auto d, auto) { softmax(a, d); },
      [](auto& a, auto&, auto d, auto) { log_softmax(a, d); },
      [](auto& a, auto& b, auto, auto) { layer_norm(a, b, Tensor()); },
      [](auto& a, auto& b, auto, auto) { embedding(a, b); },
      [](auto& a, auto& b, auto, auto k) { cross_entropy(a, b, k); },
      [](auto& a, auto& b, auto d, auto) { cat({a, b}, d); },
      [](auto& a, auto&, auto d, auto k) { split(a, k, d); },
      [](auto& a, auto& b, auto, auto) { a.view(b.shape()); },
      [](auto& a, auto& b, auto, auto) { a.reshape(b.shape()); },
      [](auto& a, auto& b, auto, auto) { a.expand(b.shape()); },
      [](auto& a, auto& b, auto, auto) { a.permute(b.shape()); },
      [](auto& a, auto&, auto d, auto k) { a.narrow(d, k, 1); },
      [](auto& a, auto&, auto d, auto k) { a.slice(d, k, -k, 1 + (k & 1)); },
      [](auto& a, auto&, auto d, auto k) { a.select(d, k); },
      [](auto& a, auto&, auto d, auto) { a.squeeze(d); },
      [](auto& a, auto&, auto d, auto) { a.unsqueeze(d); },
      [](auto& a, auto& b, auto, auto) { Tensor(a).copy_(b); },
      [](auto& a, auto&, auto, auto) { a.template item<float>(); },
      [](auto& a, auto&, auto, auto) { (void)a.str(); },
  };
  int worked = 0, refused = 0;
  for (int i = 0; i < 4000; ++i) {
    const Tensor a = random_tensor(), b = random_tensor();
    try {
      ops[pick(0, static_cast<int>(ops.size()) - 1)](a, b, pick(-4, 4), pick(-2, 4));
      ++worked;
    } catch (const Error&) {
      ++refused;
    }
  }
  CHECK(worked > 100);  // the generator reaches valid calls too, not only errors
  CHECK(refused > 100);
}

namespace {
const DifferentiableOp kCustom("custom_op");  // a user's op; test_autograd's table does not see it
// y = x, whose backward formula returns `grad_of(g)` for x.
Tensor custom_op(const Tensor& x, std::function<Tensor(const Tensor&)> grad_of) {
  Tensor out;
  {
    NoGradGuard no_grad;
    out = x * 1.0;
  }
  return differentiable(out, kCustom, {x}, [grad_of](const Tensor& g) { return std::vector<Tensor>{grad_of(g)}; });
}
}  // namespace

TEST_CASE("the engine holds a formula's gradient to its input: summed back from a broadcast shape, cast, or refused") {
  // PyTorch's validate_outputs. Before, a wrong shape was reshaped or broadcast by the
  // next node, or blamed on set_data when it reached a leaf.
  const Tensor x = tensor<double>({1, 2}).set_requires_grad(true);
  sum(custom_op(x * 3.0, [](const Tensor&) { return ones({5, 2}, DType::f64); })).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{15, 15});  // [5, 2] summed to [2], times 3
  const Tensor y = tensor<double>({1, 2}).set_requires_grad(true);
  sum(custom_op(y, [](const Tensor& g) { return g.to(DType::f32); })).backward();
  CHECK(y.grad().dtype() == DType::f64);
  const Tensor z = tensor<double>({1, 2, 3, 4}, {2, 2}).set_requires_grad(true);
  CHECK_THROWS_WITH_AS(sum(custom_op(z * 1.0, [](const Tensor&) { return ones({4, 1}, DType::f64); })).backward(),
                       "backward of custom_op: the gradient for input 0 is f64[4, 1] on cpu, but that input was "
                       "f64[2, 2] on cpu (a shape it does not broadcast to)",
                       Error);
  CHECK_THROWS_WITH_AS(sum(custom_op(z, [](const Tensor& g) { return empty_like(g).to(kMeta); })).backward(),
                       doctest::Contains("backward of custom_op: the gradient for input 0 is f64[2, 2] on meta, but "
                                         "that input was f64[2, 2] on cpu (another device)"),
                       Error);
}

}  // namespace zg::test
