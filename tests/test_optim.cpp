// optim: AdamW against hand-computed and PyTorch values, SGD, clipping and the
// schedule, gradient accumulation, and mixed precision (bf16 compute tracking
// f32; f16 with the grad scaler surviving an inf).
#include "autograd/graph.h"
#include "nn/serialize.h"
#include "optim/sgd.h"
#include "tiny_gpt.h"

#include <unistd.h>

#include <cstdio>

namespace zg::test {

namespace {
// One parameter [1, 3] (rank 2, so it is in the weight-decay span) and a module holding it.
struct OneParam : nn::Module {
  Tensor p;
  explicit OneParam(std::vector<double> values) { p = register_parameter("p", tensor(values, {1, 3}, DType::f32)); }
};
}  // namespace

TEST_CASE("AdamW matches the hand-computed update for 3 steps, with weight decay and bias correction") {
  OneParam module({0.5, -1.0, 2.0});
  optim::FlatParameters flat(module.named_parameters(), DType::f32);
  optim::AdamW adamw(flat, {0.9, 0.999, 1e-8, 0.1});
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
    flat.grad.copy_(tensor(grads[t - 1], {3}, DType::f32));
    adamw.step(lr);
    const std::vector<float> got = module.p.to_vector<float>();
    for (int i = 0; i < 3; ++i) {
      INFO("step " << t << " element " << i);
      CHECK(got[i] == doctest::Approx(p[i]).epsilon(1e-6));
      CHECK(p[i] == doctest::Approx(torch_values[t - 1][i]).epsilon(1e-12));
    }
  }
  CHECK(adamw.m.to_vector<float>()[0] == doctest::Approx(m[0]).epsilon(1e-6));
}

TEST_CASE("AdamW leaves biases and norms undecayed; SGD with momentum by hand") {
  nn::Linear layer(3, 2);
  const std::vector<float> bias_before = layer.bias.to_vector<float>();
  optim::FlatParameters flat(layer.named_parameters(), DType::f32);
  CHECK(flat.spans[0].weight_decay);
  CHECK(flat.spans[0].length == 6);  // weight first
  CHECK_FALSE(flat.spans[1].weight_decay);
  optim::AdamW adamw(flat, {0.9, 0.999, 1e-8, 0.5});
  adamw.step(0.1);  // zero gradients: only decay moves anything
  CHECK(layer.bias.to_vector<float>() == bias_before);

  OneParam module({1.0, 2.0, 3.0});
  optim::FlatParameters sgd_flat(module.named_parameters(), DType::f32);
  optim::SGD sgd(sgd_flat, {0.9, 0.0});
  for (int t = 0; t < 2; ++t) {
    sgd_flat.grad.fill_(1.0);
    sgd.step(0.1);
  }
  // buf: 1, then 1.9; p: 1 - 0.1 - 0.19 = 0.71
  CHECK(module.p.to_vector<float>()[0] == doctest::Approx(0.71));

  // f64 training keeps its momentum in f64 (it was always f32, and the step failed).
  OneParam wide({1.0, 2.0, 3.0});
  wide.to(DType::f64);
  optim::FlatParameters wide_flat(wide.named_parameters(), DType::f64);
  optim::SGD wide_sgd(wide_flat, {0.9, 0.0});
  CHECK(wide_sgd.momentum_buffer.dtype() == DType::f64);
  for (int t = 0; t < 2; ++t) {
    wide_flat.grad.fill_(1.0);
    wide_sgd.step(0.1);
  }
  CHECK(wide.p.to_vector<double>()[0] == doctest::Approx(0.71).epsilon(1e-15));

  // A NaN lr made every weight NaN.
  CHECK_THROWS_WITH_AS(sgd.step(NAN), "SGD: lr must be >= 0 and finite, got nan", Error);
  CHECK_THROWS_WITH_AS(sgd.step(0.1, -1.0), "SGD: grad_scale must be >= 0 and finite, got -1", Error);
  CHECK_THROWS_WITH_AS(optim::SGD(sgd_flat, {INFINITY, 0.0}), "SGD: momentum must be >= 0 and finite, got inf", Error);
  CHECK_THROWS_WITH_AS(optim::SGD(sgd_flat, {0.9, -0.1}), "SGD: weight_decay must be >= 0 and finite, got -0.1", Error);
  CHECK(module.p.to_vector<float>()[0] == doctest::Approx(0.71));  // refused steps changed nothing
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
  OneParam module({0, 0, 0});
  optim::FlatParameters flat(module.named_parameters(), DType::bf16);
  flat.grad.copy_(tensor<float>({3, 0, 4}));
  CHECK(optim::grad_norm(flat) == doctest::Approx(5.0));
  CHECK(optim::grad_norm(flat, 0.5) == doctest::Approx(2.5));
  CHECK(optim::clip_coefficient(5.0, 1.0) == doctest::Approx(0.2).epsilon(1e-5));
  CHECK(optim::clip_coefficient(0.5, 1.0) == 1.0);
  // A NaN max_norm: the device coefficient was NaN, and every weight NaN after the step.
  CHECK_THROWS_WITH_AS(optim::clip_coefficient_on_device(flat, NAN),
                       "clip_coefficient_on_device: max_norm is NaN (0 or less disables clipping)", Error);
  CHECK_THROWS_WITH_AS(optim::clip_coefficient(5.0, NAN), doctest::Contains("max_norm is NaN"), Error);
}

TEST_CASE("clipping on the device: the host's coefficient, and the same AdamW step, without a read-back") {
  for (const double max_norm : {1.0, 10.0, 0.0}) {
    CAPTURE(max_norm);
    OneParam host({0.5, -1.0, 2.0}), device({0.5, -1.0, 2.0});
    optim::FlatParameters host_flat(host.named_parameters(), DType::f32), device_flat(device.named_parameters(), DType::f32);
    optim::AdamW host_adamw(host_flat, {}), device_adamw(device_flat, {});
    for (optim::FlatParameters* flat : {&host_flat, &device_flat}) flat->grad.copy_(tensor<float>({3, 0, 4}));
    const Tensor coefficient = optim::clip_coefficient_on_device(device_flat, max_norm);
    CHECK(coefficient.shape() == Shape{1});
    CHECK(coefficient.dtype() == DType::f32);
    CHECK(coefficient.item<double>() == doctest::Approx(optim::clip_coefficient(5.0, max_norm)).epsilon(1e-6));
    host_adamw.step(0.1, optim::clip_coefficient(optim::grad_norm(host_flat), max_norm));
    device_adamw.step(0.1, 1.0, coefficient);
    const std::vector<float> a = host_flat.master.to_vector<float>(), b = device_flat.master.to_vector<float>();
    for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-6));
  }
  // A non-finite norm leaves the gradient alone (the step is then skipped by the caller).
  OneParam module({0, 0, 0});
  optim::FlatParameters flat(module.named_parameters(), DType::f32);
  flat.grad.copy_(tensor<float>({INFINITY, 0, 1}));
  CHECK(optim::clip_coefficient_on_device(flat, 1.0).item<double>() == 1.0);
  // Gradients of a loss scaled by 1024 clip as the unscaled ones once inv_scale is given.
  flat.grad.copy_(tensor<float>({3 * 1024, 0, 4 * 1024}));
  CHECK(optim::clip_coefficient_on_device(flat, 1.0, 1.0 / 1024).item<double>() ==
        doctest::Approx(optim::clip_coefficient(5.0, 1.0)).epsilon(1e-6));
  // A scale that is not one f32 on the master's device is refused by name.
  optim::AdamW adamw(flat, {});
  CHECK_THROWS_WITH_AS(adamw.step(0.1, 1.0, tensor<double>({1.0})),
                       doctest::Contains("adamw: device_scale must be one f32 on cpu"), Error);
}

TEST_CASE("gradient accumulation over two micro-batches equals one batch") {
  manual_seed(3);
  nn::GPT model(tiny_config());
  optim::FlatParameters flat(model.named_parameters(), DType::f32);
  const Tensor x = (rand({4, 16}, DType::f64) * 64.0).to(DType::i64);
  const Tensor y = (rand({4, 16}, DType::f64) * 64.0).to(DType::i64);
  model.forward(x, y).loss.backward();
  const std::vector<float> whole = flat.grad.to_vector<float>();
  flat.zero_grad();
  for (int64_t half = 0; half < 2; ++half)
    (model.forward(x.narrow(0, 2 * half, 2), y.narrow(0, 2 * half, 2)).loss * 0.5).backward();
  const std::vector<float> accumulated = flat.grad.to_vector<float>();
  double worst = 0;
  for (size_t i = 0; i < whole.size(); ++i) worst = std::max(worst, std::fabs(double(whole[i]) - accumulated[i]));
  CHECK(worst < 1e-6);
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
    CHECK(t.flat->master.dtype() == DType::f32);
    CHECK(memory_stats()[MemoryCategory::optimizer_state] == t.flat->numel() * 12);  // master + m + v
    CHECK(memory_stats()[MemoryCategory::gradient] == t.flat->numel() * 2);
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
  auto train_step = [&](bool inject_inf) {
    t.flat->zero_grad();
    t.forward_backward(s, scaler.scale_factor());
    if (inject_inf) {
      NoGradGuard no_grad;
      t.flat->grad.narrow(0, 7, 1).fill_(INFINITY);
    }
    const double norm = optim::grad_norm(*t.flat, scaler.inv_scale());
    const bool take = scaler.update(!std::isfinite(norm));
    if (take) t.adamw->step(1e-3, scaler.inv_scale() * optim::clip_coefficient(norm, 1.0));
    return take;
  };
  CHECK(train_step(false));
  const std::vector<float> master = t.flat->master.to_vector<float>();
  const std::vector<float> weights = t.flat->compute.to_vector<float>();
  const int64_t steps = t.adamw->steps();
  CHECK_FALSE(train_step(true));
  CHECK(scaler.scale_factor() == 512.0);
  CHECK(t.adamw->steps() == steps);
  CHECK(t.flat->master.to_vector<float>() == master);
  CHECK(t.flat->compute.to_vector<float>() == weights);
  CHECK(train_step(false));  // and training goes on
  CHECK(t.flat->master.to_vector<float>() != master);
}

TEST_CASE("parameters stay in their FlatParameters: Module::zero_grad zeroes the buffer, repointing is refused") {
  struct Net : nn::Module {
    std::shared_ptr<nn::Linear> first = register_module("first", std::make_shared<nn::Linear>(3, 2));
    std::shared_ptr<nn::Linear> second = register_module("second", std::make_shared<nn::Linear>(2, 1));
  } net;
  const Tensor x = tensor<float>({1, -2, 0.5, 3, 1, -1}, {2, 3});
  const auto backward = [&] { sum((*net.second)((*net.first)(x))).backward(); };
  {
    optim::FlatParameters flat(net.named_parameters(), DType::f32);
    backward();
    const std::vector<float> once = flat.grad.to_vector<float>();
    backward();
    // It used to drop the .grad views: the next backward made new tensors and the
    // optimizer went on reading the stale flat buffer.
    net.zero_grad();
    CHECK(flat.grad.to_vector<float>() == std::vector<float>(once.size(), 0.0f));
    CHECK(net.first->weight.grad().storage() == flat.grad.storage());
    backward();
    CHECK(flat.grad.to_vector<float>() == once);

    const auto weight_storage = net.first->weight.storage();
    CHECK_THROWS_WITH_AS(net.to(DType::bf16),
                         "to: parameter 'first.weight' lives in the flat buffers of a FlatParameters, which would not follow "
                         "it; move or convert the model before building that", Error);
    CHECK((net.first->weight.storage() == weight_storage && net.second->bias.dtype() == DType::f32));
    CHECK_THROWS_WITH_AS(net.first->zero_grad(),
                         doctest::Contains("zero_grad: this module has 2 of the 4 parameters in the flat buffers of a FlatParameters"), Error);
    CHECK(flat.grad.to_vector<float>() == once);  // nothing zeroed
    CHECK_THROWS_WITH_AS(net.first->bias.set_grad(Tensor()),
                         doctest::Contains("set_grad: f32[2] on cpu is a parameter in the flat buffers of a FlatParameters"),
                         Error);
    CHECK_THROWS_WITH_AS(net.first->bias.set_data(zeros({2})), doctest::Contains("set_data: f32[2] on cpu is a parameter"),
                         Error);
    CHECK_THROWS_WITH_AS(optim::FlatParameters(net.named_parameters(), DType::f32),
                         "FlatParameters: parameter 'first.weight' already lives in the flat buffers of a FlatParameters", Error);
    const std::string path = "/tmp/zg_test_owned_" + std::to_string(::getpid()) + ".safetensors";
    nn::save_state(net, path);
    CHECK_THROWS_WITH_AS(nn::load_state(net, path),
                         doctest::Contains("load_state: parameter 'first.weight' lives in the flat buffers of a FlatParameters, "
                                           "whose master weights would overwrite what is loaded"),
                         Error);
    std::remove(path.c_str());
  }
  // Once the FlatParameters is gone the parameters are the model's own again.
  net.zero_grad();
  CHECK_FALSE(net.first->weight.grad().defined());
  net.to(DType::f64);
  CHECK(net.first->weight.dtype() == DType::f64);
}

TEST_CASE("a write to a parameter that a bf16 update would overwrite from the master is refused, not lost") {
  OneParam module({0.5, -1.0, 2.0});
  optim::FlatParameters flat(module.named_parameters(), DType::bf16);
  optim::AdamW adamw(flat, {});
  optim::SGD sgd(flat, {});
  adamw.step(0.1);  // the optimizer's own writes are not the user's
  {
    NoGradGuard no_grad;
    module.p.narrow(1, 0, 1).fill_(1.0);  // through a view, too
  }
  // The update would have rewritten it from the f32 master: 0.5 - 0.1, not 1.
  const std::string refused = "the bf16 compute weights were written since the last update";
  CHECK_THROWS_WITH_AS(adamw.step(0.1), doctest::Contains(("AdamW::step: " + refused).c_str()), Error);
  CHECK_THROWS_WITH_AS(sgd.step(0.1), doctest::Contains(("SGD::step: " + refused).c_str()), Error);
  // The way that is kept: write the master, then refresh the compute copy.
  optim::FlatParameters::view_of(flat.master, flat.entries[0]).narrow(1, 0, 1).fill_(1.0);
  flat.sync_compute_from_master();
  adamw.step(0.0);
  sgd.step(0.0);
  CHECK(module.p.to(DType::f32).to_vector<float>()[0] == 1.0f);
  // With f32 compute the parameter is the master: a write there stays.
  OneParam f32({0.5, -1.0, 2.0});
  optim::FlatParameters f32_flat(f32.named_parameters(), DType::f32);
  optim::AdamW f32_adamw(f32_flat, {});
  {
    NoGradGuard no_grad;
    f32.p.fill_(1.0);
  }
  f32_adamw.step(0.0);
  CHECK(f32.p.to_vector<float>() == std::vector<float>{1, 1, 1});
}

TEST_CASE("AdamW, the grad scaler and FlatParameters refuse what they cannot use") {
  OneParam module({0.5, -1.0, 2.0});
  using optim::AdamWOptions;
  for (const auto& [options, message] :
       {std::pair{AdamWOptions{1.0, 0.999, 1e-8, 0.0}, "beta1 and beta2 must lie in [0, 1)"},
        std::pair{AdamWOptions{0.9, -0.1, 1e-8, 0.0}, "beta1 and beta2 must lie in [0, 1)"},
        std::pair{AdamWOptions{0.9, 0.999, 0.0, 0.0}, "eps must be positive"},
        std::pair{AdamWOptions{0.9, 0.999, 1e-8, -0.1}, "weight_decay must be >= 0"},
        std::pair{AdamWOptions{0.9, 0.999, 1e-8, std::nan("")}, "weight_decay must be >= 0"}}) {
    optim::FlatParameters flat(module.named_parameters(), DType::f32);
    CHECK_THROWS_WITH_AS(optim::AdamW(flat, options), doctest::Contains(message), Error);
  }
  optim::FlatParameters flat(module.named_parameters(), DType::f32);
  optim::AdamW adamw(flat);
  const std::vector<float> before = flat.master.to_vector<float>();
  CHECK_THROWS_WITH_AS(adamw.step(-1e-3), doctest::Contains("lr must be >= 0 and finite, got -0.001"), Error);
  CHECK_THROWS_WITH_AS(adamw.step(1e-3, std::numeric_limits<double>::infinity()),
                       doctest::Contains("grad_scale must be >= 0 and finite"), Error);
  CHECK(adamw.steps() == 0);  // a refused step is not counted
  CHECK(flat.master.to_vector<float>() == before);
  CHECK_THROWS_WITH_AS(adamw.set_steps(-1), doctest::Contains("set_steps needs a count of updates in [0, INT64_MAX), got -1"), Error);
  adamw.options.beta1 = 2;  // changed after construction: still refused at the update
  CHECK_THROWS_WITH_AS(adamw.step(1e-3), doctest::Contains("beta1 and beta2"), Error);

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

  // A non-leaf "parameter" never trained: its gradient went to what it was computed from.
  {
    const Tensor a = tensor<float>({1, 2}).set_requires_grad(true), c = tensor<float>({3}).set_requires_grad(true);
    CHECK_THROWS_WITH_AS(optim::FlatParameters(nn::NamedTensors{{"b", a * 2.0}}, DType::f32),
                         doctest::Contains("parameter 'b' is the output of mul, not a leaf"), Error);
    CHECK_THROWS_WITH_AS(optim::FlatParameters(nn::NamedTensors{{"a", a}, {"a", c}}, DType::f32),
                         doctest::Contains("two parameters are named 'a'"), Error);
    CHECK_THROWS_WITH_AS(optim::FlatParameters(nn::NamedTensors{{"u", Tensor()}, {"a", a}}, DType::f32),
                         doctest::Contains("FlatParameters: parameter 'u' is undefined"), Error);
  }
  // Packing: trainable floating parameters, each once, none sharing memory with another.
  const auto trainable = [](const Tensor& t) {
    Tensor p = t.detach();  // a leaf over the same memory
    p.set_requires_grad(true);
    return p;
  };
  const Tensor base = tensor<double>({1, 2, 3, 4}, {2, 2}), w = trainable(base);
  CHECK_THROWS_WITH_AS(optim::FlatParameters({{"w", w}, {"n", zeros({2}, DType::i64)}}, DType::f32),
                       doctest::Contains("FlatParameters: parameter 'n' is i64[2] on cpu; only floating"), Error);
  // A frozen one would be weight-decayed all the same (was: accepted).
  CHECK_THROWS_WITH_AS(optim::FlatParameters({{"w", w}, {"frozen", zeros({2})}}, DType::f32),
                       doctest::Contains("FlatParameters: parameter 'frozen' does not require grad (frozen)"), Error);
  {
    // Frozen once packed, it went on moving (weight decay, momentum): refused by name.
    const Tensor packed = trainable(base);
    optim::FlatParameters flat({{"packed", packed}}, DType::f32);
    CHECK_THROWS_WITH_AS(Tensor(packed).set_requires_grad(false),
                         doctest::Contains("is a parameter in the flat buffers of a FlatParameters, which trains every "
                                           "parameter it holds"),
                         Error);
    CHECK(packed.requires_grad());
  }
  CHECK_THROWS_WITH_AS(optim::FlatParameters({{"a", w}, {"b", w}}, DType::f32),
                       doctest::Contains("parameters 'a' and 'b' share memory"), Error);
  CHECK_THROWS_WITH_AS(optim::FlatParameters({{"a", w}, {"row", trainable(base.select(0, 1))}}, DType::f32),
                       doctest::Contains("parameters 'a' and 'row' share memory"), Error);
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
  optim::FlatParameters tied_flat(tied.named_parameters(), DType::f64);
  CHECK(tied_flat.numel() == 8);
  sum(tied.embedding * 2.0 + tied.head).backward();
  CHECK(tied.head.grad().to_vector<double>() == std::vector<double>(8, 3.0));
  // Two rows of one buffer that do not overlap pack fine (a model whose parameters are
  // already views into an earlier FlatParameters' buffer).
  optim::FlatParameters rows({{"r0", trainable(base.select(0, 0))}, {"r1", trainable(base.select(0, 1))}}, DType::f32);
  CHECK(rows.numel() == 4);
}

}  // namespace zg::test
