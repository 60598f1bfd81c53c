// Built only with CUDA. GPU cases report themselves skipped where no GPU is visible.
// Each compares the CUDA backend with the CPU backend (the reference) on the same
// inputs: inputs are made on the CPU and copied, so they are identical bit for bit.
#include <random>

#include "autograd/graph.h"
#include "cuda/attention.h"
#include "cuda/device.h"
#include "cuda/online_lse.h"
#include "cuda/rank_state.h"
#include "cuda/stream.h"
#include "cuda/strided_indexer.h"
#include "helpers.h"
#include "nn/generate.h"
#include "nn/llama.h"
#include "optim/schedule.h"
#include "tensor/backend.h"
#include "tensor/quantize.h"
#include "tiny_gpt.h"
#include "zero_cases.h"

namespace zg::test {

namespace {

const bool kNoGpu = cuda::device_count() == 0;

TensorOptions on_gpu(DType dtype) { return TensorOptions(dtype).device(kCUDA); }

struct Tol {
  DType dtype;
  double rtol, atol;
};
const Tol kFloatTolerances[] = {{DType::f64, 1e-12, 1e-12}, {DType::f32, 1e-5, 1e-5}, {DType::bf16, 1e-2, 1e-2},
                                {DType::f16, 2e-3, 2e-3}};

}  // namespace

TEST_CASE("device discovery works with or without a GPU") {
  const int count = cuda::device_count();
  CHECK(count >= 0);
  CHECK_THROWS_WITH_AS(cuda::device_description(count), doctest::Contains("does not exist"), Error);
}

TEST_CASE("asking for a CUDA device that is not there throws a clear zg::Error") {
  const int count = cuda::device_count();
  if (count == 0) {
    CHECK_THROWS_WITH_AS(zeros({1}, kCUDA), doctest::Contains("cuda:0 requested but no CUDA device is visible"),
                         Error);
    CHECK_FALSE(has_cuda());
  } else {
    CHECK_THROWS_WITH_AS(zeros({1}, Device(DeviceType::cuda, count)), doctest::Contains("requested but only"), Error);
  }
  // CPU work goes on either way.
  CHECK(sum(ones({3})).item<float>() == 3.0f);
}

TEST_CASE("the strided indexer's multiply-and-shift division is exact, and so are its offsets") {
  // Kernels find an element's place in a strided view with a division per dim; a GPU
  // has no division instruction, so below 2^31 elements it is FastDivider's mulhi and
  // shift. Checked here on the host, where the same code runs.
  std::mt19937_64 random(7);
  std::vector<uint32_t> divisors{1, 2, 3, 5, 7, 12, 16, 64, 768, 1000, 1024, 3 * 768, 50257, 50304,
                                 65535, 65536, 65537, (1u << 30) - 1, 1u << 30, (1u << 31) - 1, 1u << 31};
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + static_cast<uint32_t>(random() % (uint64_t{1} << 31)));
  for (const uint32_t d : divisors) {
    const FastDivider divider(d);
    std::vector<uint32_t> numerators{0, 1, d - 1, d, (1u << 31) - 1, (1u << 31) - 2, (1u << 31) - d % (1u << 31)};
    for (uint32_t k : {uint32_t{2}, uint32_t{3}, uint32_t{1000}})
      if (uint64_t{d} * k < (uint64_t{1} << 31)) numerators.insert(numerators.end(), {d * k - 1, d * k, d * k + 1});
    for (int i = 0; i < 200; ++i) numerators.push_back(static_cast<uint32_t>(random() % (uint64_t{1} << 31)));
    for (const uint32_t n : numerators) {
      if (n >= (1u << 31)) continue;
      INFO(n << " / " << d);
      REQUIRE(divider.div(n) == n / d);
    }
  }
  // Offsets of views (a transpose, a broadcast, a narrow), the 32-bit and the 64-bit way,
  // against the row-major digits computed directly.
  const std::vector<std::pair<Shape, std::array<Shape, 2>>> views{
      {{16, 12, 1024, 64}, {Shape{786432, 64, 768, 1}, Shape{2359296, 64, 2304, 1}}},  // dq into a packed dqkv
      {{16, 1024, 768}, {Shape{786432, 768, 1}, Shape{0, 768, 1}}},                     // wpe broadcast over the batch
      {{3, 1, 5, 7}, {Shape{35, 35, 1, 5}, Shape{1, 0, 21, 3}}},
      {{0, 4}, {Shape{4, 1}, Shape{1, 0}}}};
  for (const auto& [shape, strides] : views) {
    auto ix = cuda::make_indexer<2>(shape, {&strides[0], &strides[1]}, "test");
    CHECK(ix.small);
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    for (bool small : {true, false}) {
      ix.small = small;
      for (int k = 0; k < 2000 && n > 0; ++k) {
        const int64_t i = k < 1000 ? k * (n / 1000 + 1) % n : static_cast<int64_t>(random() % static_cast<uint64_t>(n));
        int64_t expected[2] = {0, 0}, rest = i;
        for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
          for (int j = 0; j < 2; ++j) expected[j] += rest % shape[d] * strides[j][d];
          rest /= shape[d];
        }
        int64_t got[2];
        ix.offsets(i, got);
        INFO(shape_str(shape) << " element " << i << (small ? " (32-bit)" : " (64-bit)"));
        REQUIRE(got[0] == expected[0]);
        REQUIRE(got[1] == expected[1]);
      }
    }
  }
  const Shape big{int64_t{1} << 31}, unit{1};
  CHECK_FALSE(cuda::make_indexer<1>(big, {&unit}, "test").small);  // 2^31 elements: 64-bit
  const Shape empty{int64_t{1} << 32, 0}, ones{1, 1};  // no element: no divider (2^32 is none in 32 bits)
  CHECK(cuda::make_indexer<1>(empty, {&ones}, "test").rank == 2);
}

TEST_CASE("the one-pass log-sum-exp of the GPU's softmax and cross-entropy is the two-pass one") {
  // Threads fold their share of a row and a tree merges them: any split, any order of
  // merges gives the two-pass value to rounding, and NaN exactly where it is NaN.
  auto two_pass = [](const std::vector<double>& row) {
    double max = -INFINITY, total = 0;
    for (double x : row) max = std::fmax(max, x);
    for (double x : row) total += std::exp(x - max);
    return max + std::log(total);
  };
  auto one_pass = [](const std::vector<double>& row, size_t threads) {
    std::vector<cuda::OnlineLse<double>> parts(threads);
    for (size_t j = 0; j < row.size(); ++j) parts[j % threads].add(row[j]);
    for (size_t half = threads / 2; half > 0; half /= 2)  // block_reduce's tree
      for (size_t i = 0; i < half; ++i) parts[i] = parts[i].merged(parts[i + half]);
    return parts[0].max + parts[0].log_sum();
  };
  std::mt19937_64 random(3);
  std::normal_distribution<double> normal(0.0, 4.0);
  std::vector<std::vector<double>> rows{{1e20, 1e20}, {-INFINITY, 0, 0}, {3, -INFINITY, 1}, {0.5}};
  for (int r = 0; r < 50; ++r) {
    std::vector<double> row(1 + random() % 700);
    for (double& x : row) x = normal(random) + (r % 5 == 0 ? 1e4 : 0);
    rows.push_back(row);
  }
  for (const auto& row : rows)
    for (size_t threads : {size_t{1}, size_t{2}, size_t{32}, size_t{256}}) {
      INFO(row.size() << " values, " << threads << " threads");
      CHECK(one_pass(row, threads) == doctest::Approx(two_pass(row)).epsilon(1e-13));
      // In f32, as the kernels run it for f32, bf16 and f16: to f32 rounding.
      std::vector<cuda::OnlineLse<float>> parts(threads);
      for (size_t j = 0; j < row.size(); ++j) parts[j % threads].add(static_cast<float>(row[j]));
      for (size_t half = threads / 2; half > 0; half /= 2)
        for (size_t i = 0; i < half; ++i) parts[i] = parts[i].merged(parts[i + half]);
      CHECK(parts[0].max + parts[0].log_sum() == doctest::Approx(two_pass(row)).epsilon(1e-6));
    }
  // NaN where the two-pass form is NaN: a NaN or a +inf anywhere, or -inf only.
  for (const std::vector<double>& row : {std::vector<double>{1, NAN, 2}, std::vector<double>{NAN, INFINITY},
                                         std::vector<double>{INFINITY, 1, 2}, std::vector<double>{1, 2, INFINITY},
                                         std::vector<double>{INFINITY, INFINITY}})
    for (size_t threads : {size_t{1}, size_t{2}, size_t{4}}) {
      INFO(threads << " threads");
      CHECK(std::isnan(one_pass(row, threads)));
      CHECK(std::isnan(two_pass(row)));
    }
  // -inf only: the two-pass form is NaN; this is -inf, and x - lse (what the kernels use) NaN.
  const std::vector<double> none{-INFINITY, -INFINITY};
  CHECK(std::isnan(-INFINITY - one_pass(none, 2)));
  CHECK(std::isnan(two_pass(none)));
}

TEST_CASE("a visible GPU describes itself" * doctest::skip(kNoGpu)) {
  const std::string description = cuda::device_description(0);
  MESSAGE(description);
  CHECK(description.find("sm_") != std::string::npos);
}

TEST_CASE("Philox on the GPU reproduces the CPU's numbers bit for bit" * doctest::skip(kNoGpu)) {
  // Sizes that are not multiples of 4 and a second draw starting mid-sequence (first_block > 0).
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (int64_t n : {1, 7, 4099, 100003}) {
      manual_seed(1234);
      const Tensor cpu_u = uniform({n}, -2.0, 3.0, dtype), cpu_z = normal({n}, 0.5, 2.0, dtype);
      manual_seed(1234);
      const Tensor gpu_u = uniform({n}, -2.0, 3.0, on_gpu(dtype)), gpu_z = normal({n}, 0.5, 2.0, on_gpu(dtype));
      const std::string what = std::string(name(dtype)) + " n=" + std::to_string(n);
      check_identical(gpu_u.to(kCPU), cpu_u, "uniform " + what);
      if (dtype != DType::f64) {
        check_identical(gpu_z.to(kCPU), cpu_z, "normal " + what);
      } else {
        // f64 normals pass through the devices' own f64 log/sin/cos, which may differ
        // in the last bit; anything beyond a few ulps is a real difference.
        check_close(gpu_z, Host::of(cpu_z), 1e-13, 1e-13, "normal " + what);
      }
    }
  }
}

TEST_CASE("fill, copy and casts between every dtype and across devices" * doctest::skip(kNoGpu)) {
  const DType all[] = {DType::f64, DType::f32, DType::f16, DType::bf16, DType::i64, DType::i32, DType::boolean};
  manual_seed(5);
  const Tensor base = (randn({5, 6}, DType::f64) * 4.0);
  for (DType from : all) {
    const Tensor src_cpu = base.to(from);
    const Tensor src_gpu = src_cpu.to(kCUDA);
    check_identical(src_gpu.to(kCPU), src_cpu, std::string("roundtrip ") + name(from));
    for (DType to : all) {
      const std::string what = std::string(name(from)) + " -> " + name(to);
      // Strided (transposed) source, cast on the device, then a strided destination.
      check_identical(src_gpu.t().to(to).to(kCPU), src_cpu.t().to(to), "cast of a transposed view " + what);
      Tensor dst_gpu = zeros({6, 10}, on_gpu(to));
      Tensor dst_cpu = zeros({6, 10}, to);
      dst_gpu.slice(1, 0, 10, 2).copy_(src_gpu.t());
      dst_cpu.slice(1, 0, 10, 2).copy_(src_cpu.t());
      check_identical(dst_gpu.to(kCPU), dst_cpu, "copy into a strided view " + what);
      // Host -> device and device -> host with a strided, differently-typed other side.
      Tensor host_dst = zeros({6, 5}, to);
      host_dst.copy_(src_gpu.t());
      check_identical(host_dst, src_cpu.t().to(to), "device -> strided host " + what);
      Tensor gpu_dst = zeros({6, 5}, on_gpu(to));
      gpu_dst.copy_(src_cpu.t());
      check_identical(gpu_dst.to(kCPU), src_cpu.t().to(to), "strided host -> device " + what);
    }
    // fill, and a broadcast source (stride 0)
    const double value = from == DType::boolean ? 1.0 : is_floating(from) ? -2.75 : -3.0;  // one the dtype holds
    check_identical(full({3, 3}, value, on_gpu(from)).to(kCPU), full({3, 3}, value, from), std::string("fill ") + name(from));
    Tensor row_gpu = zeros({4, 6}, on_gpu(from));
    row_gpu.copy_(src_gpu.narrow(0, 1, 1));
    Tensor row_cpu = zeros({4, 6}, from);
    row_cpu.copy_(src_cpu.narrow(0, 1, 1));
    check_identical(row_gpu.to(kCPU), row_cpu, std::string("broadcast copy ") + name(from));
  }
}

TEST_CASE("every backend primitive matches the CPU in f32, bf16, f16 and f64" * doctest::skip(kNoGpu)) {
  for (const Tol& tol : kFloatTolerances) {
    const DType dt = tol.dtype;
    manual_seed(42);
    const Tensor x = randn({37, 300}, dt), pos = uniform({37, 300}, 0.5, 2.0, dt);
    const Tensor xg = x.to(kCUDA), pg = pos.to(kCUDA);
    const std::string in = std::string(" in ") + name(dt);
    auto same = [&](const Tensor& g, const Tensor& c, const std::string& what) {
      CHECK(g.device() == kCUDA);
      check_close(g, Host::of(c), tol.rtol, tol.atol, what + in);
    };
    // unary (incl. on a transposed view), binary with broadcasting, where
    same(gelu(xg.t()), gelu(x.t()), "gelu of a view");
    same(exp(xg), exp(x), "exp");
    same(log(pg), log(pos), "log");
    same(rsqrt(pg), rsqrt(pos), "rsqrt");
    same(sigmoid(xg), sigmoid(x), "sigmoid");
    same(tanh(xg), tanh(x), "tanh");
    same(xg * pg.narrow(0, 0, 1), x * pos.narrow(0, 0, 1), "mul broadcast row");
    same(xg / pg.narrow(1, 0, 1), x / pos.narrow(1, 0, 1), "div broadcast column");
    same(pow(pg, xg), pow(pos, x), "pow");
    same(maximum(xg, xg.t().t() * 0.5), maximum(x, x * 0.5), "maximum");
    same(where(gt(xg, 0.0), xg, pg), where(gt(x, 0.0), x, pos), "where");
    check_identical(lt(xg, pg).to(kCPU), lt(x, pos), std::string("lt") + in);
    // reductions, along rows and across them
    same(sum(xg, {1}), sum(x, {1}), "sum rows");
    same(mean(xg, {0}), mean(x, {0}), "mean columns");
    same(max(xg, {1}), max(x, {1}), "max");
    same(min(xg, {0}), min(x, {0}), "min");
    check_identical(argmax(xg, 1).to(kCPU), argmax(x, 1), std::string("argmax") + in);
    check_identical(argmin(xg, 0).to(kCPU), argmin(x, 0), std::string("argmin") + in);
    const Tensor ss_g = sum_of_squares(xg), ss_c = sum_of_squares(x);
    CHECK(ss_g.dtype() == (dt == DType::f64 ? DType::f64 : DType::f32));
    check_close(ss_g, Host::of(ss_c), 1e-6, 1e-6, "sum_of_squares" + in);
    // softmax, layer norm (with its statistics), cross-entropy
    same(softmax(xg, 1), softmax(x, 1), "softmax");
    same(log_softmax(xg, 0), log_softmax(x, 0), "log_softmax");
    const Tensor w = randn({300}, dt), b = randn({300}, dt);
    const LayerNormOutput lg = layer_norm_with_stats(xg, w.to(kCUDA), b.to(kCUDA), 1e-5);
    const LayerNormOutput lc = layer_norm_with_stats(x, w, b, 1e-5);
    same(lg.out, lc.out, "layer_norm");
    check_close(lg.mean, Host::of(lc.mean), 1e-6, 1e-6, "layer_norm mean" + in);
    check_close(lg.rstd, Host::of(lc.rstd), 1e-6, 1e-6, "layer_norm rstd" + in);
    const Tensor target = tensor<int64_t>({3, -100, 299, 0, 150, -100, 7}, {7});
    const Tensor logits = x.narrow(0, 0, 7);
    for (DType index : {DType::i64, DType::i32}) {
      same(cross_entropy(logits.to(kCUDA), target.to(index).to(kCUDA)), cross_entropy(logits, target.to(index)),
           std::string("cross_entropy with ") + name(index) + " targets");
    }
    // embedding forward (an exact gather) and backward (repeated rows accumulate)
    const Tensor idx = tensor<int64_t>({3, 0, 36, 3, 3, 12, 0}, {7});
    for (DType index : {DType::i64, DType::i32}) {
      check_identical(embedding(xg, idx.to(index).to(kCUDA)).to(kCPU), embedding(x, idx.to(index)),
                      std::string("embedding") + in);
    }
    const Tensor leaf_c = x.detach().set_requires_grad(true), leaf_g = xg.detach().set_requires_grad(true);
    const Tensor g = randn({7, 300}, dt);
    sum(embedding(leaf_c, idx) * g).backward();
    sum(embedding(leaf_g, idx.to(kCUDA)) * g.to(kCUDA)).backward();
    check_identical(leaf_g.grad().to(kCPU), leaf_c.grad(), std::string("embedding_backward") + in);

    // The fused backward kernels (GELU, layer norm, cross-entropy) and softmax's, through
    // autograd: d/dx sum(f(x) * r) on both devices.
    const Tensor r = randn({37, 300}, dt);
    auto same_grad = [&](const std::function<Tensor(const Tensor&)>& f, const std::string& what) {
      const Tensor on_cpu = x.detach().set_requires_grad(true), on_gpu = xg.detach().set_requires_grad(true);
      sum(f(on_cpu) * r).backward();
      sum(f(on_gpu) * r.to(kCUDA)).backward();
      same(on_gpu.grad(), on_cpu.grad(), what + " backward");
    };
    same_grad([](const Tensor& v) { return gelu(v); }, "gelu");
    same_grad([](const Tensor& v) { return softmax(v, 1); }, "softmax");
    same_grad([&](const Tensor& v) { return layer_norm(v, v.device() == kCUDA ? w.to(kCUDA) : w, Tensor(), 1e-5); },
              "layer_norm");
    for (const Tensor* param : {&w, &b}) {  // the weight's and bias's gradients, summed over 37 rows
      const Tensor pc = param->detach().set_requires_grad(true), pg = param->to(kCUDA).detach().set_requires_grad(true);
      sum(layer_norm(x, param == &w ? pc : w, param == &b ? pc : b, 1e-5) * r).backward();
      sum(layer_norm(xg, param == &w ? pg : w.to(kCUDA), param == &b ? pg : b.to(kCUDA), 1e-5) * r.to(kCUDA)).backward();
      same(pg.grad(), pc.grad(), param == &w ? "layer_norm weight backward" : "layer_norm bias backward");
    }
    // linear through cuBLASLt's epilogues (bias; bias + GELU with its aux output; the bias
    // gradient) -- and 300 features, not a multiple of 8, through the composed fallback.
    for (const int64_t features : {int64_t{64}, int64_t{300}}) {
      const Tensor weight = randn({features, 300}, dt) * 0.1, bias = randn({features}, dt);
      const Tensor r_out = randn({37, features}, dt);
      for (const Activation act : {Activation::none, Activation::gelu}) {
        const std::string what = "linear to " + std::to_string(features) + (act == Activation::gelu ? " + gelu" : "");
        std::vector<Tensor> cpu_leaves{x, weight, bias}, gpu_leaves{xg, weight.to(kCUDA), bias.to(kCUDA)};
        for (Tensor& t : cpu_leaves) t = t.detach().set_requires_grad(true);
        for (Tensor& t : gpu_leaves) t = t.detach().set_requires_grad(true);
        const Tensor y_c = linear(cpu_leaves[0], cpu_leaves[1], cpu_leaves[2], act);
        const Tensor y_g = linear(gpu_leaves[0], gpu_leaves[1], gpu_leaves[2], act);
        same(y_g, y_c, what);
        sum(y_c * r_out).backward();
        sum(y_g * r_out.to(kCUDA)).backward();
        for (size_t i = 0; i < 3; ++i) same(gpu_leaves[i].grad(), cpu_leaves[i].grad(), what + " backward, input " + std::to_string(i));
      }
    }
    const Tensor logits_c = logits.detach().set_requires_grad(true), logits_g = logits.to(kCUDA).detach().set_requires_grad(true);
    cross_entropy(logits_c, target).backward();
    cross_entropy(logits_g, target.to(kCUDA)).backward();
    same(logits_g.grad(), logits_c.grad(), "cross_entropy backward");
  }
}

TEST_CASE("sums over few long rows (a gradient norm) split across blocks and match the CPU" * doctest::skip(kNoGpu)) {
  manual_seed(5);
  for (const int64_t length : {int64_t{4096}, int64_t{100'003}, int64_t{3'000'017}}) {
    CAPTURE(length);
    const Tensor x = randn({length}, DType::f32), rows = randn({3, length / 3}, DType::bf16);
    check_close(sum_of_squares(x.to(kCUDA)), Host::of(sum_of_squares(x)), 1e-6, 1e-6, "sum_of_squares");
    check_close(sum(x.to(kCUDA)), Host::of(sum(x)), 1e-5, 1e-3, "sum");
    check_close(mean(rows.to(kCUDA), {1}), Host::of(mean(rows, {1})), 1e-2, 1e-3, "mean of bf16 rows");
    check_identical(sum(ones({length}, DType::i32).to(kCUDA)).to(kCPU), sum(ones({length}, DType::i32)), "count");
  }
}

TEST_CASE("matmul on the GPU: transposes, batches, broadcast batches (stride 0)" * doctest::skip(kNoGpu)) {
  for (const Tol& tol : kFloatTolerances) {
    const DType dt = tol.dtype;
    const double rtol = dt == DType::f32 ? 1e-4 : tol.rtol, atol = dt == DType::f32 ? 1e-4 : tol.atol;
    manual_seed(3);
    struct Case {
      Shape a, b;
      bool ta, tb;
    };
    const Case cases[] = {
        {{37, 53}, {53, 29}, false, false},        // plain
        {{53, 37}, {53, 29}, true, false},         // a column-major
        {{37, 53}, {29, 53}, false, true},         // b column-major
        {{53, 37}, {29, 53}, true, true},          // both
        {{4, 17, 33}, {4, 33, 9}, false, false},   // batched
        {{4, 17, 33}, {33, 9}, false, false},      // b broadcast over the batch: batch stride 0
        {{17, 33}, {4, 9, 33}, false, true},       // a broadcast, b transposed
        {{2, 1, 5, 8}, {3, 8, 6}, false, false},   // broadcast batch dims on both sides
        {{1, 64}, {64, 1}, false, false},          // row times column
        {{64}, {3, 64, 5}, false, false},          // vector-matrix
        {{3, 0}, {0, 4}, false, false},            // k = 0: zeros
    };
    for (const Case& c : cases) {
      const Tensor a = randn(c.a, dt), b = randn(c.b, dt);
      const Tensor got = matmul(a.to(kCUDA), b.to(kCUDA), c.ta, c.tb), want = matmul(a, b, c.ta, c.tb);
      check_close(got, Host::of(want), rtol, atol,
                  "matmul " + shape_str(c.a) + " @ " + shape_str(c.b) + (c.ta ? " ta" : "") + (c.tb ? " tb" : "") +
                      " in " + name(dt));
    }
    // Gradients flow through the transposed products on the GPU too.
    const Tensor a = randn({6, 7}, dt), b = randn({7, 5}, dt);
    const Tensor ac = a.detach().set_requires_grad(true), bc = b.detach().set_requires_grad(true);
    const Tensor ag = a.to(kCUDA).detach().set_requires_grad(true), bg = b.to(kCUDA).detach().set_requires_grad(true);
    sum(matmul(ac, bc) * matmul(ac, bc)).backward();
    sum(matmul(ag, bg) * matmul(ag, bg)).backward();
    check_close(ag.grad(), Host::of(ac.grad()), 4 * rtol, 4 * atol, std::string("matmul grad a in ") + name(dt));
    check_close(bg.grad(), Host::of(bc.grad()), 4 * rtol, 4 * atol, std::string("matmul grad b in ") + name(dt));
  }
}

TEST_CASE("an out-of-range index on the GPU becomes a zg::Error at the next synchronisation" *
          doctest::skip(kNoGpu)) {
  const Tensor weight = randn({6, 4}, on_gpu(DType::f32));
  const Tensor bad = tensor<int64_t>({0, 7, 2}, {3}, on_gpu(DType::i64));
  CHECK_THROWS_WITH_AS(embedding(weight, bad).to(kCPU), doctest::Contains("index 7 is out of range for a weight of 6 rows"),
                       Error);
  // The error was reported once; the next (valid) work runs normally.
  const Tensor good = tensor<int64_t>({5, 0}, {2}, on_gpu(DType::i64));
  CHECK(embedding(weight, good).to(kCPU).shape() == Shape{2, 4});
  const Tensor negative = tensor<int32_t>({-1}, {1}, on_gpu(DType::i32));
  CHECK_THROWS_WITH_AS(embedding(weight, negative).to(kCPU), doctest::Contains("index -1 is out of range"), Error);
  const Tensor logits = randn({2, 5}, on_gpu(DType::f32));
  CHECK_THROWS_WITH_AS(cross_entropy(logits, tensor<int64_t>({1, 9}, {2}, on_gpu(DType::i64))).item<float>(),
                       doctest::Contains("target 9 is out of range for 5 classes"), Error);
  CHECK(std::isfinite(cross_entropy(logits, tensor<int64_t>({1, 4}, {2}, on_gpu(DType::i64))).item<float>()));
  // Targets written after the forward checked them, where no version counter sees it (here
  // through the backend itself): the backward's kernel reports them, as the CPU throws.
  const Tensor leaf = randn({2, 5}, on_gpu(DType::f32)).set_requires_grad(true);
  const Tensor targets = tensor<int64_t>({1, 4}, {2}, on_gpu(DType::i64));
  const Tensor loss = cross_entropy(leaf, targets);
  backend(kCUDA).copy(tensor<int64_t>({1, 9}, {2}, on_gpu(DType::i64)), targets);
  loss.backward();
  CHECK_THROWS_WITH_AS(leaf.grad().to(kCPU), doctest::Contains("cross_entropy_backward: target 9 is out of range for 5"),
                       Error);
}

TEST_CASE("blockwise int8 and int4 quantization on the GPU give the CPU's bits; a NaN is reported at the next "
          "synchronisation" * doctest::skip(kNoGpu)) {
  manual_seed(11);
  for (const int bits : {8, 4}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
      INFO(bits << " bits, " << name(dtype));
      const Tensor x = (randn({10000}, dtype) * 3.0).to(dtype);
      const Quantized cpu = quantize(x, bits, 2048), gpu = quantize(x.to(kCUDA), bits, 2048);
      CHECK(gpu.values.to(kCPU).to_vector<int32_t>() == cpu.values.to_vector<int32_t>());
      CHECK(gpu.scales.to(kCPU).to_vector<float>() == cpu.scales.to_vector<float>());
      CHECK(max_abs_diff(dequantize(gpu).to(kCPU), dequantize(cpu)) == 0.0);
    }
    // An all-gather's shards (each quantized on its own), dequantized in one pass: the CPU's bits.
    const Tensor shards = randn({3000});
    std::vector<Tensor> values, scales;
    for (int r = 0; r < 3; ++r) {
      const Quantized q = quantize(shards.narrow(0, 1000 * r, 1000), bits, 384);
      values.push_back(q.values), scales.push_back(q.scales);
    }
    const Tensor all_values = cat(values, 0), all_scales = cat(scales, 0);
    const Tensor on_cpu = empty({3000}), on_cuda = empty({3000}, on_gpu(DType::f32));
    backend(kCPU).dequantize_blocks(all_values, all_scales, bits, 384, 1000, on_cpu);
    backend(kCUDA).dequantize_blocks(all_values.to(kCUDA), all_scales.to(kCUDA), bits, 384, 1000, on_cuda);
    CHECK(max_abs_diff(on_cuda.to(kCPU), on_cpu) == 0.0);
  }
  Tensor bad = ones({4096}, on_gpu(DType::f32));
  bad.narrow(0, 3000, 1).fill_(NAN);
  CHECK_THROWS_WITH_AS(quantize(bad).scales.to(kCPU), doctest::Contains("quantize: element 3000 of 4096 is not finite"),
                       Error);
  CHECK(quantize(ones({8}, on_gpu(DType::f32))).scales.to(kCPU).to_vector<float>()[0] == 1.0f / 127.0f);
}

TEST_CASE("fused AdamW on the GPU matches the CPU, compute copy included" * doctest::skip(kNoGpu)) {
  AdamWStep step;
  step.lr = 3e-3, step.beta1 = 0.9, step.beta2 = 0.95, step.eps = 1e-8, step.weight_decay = 0.1;
  step.grad_scale = 0.5, step.step = 3;
  for (DType master_dtype : {DType::f32, DType::f64}) {
    for (DType grad_dtype : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      for (DType compute_dtype : {DType::bf16, DType::f16, master_dtype}) {
        manual_seed(17);
        const int64_t n = 1000;
        const Tensor master = randn({n}, master_dtype), grad = randn({n}, grad_dtype);
        const Tensor m = randn({n}, master_dtype) * 0.1, v = rand({n}, master_dtype) * 0.01;
        const bool separate = compute_dtype != master_dtype;
        // Each device updates its own copies of the same starting values.
        std::vector<Tensor> cpu{master.clone(), grad.clone(), m.clone(), v.clone()};
        std::vector<Tensor> gpu{master.to(kCUDA), grad.to(kCUDA), m.to(kCUDA), v.to(kCUDA)};
        const Tensor compute_cpu = separate ? zeros({n}, compute_dtype) : cpu[0];
        const Tensor compute_gpu = separate ? zeros({n}, on_gpu(compute_dtype)) : gpu[0];
        backend(kCPU).adamw(cpu[0], cpu[1], cpu[2], cpu[3], compute_cpu, step);
        backend(kCUDA).adamw(gpu[0], gpu[1], gpu[2], gpu[3], compute_gpu, step);
        const std::string what = std::string("master ") + name(master_dtype) + ", grad " + name(grad_dtype) +
                                 ", compute " + name(compute_dtype);
        const double tol = master_dtype == DType::f64 ? 1e-12 : 1e-6;
        check_close(gpu[0], Host::of(cpu[0]), tol, tol, "adamw master, " + what);
        check_close(gpu[2], Host::of(cpu[2]), tol, tol, "adamw m, " + what);
        check_close(gpu[3], Host::of(cpu[3]), tol, tol, "adamw v, " + what);
        // The compute copy is the new master rounded once: at most one ulp apart.
        const double ulp = compute_dtype == DType::bf16 ? 8e-3 : compute_dtype == DType::f16 ? 1e-3 : tol;
        check_close(compute_gpu, Host::of(compute_cpu), ulp, ulp, "adamw compute copy, " + what);
        // And the step actually moved the weights.
        CHECK(max(abs(gpu[0].to(kCPU).to(DType::f64) - master.to(DType::f64))).item<double>() > 1e-4);
      }
    }
  }
}

TEST_CASE("a GPT built on the CPU and moved to cuda:0 gives the CPU's loss before and after one step" *
          doctest::skip(kNoGpu)) {
  for (DType compute : {DType::f32, DType::bf16}) {
    const Sequence s = fixed_sequence();
    auto losses_on = [&](Device device) {
      manual_seed(1);
      auto model = std::make_shared<nn::GPT>(tiny_config());  // built (and initialised) on the CPU
      model->to(device);
      dist::SingleRank one;
      dist::ShardedModel trainer(*model, one, {.compute_dtype = compute, .adamw = {0.9, 0.95, 1e-8, 0.1}});
      const Tensor inputs = s.inputs.to(device), targets = s.targets.to(device);
      std::vector<double> losses;
      for (int step = 0; step < 2; ++step) {
        trainer.zero_grad();
        const Tensor loss = model->forward(inputs, targets).loss;
        CHECK(loss.device() == device);
        loss.backward();
        losses.push_back(loss.item<double>());
        trainer.step(1e-2);
      }
      return losses;
    };
    const std::vector<double> cpu = losses_on(kCPU), gpu = losses_on(kCUDA);
    // Before the step the two forward passes differ only by rounding; after it, within
    // bf16 tolerance (Adam's m / sqrt(v) turns tiny gradient differences into full steps).
    INFO("compute " << name(compute) << ": cpu " << cpu[0] << ", " << cpu[1] << "; gpu " << gpu[0] << ", " << gpu[1]);
    CHECK(cpu[1] < cpu[0]);  // the step did something
    CHECK(gpu[0] == doctest::Approx(cpu[0]).epsilon(compute == DType::f32 ? 1e-5 : 1e-2));
    CHECK(gpu[1] == doctest::Approx(cpu[1]).epsilon(1e-2));
  }
}

TEST_CASE("a training step on the GPU, batch upload included, never makes the host wait" * doctest::skip(kNoGpu)) {
  manual_seed(1);
  auto model = std::make_shared<nn::GPT>(tiny_config());
  model->to(kCUDA);
  dist::SingleRank one;
  dist::ShardedModel trainer(*model, one,
                             {.compute_dtype = DType::bf16, .adamw = {0.9, 0.95, 1e-8, 0.1}, .max_grad_norm = 1.0});
  const Sequence s = fixed_sequence();
  // Each step uploads its batch (from pageable memory), trains, clips on the device and
  // updates (step_on_device: the norm is never read back); the loss stays on the GPU.
  auto step = [&] {
    trainer.zero_grad();
    const Tensor loss = model->forward(s.inputs.to(kCUDA), s.targets.to(kCUDA)).loss;
    loss.backward();
    trainer.step_on_device(1e-3);
    return loss;
  };
  // Warm-up: handles, plans, Adam's moments, the segments of a steady step, staging blocks.
  const double first = step().item<double>();
  step();
  const int64_t waits = cuda::host_waits();
  const int64_t segments = memory_stats(kCUDA).segment_allocations;
  std::vector<Tensor> losses;
  for (int i = 0; i < 3; ++i) losses.push_back(step());
  CHECK(cuda::host_waits() == waits);
  CHECK(memory_stats(kCUDA).segment_allocations == segments);
  // Reading a loss is the one wait, and the uploads landed: training went on.
  const double last = losses.back().item<double>();
  CHECK(cuda::host_waits() == waits + 1);
  CHECK(last < first);
}

TEST_CASE("uploads return before the GPU has run them and land in stream order" * doctest::skip(kNoGpu)) {
  // Many uploads from one reused host buffer, each changed right after its copy returns:
  // every device copy still holds what the host buffer held at its copy.
  const int64_t n = 3000;  // 12 KB of f32: staged
  std::vector<float> host(n);
  std::vector<Tensor> uploaded;
  const int64_t waits = cuda::host_waits();
  for (int k = 0; k < 20; ++k) {
    for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(k * n + i);
    uploaded.push_back(tensor<float>(host, {n}, on_gpu(DType::f32)));
  }
  CHECK(cuda::host_waits() == waits);
  const int64_t pinned = cuda::rank_state(kCUDA).staging.pinned_bytes();  // blocks in flight, then reused
  CHECK(pinned >= cuda::HostStaging::kMinBlockBytes);
  CHECK(pinned <= cuda::HostStaging::kMaxPoolBytes);
  for (int k = 0; k < 20; ++k) CHECK(uploaded[k].to_vector<float>()[n - 1] == static_cast<float>(k * n + n - 1));
  CHECK(max(abs(uploaded[7] - arange(7.0 * n, 8.0 * n, 1.0, on_gpu(DType::f32)))).item<double>() == 0);
  // Larger than a staging block may be: copied directly, and waited for.
  const Tensor big = zeros({int64_t{8} << 20}, DType::boolean);
  const int64_t before = cuda::host_waits();
  CHECK(big.to(kCUDA).numel() == big.numel());
  CHECK(cuda::host_waits() == before + 1);
}

namespace {

// ||got - want|| / ||want|| over all elements, in f64: the error of a whole result, which
// rounding to bf16 or f16 bounds better than it bounds single near-zero elements.
double relative_error(const Tensor& got, const Tensor& want) {
  REQUIRE(got.shape() == want.shape());
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < g.size(); ++i) diff += (g[i] - w[i]) * (g[i] - w[i]), norm += w[i] * w[i];
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);  // (a causal row of one key has dq = dk = 0)
}

// Attention as the model runs it: q, k, v [B, H, T, D] are transposed views of [B, T, H, D]
// leaves (made from `buffers` on `device` in `dtype`); the loss is sum(out * g). Returns
// out as [B, T, H, D] and the leaves' gradients.
std::vector<Tensor> attention_and_grads(const std::vector<Tensor>& buffers, const Tensor& g, bool causal,
                                        Device device, DType dtype) {
  std::vector<Tensor> leaves;
  for (const Tensor& b : buffers) leaves.push_back(b.to(dtype).to(device).detach().set_requires_grad(true));
  const Tensor out = scaled_dot_product_attention(leaves[0].transpose(1, 2), leaves[1].transpose(1, 2),
                                                  leaves[2].transpose(1, 2), causal);
  sum(out * g.to(dtype).to(device).transpose(1, 2)).backward();
  return {out.transpose(1, 2), leaves[0].grad(), leaves[1].grad(), leaves[2].grad()};
}

}  // namespace

TEST_CASE("fused attention (cuDNN) matches the CPU's composite in bf16 and f16, causal or not, with gradients" *
          doctest::skip(kNoGpu)) {
  struct Case {
    DType dt;
    int64_t batch, heads, time, keys, head;
  };
  // Few: each builds a forward and a backward cuDNN graph per mask, kernels compiled at run time.
  const Case cases[] = {{DType::bf16, 2, 3, 64, 64, 64}, {DType::f16, 2, 3, 64, 64, 64},
                        {DType::bf16, 2, 3, 37, 37, 64}, {DType::bf16, 1, 2, 37, 64, 32},
                        {DType::bf16, 3, 2, 1, 64, 64}};  // T = 1: a size-1 dim among strided ones
  for (const Case& c : cases) {
    for (bool causal : {false, true}) {
      const DType dt = c.dt;
      const std::string what = std::string(name(dt)) + (causal ? " causal" : "") + " B=" + std::to_string(c.batch) +
                               " H=" + std::to_string(c.heads) + " T=" + std::to_string(c.time) +
                               " S=" + std::to_string(c.keys) + " D=" + std::to_string(c.head);
      INFO(what);
      manual_seed(5);
      // Values exact in `dt`, so the f32 reference on the CPU sees the GPU's inputs.
      auto values = [&](int64_t length) { return randn({c.batch, length, c.heads, c.head}).to(dt).to(DType::f32); };
      const std::vector<Tensor> buffers{values(c.time), values(c.keys), values(c.keys)};
      const Tensor g = values(c.time);
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.head));

      // The fused path takes these operands (forward and backward), or says why not.
      std::vector<Tensor> leaves;
      for (const Tensor& b : buffers) leaves.push_back(b.to(dt).to(kCUDA).detach().set_requires_grad(true));
      const Tensor q = leaves[0].transpose(1, 2), k = leaves[1].transpose(1, 2), v = leaves[2].transpose(1, 2);
      const Tensor out = empty({c.batch, c.time, c.heads, c.head}, on_gpu(dt)).transpose(1, 2);
      const std::string why = cuda::fused_attention_unsupported(q, k, v, out, causal, scale);
      if (c.time == c.keys) {
        CHECK_MESSAGE(why.empty(), why);
      } else if (!why.empty()) {
        MESSAGE("composed, T != S: " << why);
      }
      // Its stats are each row's natural-log logsumexp of the scaled scores s:
      // L_i = s_i0 - log_softmax(s)_i0 (key 0 is never masked).
      if (why.empty()) {
        const Tensor stats = empty({c.batch, c.heads, c.time}, on_gpu(DType::f32));
        REQUIRE(backend(kCUDA).attention(q, k, v, causal, scale, out, stats));
        const Tensor qd = buffers[0].to(DType::f64).transpose(1, 2), kd = buffers[1].to(DType::f64).transpose(1, 2);
        Tensor s = matmul(qd, kd, false, true) * scale;
        if (causal) s = masked_fill(s, gt(arange(c.keys).unsqueeze(0), arange(c.time).unsqueeze(1)), -INFINITY);
        const Tensor lse = s.narrow(-1, 0, 1) - log_softmax(s, -1).narrow(-1, 0, 1);
        check_close(stats, Host::of(lse.view({c.batch, c.heads, c.time})), 1e-3, 1e-3, "stats, " + what);
      }

      // The whole result's relative error: a few roundings to the dtype (inputs are exact).
      // The graphs checked above are the ones the forward and backward use: none is built.
      const double tol = dt == DType::bf16 ? 2e-2 : 5e-3;
      const cuda::AttentionGraphCount graphs = cuda::fused_attention_graphs(kCUDA);
      const std::vector<Tensor> got = attention_and_grads(buffers, g, causal, kCUDA, dt);
      CHECK(cuda::fused_attention_graphs(kCUDA).forward == graphs.forward);
      CHECK(cuda::fused_attention_graphs(kCUDA).backward == graphs.backward);
      const std::vector<Tensor> want = attention_and_grads(buffers, g, causal, kCPU, DType::f32);
      const char* names[] = {"out", "dq", "dk", "dv"};
      for (size_t i = 0; i < got.size(); ++i) {
        CHECK(got[i].device() == kCUDA);
        const double error = relative_error(got[i].to(kCPU), want[i]);
        CHECK_MESSAGE(error < tol, std::string(names[i]) << ": relative error " << error);
      }
    }
  }
  // Under no_grad no backward can follow: a new layout builds its forward graph alone.
  NoGradGuard no_grad;
  const cuda::AttentionGraphCount before = cuda::fused_attention_graphs(kCUDA);
  const Tensor x = randn({5, 16, 2, 64}).to(DType::bf16).to(kCUDA).set_requires_grad(true).transpose(1, 2);
  scaled_dot_product_attention(x, x, x, true);
  CHECK(cuda::fused_attention_graphs(kCUDA).forward == before.forward + 1);
  CHECK(cuda::fused_attention_graphs(kCUDA).backward == before.backward);
}

TEST_CASE("attention the fused kernels decline (f32, head size 12) runs composed on the GPU and matches the CPU" *
          doctest::skip(kNoGpu)) {
  const std::pair<DType, int64_t> declined[] = {{DType::f32, 16}, {DType::f16, 12}};
  for (const auto& [dt, head] : declined) {
    INFO(name(dt) << ", D=" << head);
    manual_seed(9);
    auto values = [&] { return randn({2, 37, 3, head}).to(dt).to(DType::f32); };
    const std::vector<Tensor> buffers{values(), values(), values()};
    const Tensor g = values();
    std::vector<Tensor> qkv;
    for (const Tensor& b : buffers) qkv.push_back(b.to(dt).to(kCUDA).transpose(1, 2));
    const Tensor out = empty({2, 37, 3, head}, on_gpu(dt)).transpose(1, 2);
    const Tensor stats = empty({2, 3, 37}, on_gpu(DType::f32));
    const double scale = 1.0 / std::sqrt(static_cast<double>(head));
    CHECK_FALSE(cuda::fused_attention_unsupported(qkv[0], qkv[1], qkv[2], out, true, scale).empty());
    CHECK_FALSE(backend(kCUDA).attention(qkv[0], qkv[1], qkv[2], true, scale, out, stats));
    const std::vector<Tensor> got = attention_and_grads(buffers, g, true, kCUDA, dt);
    const std::vector<Tensor> want = attention_and_grads(buffers, g, true, kCPU, DType::f32);
    for (size_t i = 0; i < got.size(); ++i)
      CHECK(relative_error(got[i].to(kCPU), want[i]) < (dt == DType::f32 ? 1e-5 : 2e-2));
  }
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("a copy between overlapping views of one storage matches the CPU (memmove semantics)" *
          doctest::skip(cuda::device_count() == 0)) {
  for (Device device : {kCPU, kCUDA}) {
    INFO(device.str());
    const Tensor t = arange(10, TensorOptions(DType::f32).device(device));
    t.narrow(0, 1, 9).copy_(t.narrow(0, 0, 9));
    CHECK(t.to_vector<double>() == std::vector<double>{0, 0, 1, 2, 3, 4, 5, 6, 7, 8});
    const Tensor u = arange(10, TensorOptions(DType::f32).device(device));
    u.narrow(0, 0, 5).copy_(u.slice(0, 1, 10, 2));  // strided, overlapping: u[i] = u[2 i + 1]
    CHECK(u.to_vector<double>() == std::vector<double>{1, 3, 5, 7, 9, 5, 6, 7, 8, 9});
  }
}

TEST_CASE("sort on the GPU orders as the CPU does: NaN of either sign or payload above +inf, -0 tied with +0, "
          "stable, integers, one long row and many short ones" * doctest::skip(kNoGpu)) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), negative_nan = std::copysign(nan, -1.0f);
  const std::vector<float> edge = {1, negative_nan, 2, -INFINITY, 0.0f, nan, -0.0f, INFINITY, 1, -0.0f, 0.0f, nan};
  const auto same_order = [](const Tensor& x, bool descending) {
    const SortResult cpu = sort(x, -1, descending), gpu = sort(x.to(kCUDA), -1, descending);
    CHECK(gpu.indices.to(kCPU).to_vector<int64_t>() == cpu.indices.to_vector<int64_t>());
  };
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (const bool descending : {false, true}) {
      INFO(name(dtype) << (descending ? " descending" : " ascending"));
      same_order(tensor<float>(edge).to(dtype), descending);
      same_order(tensor<float>(edge).to(dtype).view({3, 4}), descending);
    }
  // sort([1, -NaN, 2]) gives [0, 2, 1] on both: the NaN last, whatever its sign.
  CHECK(sort(tensor<float>({1, negative_nan, 2}).to(kCUDA)).indices.to(kCPU).to_vector<int64_t>() ==
        std::vector<int64_t>{0, 2, 1});
  manual_seed(3);
  same_order((rand({1000}) * 10.0).to(DType::i64), false);  // integer ties
  same_order(randn({50257}), true);                          // one long row (a vocabulary)
  same_order((randn({100000, 4}) * 4.0).to(DType::bf16), false);  // many short ones, ties in bf16
}

// A Llama small enough for the CPU with grouped-query attention (4 heads, 2 key/value heads)
// and a head size cuDNN's fused attention takes (64).
nn::LlamaConfig gqa_llama() {
  nn::LlamaConfig c;
  c.n_layer = 2, c.n_head = 4, c.n_kv_head = 2, c.n_embd = 256, c.vocab_size = 64, c.block_size = 64;
  return c;
}

TEST_CASE("grouped-query attention on the GPU (cuDNN in bf16) gives the CPU's loss and gradients" *
          doctest::skip(kNoGpu)) {
  const Sequence s = fixed_sequence();
  for (const DType dtype : {DType::f32, DType::bf16}) {
    INFO(name(dtype));
    const auto run = [&](Device device) {
      manual_seed(2);
      nn::Llama model(gqa_llama());
      model.to(device);
      model.to(dtype);
      const Tensor loss = model.forward(s.inputs.to(device), s.targets.to(device)).loss;
      loss.backward();
      nn::NamedTensors grads;
      for (const auto& [n, p] : model.named_parameters()) grads.emplace_back(n, p.grad().to(kCPU).to(DType::f32));
      return std::pair{loss.item<double>(), grads};
    };
    const auto [cpu_loss, cpu_grads] = run(kCPU);
    const auto [gpu_loss, gpu_grads] = run(kCUDA);
    CHECK(gpu_loss == doctest::Approx(cpu_loss).epsilon(dtype == DType::f32 ? 1e-5 : 2e-2));
    CHECK(max_difference(gpu_grads, cpu_grads) < (dtype == DType::f32 ? 1e-4 : 5e-2));
  }
}

TEST_CASE("generation with a KV cache on the GPU picks the CPU's greedy tokens" * doctest::skip(kNoGpu)) {
  const auto tokens = [](Device device) {
    manual_seed(3);
    nn::Llama model(gqa_llama());
    model.to(device);
    const Tensor prompt = tensor<int64_t>({1, 5, 9, 2}).view({1, 4}).to(device);
    return nn::generate(model, prompt, 12, {.temperature = 0}).to(kCPU).to_vector<int64_t>();
  };
  CHECK(tokens(kCUDA) == tokens(kCPU));
  // In bf16 the prompt runs fused (one forward graph, head size 64); each decode step's single
  // query row runs composed, so the tokens after it build no graph.
  manual_seed(3);
  nn::Llama model(gqa_llama());
  model.to(kCUDA);
  model.to(DType::bf16);
  const Tensor prompt = tensor<int64_t>({1, 5, 9, 2, 7, 3, 4, 8}).view({1, 8}).to(kCUDA);
  nn::generate(model, prompt, 1, {.temperature = 0});
  const cuda::AttentionGraphCount after_one = cuda::fused_attention_graphs(kCUDA);
  nn::generate(model, prompt, 16, {.temperature = 0});
  CHECK(cuda::fused_attention_graphs(kCUDA).forward == after_one.forward);
}

TEST_CASE("dropout on the GPU keeps the CPU's Philox mask and scales by 1/(1-p) in f32, in bf16 too" *
          doctest::skip(kNoGpu)) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    INFO(name(dtype));
    const Tensor x = (randn({64, 1000}) * 2.0).to(dtype);
    const auto dropped = [&](Device device) {
      manual_seed(9);
      return nn::dropout(x.to(device), 0.3, true).to(kCPU);
    };
    const Tensor cpu = dropped(kCPU), gpu = dropped(kCUDA);
    CHECK(max_abs_diff(gpu, cpu) == 0.0);
    const Tensor kept = ne(cpu, 0.0);
    CHECK(max_abs_diff(masked_fill(cpu, logical_not(kept), 0.0),
                       masked_fill((x.to(DType::f32) * (1 / 0.7)).to(dtype), logical_not(kept), 0.0)) == 0.0);
  }
}

TEST_CASE("AdamW parameter groups and offload on the GPU train the CPU's weights" * doctest::skip(kNoGpu)) {
  const Sequence s = fixed_sequence();
  const optim::AdamWOptions adamw{0.9, 0.95, 1e-8, 0.1, {{{"lm_head.weight", "transformer.wte.weight"}, 0.5, 0.0}}};
  const auto train = [&](Device device, dist::ZeroConfig config) {
    manual_seed(1);
    nn::GPT model(tiny_config());
    model.to(device);
    dist::SingleRank one;
    config.adamw = adamw;
    dist::ShardedModel trainer(model, one, config);
    for (int step = 0; step < 3; ++step) {
      trainer.zero_grad();
      model.forward(s.inputs.to(device), s.targets.to(device)).loss.backward();
      trainer.step(1e-2);
    }
    nn::NamedTensors master;
    for (auto& [n, t] : trainer.gathered_master()) master.emplace_back(n, t.to(kCPU).clone());
    return master;
  };
  for (const int stage : {1, 3}) {
    INFO("stage " << stage);
    const nn::NamedTensors cpu = train(kCPU, {.stage = stage}), gpu = train(kCUDA, {.stage = stage});
    CHECK(max_difference(gpu, cpu) < 1e-4);
    // Offload moves the optimizer (and at stage 3 the parameters) to pinned host memory, copies
    // asynchronously and stages the updates: the GPU run's weights, bit for bit.
    const dist::Offload most = stage == 3 ? dist::Offload::optimizer_and_params : dist::Offload::optimizer;
    CHECK(max_difference(train(kCUDA, {.stage = stage, .offload = most}), gpu) == 0.0);
  }
}

}  // namespace zg::test
