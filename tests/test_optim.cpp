// optim, and one device's training through a ShardedModel over a group of one: AdamW
// against hand-computed and PyTorch values, clipping and the schedule, gradient
// accumulation, mixed precision (bf16 compute tracking f32; f16 with the grad scaler
// surviving an inf), and what the flat buffers refuse.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "autograd/graph.h"
#include "nn/serialize.h"
#include "tensor/backend.h"
#include "tensor/cpu/isa.h"
#include "tiny_gpt.h"

namespace zg::test {

namespace {
// One parameter [1, 3] (rank 2, so it is in the weight-decay span) and a module holding it.
struct OneParam : nn::Module {
  Tensor p;
  explicit OneParam(std::vector<double> values) { p = register_parameter("p", tensor(values, {1, 3}, DType::f32)); }
};

// Writes `values` into a parameter's gradient (a view into its unit's flat buffer).
void set_grad(const Tensor& p, const std::vector<double>& values) {
  NoGradGuard no_grad;
  p.grad().copy_(tensor(values, p.shape(), DType::f32));
}

// A span over `master` with a zeroed gradient and Adam state, as a unit hands one to AdamW.
optim::AdamWSpan zeroed_span(const Tensor& master) {
  const int64_t n = master.numel();
  return {master, zeros({n}, master.dtype()), zeros({n}, master.dtype()), zeros({n}, master.dtype()), Tensor(), true};
}
}  // namespace

TEST_CASE("AdamW matches the hand-computed update for 3 steps, with weight decay and bias correction") {
  // On a span, where m and v are in sight, and through a ShardedModel over a group of
  // one, which hands AdamW the same span: the same update, bit for bit.
  const optim::AdamWOptions options{0.9, 0.999, 1e-8, 0.1};
  optim::AdamWSpan span = zeroed_span(tensor<float>({0.5, -1.0, 2.0}));
  OneParam module({0.5, -1.0, 2.0});
  dist::SingleRank one;
  dist::ShardedModel trainer(module, one, {.compute_dtype = DType::f32, .adamw = options});
  const double lr = 0.1;
  const std::vector<std::vector<double>> grads = {{0.1, -0.2, 0.3}, {-0.05, 0.4, 0.0}, {0.2, 0.2, -0.1}};
  // By hand, per element: p -= lr wd p; m = .9 m + .1 g; v = .999 v + .001 g^2;
  // p -= lr (m / (1 - .9^t)) / (sqrt(v / (1 - .999^t)) + eps)
  std::vector<double> p = {0.5, -1.0, 2.0}, m(3, 0.0), v(3, 0.0);
  // The same three steps in torch.optim.AdamW (f64), from tests/fixtures/make_fixtures.py.
  const std::vector<std::vector<double>> torch_values = {
      {0.39500000999999901, -0.89000000499999976, 1.8800000033333333},
      {0.36441630930339086, -0.91771035649603683, 1.7941941810458213},
      {0.29496099115834751, -0.96045733271670197, 1.7473387045054827}};
  for (int t = 1; t <= 3; ++t) {
    for (int i = 0; i < 3; ++i) {
      const double g = grads[t - 1][i];
      p[i] -= lr * 0.1 * p[i];
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.999 * v[i] + 0.001 * g * g;
      p[i] -= lr * (m[i] / (1 - std::pow(0.9, t))) / (std::sqrt(v[i] / (1 - std::pow(0.999, t))) + 1e-8);
    }
    span.grad.copy_(tensor(grads[t - 1], {3}, DType::f32));
    optim::adamw_update({span}, options, lr, t, 1.0);
    set_grad(module.p, grads[t - 1]);
    trainer.step(lr);
    const std::vector<float> got = span.master.to_vector<float>(), trained = module.p.to_vector<float>();
    for (int i = 0; i < 3; ++i) {
      INFO("step " << t << " element " << i);
      CHECK(got[i] == doctest::Approx(p[i]).epsilon(1e-6));
      CHECK(trained[i] == got[i]);
      CHECK(p[i] == doctest::Approx(torch_values[t - 1][i]).epsilon(1e-12));
    }
  }
  CHECK(span.m.to_vector<float>()[0] == doctest::Approx(m[0]).epsilon(1e-6));
  CHECK(span.v.to_vector<float>()[1] == doctest::Approx(v[1]).epsilon(1e-6));
  CHECK(trainer.steps() == 3);
}

TEST_CASE("AdamW leaves biases and norms undecayed; matrices are packed first, in one decay span") {
  struct BiasFirst : nn::Module {
    Tensor b = register_parameter("b", tensor<float>({1, 2, 3}));
    Tensor w = register_parameter("w", ones({2, 3}));
  } module;
  dist::SingleRank one;
  dist::ShardedModel trainer(module, one, {.compute_dtype = DType::f32, .adamw = {0.9, 0.999, 1e-8, 0.5}});
  // Registered after the bias, the matrix still comes first in the unit's buffers.
  CHECK(module.w.storage() == module.b.storage());
  CHECK(module.w.offset() == 0);
  CHECK(module.b.offset() == 6);
  CHECK(module.b.grad().storage() == module.w.grad().storage());
  CHECK(module.b.grad().offset() == 6);
  {
    NoGradGuard no_grad;
    module.w.grad().zero_();  // zero gradients, written: only decay moves anything
  }
  trainer.step(0.1);
  CHECK(module.b.to_vector<float>() == std::vector<float>{1, 2, 3});
  for (const float w : module.w.view({-1}).to_vector<float>()) CHECK(w == doctest::Approx(1 - 0.1 * 0.5).epsilon(1e-7));
}

TEST_CASE("warmup + cosine schedule, grad norm and clipping") {
  CHECK(optim::warmup_cosine_lr(0, 1.0, 0.1, 10, 110) == doctest::Approx(0.1));
  CHECK(optim::warmup_cosine_lr(9, 1.0, 0.1, 10, 110) == doctest::Approx(1.0));
  CHECK(optim::warmup_cosine_lr(60, 1.0, 0.1, 10, 110) == doctest::Approx(0.55));
  CHECK(optim::warmup_cosine_lr(110, 1.0, 0.1, 10, 110) == doctest::Approx(0.1));
  CHECK_THROWS_WITH_AS(optim::warmup_cosine_lr(-1, 1.0, 0.1, 10, 110),  // gave a negative lr
                       "warmup_cosine_lr: step and warmup count from 0, got step -1 and warmup 10", Error);
  CHECK(optim::warmup_cosine_lr(2, 1e308, 0, 20, 100) == doctest::Approx(1.5e307));  // was inf: max_lr (step + 1) first
  CHECK_THROWS_WITH_AS(optim::warmup_cosine_lr(2, NAN, 0, 20, 100),
                       "warmup_cosine_lr: max_lr and min_lr must be >= 0 and finite, got nan and 0", Error);
  // The step's global norm, with the loss scale divided out.
  OneParam module({0, 0, 0});
  dist::SingleRank one;
  dist::ShardedModel trainer(module, one, {.compute_dtype = DType::bf16});
  const auto norm_of = [&](optim::GradScaler* scaler) {
    trainer.zero_grad();
    set_grad(module.p, {3, 0, 4});
    return trainer.step(0.0, scaler).grad_norm;
  };
  CHECK(norm_of(nullptr) == doctest::Approx(5.0));
  optim::GradScaler scaler({.init_scale = 2.0});
  CHECK(norm_of(&scaler) == doctest::Approx(2.5));
  CHECK(optim::clip_coefficient(5.0, 1.0) == doctest::Approx(0.2).epsilon(1e-5));
  CHECK(optim::clip_coefficient(0.5, 1.0) == 1.0);
  // A NaN max_norm: the device coefficient was NaN, and every weight NaN after the step.
  CHECK_THROWS_WITH_AS(optim::clip_coefficient_on_device(tensor<float>({5}), NAN),
                       "clip_coefficient_on_device: max_norm is NaN (0 or less disables clipping)", Error);
  CHECK_THROWS_WITH_AS(optim::clip_coefficient(5.0, NAN), doctest::Contains("max_norm is NaN"), Error);
  CHECK_THROWS_WITH_AS(optim::clip_coefficient_on_device(tensor<float>({3, 4}), 1.0),
                       doctest::Contains("expected a norm of one floating element, got f32[2]"), Error);
}

TEST_CASE("clipping on the device: the host's coefficient, and the same AdamW step, without a read-back") {
  dist::SingleRank one;
  for (const double max_norm : {1.0, 10.0, 0.0}) {
    CAPTURE(max_norm);
    OneParam host({0.5, -1.0, 2.0}), device({0.5, -1.0, 2.0});
    const dist::ZeroConfig config{.compute_dtype = DType::f32, .max_grad_norm = max_norm};
    dist::ShardedModel host_trainer(host, one, config), device_trainer(device, one, config);
    for (const Tensor& p : {host.p, device.p}) set_grad(p, {3, 0, 4});
    const Tensor coefficient = optim::clip_coefficient_on_device(tensor<float>({5}), max_norm);
    CHECK(coefficient.shape() == Shape{1});
    CHECK(coefficient.dtype() == DType::f32);
    CHECK(coefficient.item<double>() == doctest::Approx(optim::clip_coefficient(5.0, max_norm)).epsilon(1e-6));
    const double host_norm = host_trainer.step(0.1).grad_norm;
    const Tensor device_norm = device_trainer.step_on_device(0.1);
    CHECK(device_norm.shape() == Shape{1});
    CHECK(device_norm.item<double>() == doctest::Approx(host_norm).epsilon(1e-6));
    const std::vector<float> a = host.p.to_vector<float>(), b = device.p.to_vector<float>();
    for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-6));
  }
  // A non-finite norm leaves the gradient alone (the step is then skipped by the caller).
  CHECK(optim::clip_coefficient_on_device(tensor<float>({INFINITY}), 1.0).item<double>() == 1.0);
  CHECK(optim::clip_coefficient_on_device(tensor<float>({NAN}), 1.0).item<double>() == 1.0);
  // Gradients of a loss scaled by 1024 clip as the unscaled ones: the scale leaves the norm first.
  OneParam plain({0.5, -1.0, 2.0}), scaled({0.5, -1.0, 2.0});
  const dist::ZeroConfig clipped{.compute_dtype = DType::f32, .max_grad_norm = 1.0};
  dist::ShardedModel plain_trainer(plain, one, clipped), scaled_trainer(scaled, one, clipped);
  set_grad(plain.p, {3, 0, 4});
  set_grad(scaled.p, {3 * 1024, 0, 4 * 1024});
  optim::GradScaler scaler({.init_scale = 1024});
  CHECK(scaled_trainer.step(0.1, &scaler).grad_norm == doctest::Approx(plain_trainer.step(0.1).grad_norm));
  const std::vector<float> a = plain.p.to_vector<float>(), b = scaled.p.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-6));
  // A scale that is not one element of the master's dtype on its device is refused by name.
  CHECK_THROWS_WITH_AS(optim::adamw_update({zeroed_span(zeros({3}))}, {}, 0.1, 1, 1.0, tensor<double>({1.0})),
                       doctest::Contains("adamw: device_scale must be one element of the master's dtype on its device, "
                                         "like f32[3] on cpu, got f64[1] on cpu"),
                       Error);
}

TEST_CASE("f64 training: step_on_device clips in f64, equal to step() to 1e-13 after 10 clipped steps") {
  // The device's norm and clipping coefficient are in the master's dtype: in f32 they left
  // the parameters 1.5e-8 from step()'s (and PyTorch's) after 10 steps.
  struct Net : nn::Module {
    Tensor w;
    Net() { w = register_parameter("w", tensor<double>({0.3, -1.2, 0.7, 2.5, -0.4, 0.9}, {2, 3})); }
  };
  dist::SingleRank one;
  Net host, device;
  const dist::ZeroConfig config{.compute_dtype = DType::f64, .adamw = {0.9, 0.999, 1e-8, 0.1}, .max_grad_norm = 0.5};
  dist::ShardedModel host_trainer(host, one, config), device_trainer(device, one, config);
  const Tensor x = tensor<double>({1.0, -2.0, 0.5, 3.0, 0.25, -1.5}, {2, 3});
  for (int step = 0; step < 10; ++step) {
    for (auto [net, trainer] : {std::pair{&host, &host_trainer}, {&device, &device_trainer}}) {
      trainer->zero_grad();
      sum(mul(mul(net->w, net->w), x)).backward();  // gradient 2 w x: norms well above 0.5, so every step clips
    }
    const double host_norm = host_trainer.step(0.01).grad_norm;
    const Tensor device_norm = device_trainer.step_on_device(0.01);
    CHECK(device_norm.dtype() == DType::f64);
    CHECK(host_norm > 0.5);
    CHECK(std::abs(device_norm.item<double>() - host_norm) <= 1e-13 * host_norm);
  }
  const std::vector<double> a = host.w.to_vector<double>(), b = device.w.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i) CHECK(std::abs(a[i] - b[i]) <= 1e-13);
}

TEST_CASE("step() with no gradient since the last step or zero_grad() is refused, naming the likely mistake") {
  // PyTorch skips parameters without a gradient; a flat buffer of zeros would instead take
  // weight decay and Adam's momentum as a step. A write to .grad counts as a gradient.
  OneParam module({0.5, -1.0, 2.0});
  dist::SingleRank one;
  dist::ShardedModel trainer(module, one, {.adamw = {0.9, 0.999, 1e-8, 0.1}});
  const std::string refused = "ShardedModel: step(): no gradient was computed since the last ";
  CHECK_THROWS_WITH_AS(trainer.step(0.1), doctest::Contains((refused + "zero_grad() (or construction)").c_str()), Error);
  set_grad(module.p, {0.1, 0.2, 0.3});
  CHECK(trainer.step(0.1).stepped);
  const std::vector<float> after_one = module.p.to_vector<float>();
  CHECK_THROWS_WITH_AS(trainer.step(0.1), doctest::Contains((refused + "step or zero_grad()").c_str()), Error);
  CHECK(module.p.to_vector<float>() == after_one);  // nothing moved
  sum(module.p).backward();
  CHECK(trainer.step(0.1).stepped);
  trainer.zero_grad();
  CHECK_THROWS_WITH_AS(trainer.step_on_device(0.1), doctest::Contains(refused.c_str()), Error);
}

TEST_CASE("a ShardedModel trains in f32 unless asked; with bf16 a floating input is cast as it enters") {
  dist::SingleRank one;
  {
    OneParam module({0.5, -1.0, 2.0});
    dist::ShardedModel trainer(module, one, {});
    CHECK(module.p.dtype() == DType::f32);
    CHECK(module.p.grad().dtype() == DType::f32);
  }
  // An MLP given f32 inputs under a bf16 compute dtype runs (FSDP2's cast_forward_inputs).
  nn::Sequential mlp{std::make_shared<nn::Linear>(2, 8), std::make_shared<nn::GELU>(), std::make_shared<nn::Linear>(8, 1)};
  dist::ShardedModel trainer(mlp, one, {.compute_dtype = DType::bf16});
  Tensor x = tensor<float>({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2});
  x.set_requires_grad();
  const Tensor y = mlp(x);
  CHECK(y.dtype() == DType::bf16);
  sum(y).backward();
  CHECK(x.grad().dtype() == DType::f32);  // the cast's gradient, back in the input's dtype
  CHECK(trainer.step(0.1).stepped);
}

TEST_CASE("the CPU AdamW kernel: each element is the f32 update, bit for bit, at any span length and thread split") {
  // The vectorized loop (AVX2, 8 lanes) and its tail, the worker threads' blocks (256Ki
  // elements), bf16 and f32 gradients and compute copies: every element equals this loop's
  // f32 arithmetic (cuda/adamw.cu's order), and the bf16 copy is the master rounded.
  // (The loop is the widest this CPU has: run with ZG_CPU_ISA=avx2 and =portable for the others.)
  MESSAGE("CPU AdamW loop: " << std::string(cpu::name(cpu::cpu_isa())));
  manual_seed(11);
  AdamWStep step;
  step.lr = 3e-3, step.beta1 = 0.9, step.beta2 = 0.95, step.eps = 1e-8, step.weight_decay = 0.1;
  step.grad_scale = 0.5, step.step = 3;
  // The constants as the kernel has them: computed in f64, rounded to f32 once.
  const float decay = static_cast<float>(3e-3 * 0.1), b1 = 0.9f, b2 = 0.95f;
  const float one_minus_b1 = static_cast<float>(1 - 0.9), one_minus_b2 = static_cast<float>(1 - 0.95);
  const float step_size = static_cast<float>(3e-3 / (1 - std::pow(0.9, 3)));
  const float inv_sqrt_bias2 = static_cast<float>(1 / std::sqrt(1 - std::pow(0.95, 3)));
  for (const DType grad_dtype : {DType::f32, DType::bf16})
    for (const bool bf16_copy : {false, true})
      for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{13}, int64_t{1000}, int64_t{3 * 262144 + 5}}) {
        const std::string what = std::string(name(grad_dtype)) + " gradients, " +
                                 (bf16_copy ? "a bf16 copy, " : "no copy, ") + std::to_string(n) + " elements";
        INFO(what);
        const Tensor master = randn({n}), grad = randn({n}).to(grad_dtype), m = randn({n}) * 0.1, v = rand({n});
        if (n > 8) {  // the lanes pass NaN and inf through as the scalar loop does
          Tensor(grad.narrow(0, 3, 1)).fill_(NAN);
          Tensor(grad.narrow(0, 5, 1)).fill_(INFINITY);
        }
        const Tensor compute = bf16_copy ? empty({n}, DType::bf16) : Tensor();
        std::vector<float> p = master.to_vector<float>(), g = grad.to(DType::f32).to_vector<float>(),
                           m1 = m.to_vector<float>(), v1 = v.to_vector<float>();
        backend(kCPU).adamw(master, grad, m, v, compute, step);
        for (int64_t i = 0; i < n; ++i) {
          const float gi = g[i] * 0.5f;
          float pi = p[i];
          pi -= decay * pi;
          m1[i] = b1 * m1[i] + one_minus_b1 * gi;
          v1[i] = b2 * v1[i] + one_minus_b2 * gi * gi;
          p[i] = pi - step_size * (m1[i] / (std::sqrt(v1[i]) * inv_sqrt_bias2 + 1e-8f));
        }
        const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {  // any NaN equals any NaN
          if (a.size() != b.size()) return false;
          for (size_t i = 0; i < a.size(); ++i)
            if (!(std::isnan(a[i]) && std::isnan(b[i])) && std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return false;
          return true;
        };
        CHECK(same_bits(master.to_vector<float>(), p));
        CHECK(same_bits(m.to_vector<float>(), m1));
        CHECK(same_bits(v.to_vector<float>(), v1));
        if (bf16_copy) {
          const std::vector<float> rounded = tensor<float>(p).to(DType::bf16).to(DType::f32).to_vector<float>();
          CHECK(same_bits(compute.to(DType::f32).to_vector<float>(), rounded));
        }
      }
}

TEST_CASE("gradient accumulation over two micro-batches equals one batch") {
  manual_seed(3);
  nn::GPT model(tiny_config());
  dist::SingleRank one;
  dist::ShardedModel trainer(model, one, {.compute_dtype = DType::f32});
  const Tensor x = (rand({4, 16}, DType::f64) * 64.0).to(DType::i64);
  const Tensor y = (rand({4, 16}, DType::f64) * 64.0).to(DType::i64);
  model.forward(x, y).loss.backward();
  const std::vector<float> whole = gradients_of(model);
  trainer.zero_grad();
  for (int64_t half = 0; half < 2; ++half)
    (model.forward(x.narrow(0, 2 * half, 2), y.narrow(0, 2 * half, 2)).loss * 0.5).backward();
  const std::vector<float> accumulated = gradients_of(model);
  double worst = 0;
  for (size_t i = 0; i < whole.size(); ++i) worst = std::max(worst, std::fabs(double(whole[i]) - accumulated[i]));
  CHECK(worst < 1e-6);
  CHECK(whole.size() == static_cast<size_t>(trainer.num_parameters()));
}

TEST_CASE("bf16 compute with fp32 master weights tracks the f32 loss curve within 2% over 50 steps") {
  const Sequence s = fixed_sequence();
  std::vector<double> f32_losses, bf16_losses;
  {
    Context rank;
    ContextGuard guard(rank);
    TinyTrainer t(DType::f32);
    for (int i = 0; i < 50; ++i) f32_losses.push_back(t.step(s, 3e-3));
  }
  {
    Context rank;
    ContextGuard guard(rank);
    TinyTrainer t(DType::bf16);
    CHECK(t.model->wte->weight.dtype() == DType::bf16);
    const int64_t n = t.trainer->num_parameters();
    CHECK(memory_stats()[MemoryCategory::optimizer_state] == n * 12);  // master + m + v
    CHECK(memory_stats()[MemoryCategory::gradient] == n * 2);
    CHECK(t.trainer->gathered_master().front().second.dtype() == DType::f32);
    for (int i = 0; i < 50; ++i) bf16_losses.push_back(t.step(s, 3e-3));
  }
  double worst = 0;
  for (int i = 0; i < 50; ++i) worst = std::max(worst, std::fabs(bf16_losses[i] - f32_losses[i]) / f32_losses[i]);
  MESSAGE("f32 " << f32_losses.front() << " -> " << f32_losses.back() << ", bf16 " << bf16_losses.back()
                 << ", worst relative gap " << worst);
  CHECK(f32_losses.back() < 0.5 * f32_losses.front());
  CHECK(worst < 0.02);
}

TEST_CASE("f16 with the grad scaler survives an injected inf: step skipped, scale halved, parameters unchanged") {
  Context rank;
  ContextGuard guard(rank);
  const Sequence s = fixed_sequence();
  TinyTrainer t(DType::f16);
  optim::GradScaler scaler({1024.0, 2.0, 0.5, 2000, true});
  const Tensor first = t.model->named_parameters().front().second;
  auto train_step = [&](bool inject_inf) {
    t.trainer->zero_grad();
    t.forward_backward(s, scaler.scale_factor());
    if (inject_inf) {
      NoGradGuard no_grad;
      first.grad().view({-1}).narrow(0, 7, 1).fill_(INFINITY);
    }
    return t.trainer->step(1e-3, &scaler).stepped;
  };
  CHECK(train_step(false));
  const std::vector<float> master = flat_values(t.trainer->gathered_master());
  const std::vector<float> weights = flat_values(t.model->named_parameters());
  const int64_t steps = t.trainer->steps();
  CHECK_FALSE(train_step(true));
  CHECK(scaler.scale_factor() == 512.0);
  CHECK(t.trainer->steps() == steps);
  CHECK(flat_values(t.trainer->gathered_master()) == master);
  CHECK(flat_values(t.model->named_parameters()) == weights);
  CHECK(train_step(false));  // and training goes on
  CHECK(flat_values(t.trainer->gathered_master()) != master);
}

TEST_CASE("parameters stay in their ShardedModel: Module::zero_grad zeroes the buffer, repointing is refused") {
  struct Net : nn::Module {
    std::shared_ptr<nn::Linear> first = register_module("first", std::make_shared<nn::Linear>(3, 2));
    std::shared_ptr<nn::Linear> second = register_module("second", std::make_shared<nn::Linear>(2, 1));
  } net;
  const Tensor x = tensor<float>({1, -2, 0.5, 3, 1, -1}, {2, 3});
  const auto backward = [&] { sum((*net.second)((*net.first)(x))).backward(); };
  {
    dist::SingleRank one;
    dist::ShardedModel trainer(net, one, {.compute_dtype = DType::f32});
    backward();
    const std::vector<float> once = gradients_of(net);
    backward();
    // It used to drop the .grad views: the next backward made new tensors and the
    // optimizer went on reading the stale flat buffer.
    net.zero_grad();
    CHECK(gradients_of(net) == std::vector<float>(once.size(), 0.0f));
    for (const Tensor& p : net.parameters()) CHECK(p.grad().storage() == net.first->weight.grad().storage());
    backward();
    CHECK(gradients_of(net) == once);

    const std::string owner = "a DDP (stage 0) ShardedModel";
    const auto weight_storage = net.first->weight.storage();
    CHECK_THROWS_WITH_AS(net.to(DType::bf16),
                         ("to: parameter 'first.weight' lives in the flat buffers of " + owner +
                          ", which would not follow it; move or convert the model before building that").c_str(),
                         Error);
    CHECK((net.first->weight.storage() == weight_storage && net.second->bias.dtype() == DType::f32));
    CHECK_THROWS_WITH_AS(net.first->zero_grad(),
                         doctest::Contains(("zero_grad: this module has 2 of the 4 parameters in the flat buffers of " +
                                            owner).c_str()),
                         Error);
    CHECK(gradients_of(net) == once);  // nothing zeroed
    CHECK_THROWS_WITH_AS(net.first->bias.set_grad(Tensor()),
                         doctest::Contains(("set_grad: f32[2] on cpu is a parameter in the flat buffers of " + owner).c_str()),
                         Error);
    CHECK_THROWS_WITH_AS(net.first->bias.set_data(zeros({2})), doctest::Contains("set_data: f32[2] on cpu is a parameter"),
                         Error);
    CHECK_THROWS_WITH_AS(dist::ShardedModel(net, one, {.compute_dtype = DType::f32}),
                         ("ShardedModel: parameter 'first.weight' already lives in the flat buffers of " + owner).c_str(),
                         Error);
    const std::string path = "/tmp/zg_test_owned_" + std::to_string(::getpid()) + ".safetensors";
    nn::save_state(net, path);
    CHECK_THROWS_WITH_AS(nn::load_state(net, path),
                         doctest::Contains(("load_state: parameter 'first.weight' lives in the flat buffers of " + owner +
                                            ", whose master weights would overwrite what is loaded").c_str()),
                         Error);
    std::remove(path.c_str());
  }
  // Once the ShardedModel is gone the parameters are the model's own again.
  net.zero_grad();
  CHECK_FALSE(net.first->weight.grad().defined());
  net.to(DType::f64);
  CHECK(net.first->weight.dtype() == DType::f64);
}

TEST_CASE("a write to a parameter that a bf16 update would overwrite from the master is refused, not lost") {
  OneParam module({0.5, -1.0, 2.0});
  dist::SingleRank one;
  dist::ShardedModel trainer(module, one, {.compute_dtype = DType::bf16});
  sum(module.p).backward();
  trainer.step(0.1);  // the step's own writes are not the user's
  const std::string dir = "/tmp/zg_test_written_" + std::to_string(::getpid());
  trainer.save(dir);
  {
    NoGradGuard no_grad;
    module.p.narrow(1, 0, 1).fill_(1.0);  // through a view, too
  }
  // The step would have rewritten it from the f32 master: 0.5 - 0.1 - ..., not 1.
  CHECK_THROWS_WITH_AS(trainer.step(0.1),
                       doctest::Contains("ShardedModel: step(): the bf16 compute weights were written since the last "
                                         "step"),
                       Error);
  CHECK(trainer.steps() == 1);
  // The way that is kept: write the master weights, through a checkpoint.
  const std::string file = dist::ShardedModel::current_save(dir) + "/rank-00000-of-00001.safetensors";
  {
    const SafetensorsFile saved(file);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& name : saved.names()) tensors.emplace_back(name, saved.read(name));
    for (auto& [name, t] : tensors)
      if (name == "master/p/0") t.narrow(0, 0, 1).fill_(1.0);
    save_safetensors(file, tensors, saved.metadata());
  }
  trainer.load(dir);  // the compute weights from the loaded master
  CHECK(module.p.to(DType::f32).to_vector<float>()[0] == 1.0f);
  sum(module.p).backward();
  trainer.step(0.0);
  CHECK(module.p.to(DType::f32).to_vector<float>()[0] == 1.0f);
  std::filesystem::remove_all(dir);
  // With f32 compute the parameter is the master: a write there stays.
  OneParam f32({0.5, -1.0, 2.0});
  dist::ShardedModel f32_trainer(f32, one, {.compute_dtype = DType::f32});
  {
    NoGradGuard no_grad;
    f32.p.fill_(1.0);
  }
  sum(f32.p).backward();
  f32_trainer.step(0.0);
  CHECK(f32.p.to_vector<float>() == std::vector<float>{1, 1, 1});
}

TEST_CASE("AdamW, the grad scaler and ShardedModel's packing refuse what they cannot use") {
  OneParam module({0.5, -1.0, 2.0});
  dist::SingleRank one;
  const optim::AdamWSpan span = zeroed_span(tensor<float>({0.5, -1.0, 2.0}));
  using optim::AdamWOptions;
  for (const auto& [options, message] :
       {std::pair{AdamWOptions{1.0, 0.999, 1e-8, 0.0}, "beta1 and beta2 must lie in [0, 1)"},
        std::pair{AdamWOptions{0.9, -0.1, 1e-8, 0.0}, "beta1 and beta2 must lie in [0, 1)"},
        std::pair{AdamWOptions{0.9, 0.999, 0.0, 0.0}, "eps must be positive"},
        std::pair{AdamWOptions{0.9, 0.999, 1e-8, -0.1}, "weight_decay must be >= 0"},
        std::pair{AdamWOptions{0.9, 0.999, 1e-8, std::nan("")}, "weight_decay must be >= 0"}}) {
    CHECK_THROWS_WITH_AS(dist::ShardedModel(module, one, {.compute_dtype = DType::f32, .adamw = options}),
                         doctest::Contains(message), Error);
    CHECK_THROWS_WITH_AS(optim::adamw_update({span}, options, 1e-3, 1, 1.0), doctest::Contains(message), Error);
  }
  CHECK(ParameterOwner::of(module.p) == nullptr);  // a refused ShardedModel left the parameter alone
  dist::ShardedModel trainer(module, one, {.compute_dtype = DType::f32});
  set_grad(module.p, {1, 1, 1});
  const std::vector<float> before = module.p.to_vector<float>();
  CHECK_THROWS_WITH_AS(trainer.step(-1e-3), doctest::Contains("lr must be >= 0 and finite, got -0.001"), Error);
  CHECK_THROWS_WITH_AS(trainer.step(NAN), doctest::Contains("lr must be >= 0 and finite, got nan"), Error);
  CHECK(trainer.steps() == 0);  // a refused step is not counted
  CHECK(module.p.to_vector<float>() == before);
  CHECK_THROWS_WITH_AS(optim::adamw_update({span}, {}, 1e-3, 1, std::numeric_limits<double>::infinity()),
                       doctest::Contains("grad_scale must be >= 0 and finite"), Error);
  CHECK_THROWS_WITH_AS(optim::adamw_update({span}, {}, 1e-3, 0, 1.0), doctest::Contains("step counts from 1"), Error);
  CHECK(span.master.to_vector<float>() == std::vector<float>{0.5, -1.0, 2.0});

  CHECK_THROWS_WITH_AS(optim::GradScaler({.init_scale = 0}), doctest::Contains("init_scale must be positive"), Error);
  CHECK_THROWS_WITH_AS(optim::GradScaler({.growth_factor = 1}), doctest::Contains("growth_factor must be > 1"), Error);
  CHECK_THROWS_WITH_AS(optim::GradScaler({.backoff_factor = 1}), doctest::Contains("backoff_factor must lie in (0, 1)"),
                       Error);
  CHECK_THROWS_WITH_AS(optim::GradScaler({.growth_interval = 0}), doctest::Contains("growth_interval must be positive"),
                       Error);
  // The scale stays within f32's range, it and its inverse: growth past it (an f32 loss
  // times it was inf, and scale() threw once it passed f32's largest) and a backoff so
  // deep that the inverse would overflow are skipped.
  CHECK_THROWS_WITH_AS(optim::GradScaler({.init_scale = 1e39}),
                       doctest::Contains("init_scale must be positive, with it and its inverse finite in f32"), Error);
  optim::GradScaler huge({.init_scale = 2e38, .growth_interval = 1});
  CHECK(huge.update(false));
  CHECK(huge.scale_factor() == 2e38);
  CHECK(std::isfinite(huge.scale(tensor<float>({1e-3f})).item<float>()));
  optim::GradScaler tiny({.init_scale = 1e-37});
  for (int i = 0; i < 100; ++i) CHECK_FALSE(tiny.update(true));
  CHECK((tiny.scale_factor() > 0 && 1.0 / tiny.scale_factor() <= std::numeric_limits<float>::max()));
  // good_steps past the interval (another run's interval, a file's value) grow at the
  // next good step; INT64_MAX overflowed the count.
  optim::GradScaler resumed({.growth_interval = 10});
  resumed.set_scale(4.0, INT64_MAX);
  CHECK(resumed.update(false));
  CHECK(resumed.scale_factor() == 8.0);
  CHECK(resumed.good_steps() == 0);
  // A disabled scaler's scale stays 1 (it took one from set_scale, then scaled every loss).
  optim::GradScaler disabled({.enabled = false});
  CHECK_THROWS_WITH_AS(disabled.set_scale(65536, 0), "GradScaler: set_scale on a disabled scaler (its scale stays 1)",
                       Error);
  // A 16-bit loss is scaled in f32: the default 65536 is past f16's largest value.
  for (const DType dtype : {DType::f16, DType::bf16}) {
    const Tensor loss = full({}, 3.0, dtype).set_requires_grad(true);
    const Tensor scaled = optim::GradScaler().scale(loss);
    CHECK(scaled.dtype() == DType::f32);
    CHECK(scaled.item<double>() == 3.0 * 65536);
    scaled.backward();
    CHECK(loss.grad().dtype() == dtype);
  }

  // Packing: trainable parameters, none sharing memory with another. (Module's
  // register_parameter already refuses undefined tensors and repeated names, and makes
  // each parameter a leaf.) Leaves over parameter memory are registered as they are.
  Tensor base;
  {
    MemoryScope scope(MemoryCategory::parameter);
    base = tensor<float>({1, 2, 3, 4}, {2, 2});
  }
  const auto trainable = [](const Tensor& t) {
    Tensor p = t.detach();  // a leaf over the same memory
    p.set_requires_grad(true);
    return p;
  };
  {
    nn::Module overlapping;
    overlapping.register_parameter("a", trainable(base));
    overlapping.register_parameter("row", trainable(base.select(0, 1)));
    CHECK_THROWS_WITH_AS(dist::ShardedModel(overlapping, one, {.compute_dtype = DType::f32}),
                         doctest::Contains("parameters 'a' and 'row' share memory"), Error);
  }
  // Frozen once packed, it went on moving (weight decay, momentum): refused by name.
  CHECK_THROWS_WITH_AS(Tensor(module.p).set_requires_grad(false),
                       doctest::Contains("is a parameter in the flat buffers of a DDP (stage 0) ShardedModel, which "
                                         "trains every parameter it holds"),
                       Error);
  CHECK(module.p.requires_grad());
  // A weight registered in two modules is one parameter: listed once, packed once, one
  // gradient from both uses. (It was two leaves over one storage, so packing refused it.)
  struct Tied : nn::Module {
    Tensor embedding, head;
    Tied() {
      embedding = register_parameter("embedding", zeros({4, 2}));
      head = register_parameter("head", embedding);
    }
  } tied;
  REQUIRE(tied.named_parameters().size() == 1);
  CHECK(tied.named_parameters()[0].first == "embedding");
  tied.to(DType::f64);  // converted once, and still one tensor
  CHECK(tied.head.is_same(tied.embedding));
  dist::ShardedModel tied_trainer(tied, one, {.compute_dtype = DType::f64});
  CHECK(tied_trainer.num_parameters() == 8);
  sum(tied.embedding * 2.0 + tied.head).backward();
  CHECK(tied.head.grad().to_vector<double>() == std::vector<double>(8, 3.0));
  // Two rows of one buffer that do not overlap pack fine (a model whose parameters are
  // already views into an earlier ShardedModel's buffer).
  nn::Module rows;
  rows.register_parameter("r0", trainable(base.select(0, 0)));
  rows.register_parameter("r1", trainable(base.select(0, 1)));
  dist::ShardedModel rows_trainer(rows, one, {.compute_dtype = DType::f32});
  CHECK(rows_trainer.num_parameters() == 4);
}

}  // namespace zg::test
