// Philox-4x32-10: the published known-answer vectors, and the properties the
// tensor API promises (same seed, same numbers, however calls split or threads share a context).
#include "autograd/graph.h"
#include "helpers.h"
#include "nn/checkpoint.h"
#include "tensor/philox.h"

#include <algorithm>
#include <thread>

namespace zg::test {

TEST_CASE("philox4x32_10 matches the Random123 known-answer vectors") {
  // kat_vectors of Random123 (Salmon et al.): counter, key -> output.
  struct Kat {
    philox::U32x4 counter;
    uint32_t key0, key1;
    philox::U32x4 expected;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const Kat& k : kats) {
    const philox::U32x4 out = philox::philox4x32_10(k.counter, k.key0, k.key1);
    for (int i = 0; i < 4; ++i) CHECK(out.v[i] == k.expected.v[i]);
  }
}

TEST_CASE("seed 0 gives the uniforms and normals derived from the first known-answer vector") {
  // Seed 0, block 0 is counter (0,0,0,0) under key (0,0): the first vector above.
  const uint32_t bits[4] = {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8};
  manual_seed(0);
  const std::vector<float> u = rand({4}).to_vector<float>();
  for (int i = 0; i < 4; ++i) CHECK(u[i] == static_cast<float>(bits[i] >> 8) / 16777216.0f);
  CHECK(u[0] == doctest::Approx(0.39904).epsilon(1e-4));

  manual_seed(0);
  const std::vector<double> z = randn({4}, DType::f64).to_vector<double>();
  for (int pair = 0; pair < 2; ++pair) {
    const double r = std::sqrt(-2.0 * std::log(((bits[2 * pair] >> 8) + 1.0) / 16777216.0));
    const double theta = 2 * M_PI * (bits[2 * pair + 1] >> 8) / 16777216.0;
    CHECK(z[2 * pair] == doctest::Approx(r * std::cos(theta)).epsilon(1e-15));
    CHECK(z[2 * pair + 1] == doctest::Approx(r * std::sin(theta)).epsilon(1e-15));
  }
}

TEST_CASE("same seed, same numbers; the sequence does not depend on how it is split") {
  manual_seed(42);
  const Tensor a = randn({3, 5});
  manual_seed(42);
  const Tensor b = randn({3, 5});
  CHECK(a.to_vector<float>() == b.to_vector<float>());

  manual_seed(7);
  const auto first = rand({8}).to_vector<float>();
  const auto second = rand({4}).to_vector<float>();
  manual_seed(7);
  const auto whole = rand({12}).to_vector<float>();
  CHECK(std::equal(first.begin(), first.end(), whole.begin()));
  CHECK(std::equal(second.begin(), second.end(), whole.begin() + 8));

  // The draw is the same in every dtype, before rounding to it.
  manual_seed(3);
  const auto in_f32 = rand({6}).to_vector<double>();
  manual_seed(3);
  CHECK(rand({6}, DType::f64).to_vector<double>() == in_f32);
  manual_seed(3);
  const auto in_bf16 = rand({6}, DType::bf16).to_vector<float>();
  for (int i = 0; i < 6; ++i) CHECK(in_bf16[i] == static_cast<float>(BFloat16(static_cast<float>(in_f32[i]))));

  // Different seeds differ; generators of two rank contexts are independent.
  manual_seed(1);
  const auto s1 = rand({4}).to_vector<float>();
  manual_seed(2);
  CHECK(rand({4}).to_vector<float>() != s1);
}

TEST_CASE("distributions have the right range and moments") {
  manual_seed(11);
  const Tensor u = uniform({100000}, 2.0, 5.0, DType::f64);
  CHECK(min(u).item<double>() >= 2.0);
  CHECK(max(u).item<double>() < 5.0);
  CHECK(mean(u).item<double>() == doctest::Approx(3.5).epsilon(0.005));
  const Tensor z = normal({100000}, 1.0, 2.0, DType::f64);
  const double m = mean(z).item<double>();
  const double var = mean(pow(z - m, 2.0)).item<double>();
  CHECK(m == doctest::Approx(1.0).epsilon(0.02));
  CHECK(std::sqrt(var) == doctest::Approx(2.0).epsilon(0.01));
  CHECK_THROWS_WITH_AS(randn({2}, DType::i64), "normal: expected a floating-point dtype, got i64", Error);
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("threads sharing a context never draw the same counter blocks") {
  Context shared;
  shared.generator().manual_seed(9);
  constexpr int kThreads = 4, kDraws = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      ContextGuard guard(shared);
      for (int i = 0; i < kDraws; ++i) Generator::current().reserve(5);  // 2 blocks each
    });
  for (std::thread& t : threads) t.join();
  CHECK(shared.generator().offset() == uint64_t(kThreads) * kDraws * 2);  // none lost to a race
}

TEST_CASE("an activation-checkpoint replay draws from its own copy, even when it throws") {
  manual_seed(11);
  const Tensor x = ones({8}).set_requires_grad(true);
  bool fail_replay = false;
  std::vector<float> forward_noise, replay_noise;
  const Tensor out = nn::checkpoint(
      [&](const std::vector<Tensor>& in) {
        ZG_CHECK(!(backward_in_progress() && fail_replay), "replay failed");
        const Tensor noise = rand({8});
        (backward_in_progress() ? replay_noise : forward_noise) = noise.to_vector<float>();
        return in[0] * noise;
      },
      {x});
  const uint64_t offset = Context::current().generator().offset();
  sum(out).backward(Tensor(), /*retain_graph=*/true);
  CHECK(replay_noise == forward_noise);  // the forward's numbers again
  CHECK(Context::current().generator().offset() == offset);
  fail_replay = true;
  // A function that returns its input as it is: the caller's tensor stays a leaf.
  const Tensor same = nn::checkpoint([](const std::vector<Tensor>& in) { return in[0]; }, {x});
  CHECK((x.is_leaf() && !same.is_leaf()));
  CHECK_THROWS_WITH_AS(nn::checkpoint([](const std::vector<Tensor>&) { return Tensor(); }, {x}),
                       "checkpoint: the function returned an undefined tensor", Error);
  CHECK_THROWS_WITH_AS(sum(out).backward(), doctest::Contains("replay failed"), Error);
  CHECK(Context::current().generator().offset() == offset);  // was left rewound to the forward's
}

TEST_CASE("uniform draws stay below the upper bound in every dtype, on every device") {
  // Rounded to bf16 or f16, a draw just below 1 became 1 itself (about one in 512 for bf16).
  for (const Device device : devices()) {
    for (const DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      INFO(device.str() << " " << std::string(name(dtype)));
      manual_seed(3);
      const Tensor u = rand({1 << 16}, TensorOptions(dtype).device(device)).to(DType::f64);
      CHECK(max(u).item<double>() < 1.0);
      CHECK(min(u).item<double>() >= 0.0);
      const Tensor v = uniform({1 << 16}, -1.0, 1.0, TensorOptions(dtype).device(device)).to(DType::f64);
      CHECK(max(v).item<double>() < 1.0);
    }
  }
}

TEST_CASE("randint draws every integer of [low, high) and nothing else, reproducibly, on every device") {
  for (const Device device : devices()) {
    INFO(device.str());
    manual_seed(5);
    const Tensor r = randint(-3, 4, {4000}, TensorOptions(DType::i64).device(device));
    CHECK(r.dtype() == DType::i64);
    const std::vector<int64_t> v = r.to_vector<int64_t>();
    for (int64_t k = -3; k < 4; ++k) {
      const auto hits = std::count(v.begin(), v.end(), k);
      CHECK(hits > 450);  // 4000 / 7 = 571 expected
      CHECK(hits < 700);
    }
    CHECK(*std::min_element(v.begin(), v.end()) == -3);
    CHECK(*std::max_element(v.begin(), v.end()) == 3);
    manual_seed(5);
    CHECK(randint(-3, 4, {4000}, TensorOptions(DType::i64).device(device)).to_vector<int64_t>() == v);
    const Tensor wide = randint(0, int64_t{1} << 24, {1000}, TensorOptions(DType::i32).device(device));
    CHECK(wide.dtype() == DType::i32);
    CHECK(max(wide).item<int32_t>() < (1 << 24));
    CHECK(randint(0, 10, {2, 3}, TensorOptions(DType::f32).device(device)).dtype() == DType::f32);
  }
  CHECK(randint(0, 5, {8, 2}, TensorOptions(DType::i64).device(kMeta)).shape() == Shape{8, 2});
  CHECK_THROWS_WITH_AS(randint(3, 3, {2}), "randint: expected low < high with high - low <= 2^24, got low 3 and high 3",
                       Error);
  CHECK_THROWS_AS(randint(0, (int64_t{1} << 24) + 1, {2}), Error);
  CHECK_THROWS_WITH_AS(randint(0, 300, {2}, DType::boolean), "randint: the values from 0 to 299 do not fit bool", Error);
}

TEST_CASE("rand_like and randn_like take the shape, dtype and device of their model") {
  manual_seed(2);
  const Tensor model = zeros({3, 5}, DType::bf16);
  const Tensor u = rand_like(model), z = randn_like(model);
  CHECK(u.shape() == model.shape());
  CHECK(u.dtype() == DType::bf16);
  CHECK(z.dtype() == DType::bf16);
  CHECK(max(u.to(DType::f64)).item<double>() < 1.0);
  CHECK(rand_like(empty({2}, TensorOptions(DType::f32).device(kMeta))).device() == kMeta);
  CHECK_THROWS_WITH_AS(rand_like(zeros({2}, DType::i64)), "uniform: expected a floating-point dtype, got i64", Error);
}

}  // namespace zg::test
