// Deferred initialisation: tensors and models built without memory, materialised
// whole or a slice at a time with exactly the values an eager build gives them.
#include <thread>

#include "helpers.h"
#include "nn/gpt.h"
#include "tensor/deferred.h"
#include "tiny_gpt.h"

namespace zg::test {

namespace {

using Factory = std::function<Tensor(const Shape&, TensorOptions)>;

std::vector<std::pair<const char*, Factory>> factories() {
  return {
      {"normal", [](const Shape& s, TensorOptions o) { return normal(s, 0.5, 0.02, o); }},
      {"randn", [](const Shape& s, TensorOptions o) { return randn(s, o); }},
      {"uniform", [](const Shape& s, TensorOptions o) { return uniform(s, -2.0, 3.0, o); }},
      {"rand", [](const Shape& s, TensorOptions o) { return rand(s, o); }},
      {"zeros", [](const Shape& s, TensorOptions o) { return zeros(s, o); }},
      {"ones", [](const Shape& s, TensorOptions o) { return ones(s, o); }},
      {"full", [](const Shape& s, TensorOptions o) { return full(s, 0.1, o); }},
  };
}

// A tensor made eagerly and its deferred twin, made from the same generator position
// (not at block 0, and after a draw that left a block partly used); the deferred one
// must move the generator as far.
std::pair<Tensor, Tensor> eager_and_deferred(const Factory& make, const Shape& shape, TensorOptions options) {
  Generator& generator = Context::current().generator();
  generator.manual_seed(7);
  rand({5});
  const uint64_t start = generator.offset();
  const Tensor eager = make(shape, options);
  const uint64_t end = generator.offset();
  generator.set_offset(start);
  Tensor deferred;
  {
    DeferredInit deferring;
    deferred = make(shape, options);
  }
  CHECK(generator.offset() == end);
  return {eager, deferred};
}

const std::string kDeferred =
    " is deferred (made under DeferredInit) and has no values yet; materialise it first (zg::materialize, "
    "materialize_range, or nn::materialize for a model)";

}  // namespace

TEST_CASE("deferred factories allocate nothing and keep the shape, dtype and device asked for") {
  Context rank;
  ContextGuard guard(rank);
  for (const Device device : {kCPU, kMeta}) {
    DeferredInit deferring;
    const TensorOptions options = TensorOptions(DType::bf16).device(device);
    std::vector<Tensor> made{empty({3, 5}, options), full({3, 5}, 2.0, options)};
    for (const auto& [name, make] : factories()) made.push_back(make({3, 5}, options));
    const Tensor like = made.back();
    for (const Tensor& t : {empty_like(like), zeros_like(like), ones_like(like), full_like(like, 3.0)})
      made.push_back(t);
    for (const Tensor& t : made) {
      CHECK(is_deferred(t));
      CHECK(t.shape() == Shape{3, 5});
      CHECK(t.dtype() == DType::bf16);
      CHECK(t.device() == device);
    }
    // 7.5B parameters' worth, deferred: nothing allocated anywhere.
    const Tensor huge = normal({7'500'000'000}, 0.0, 0.02, TensorOptions(DType::f32).device(device));
    CHECK(huge.nbytes() == 30'000'000'000);
  }
  for (const Device device : {kCPU, kMeta}) {
    CHECK(memory_stats(device).peak_total == 0);
    CHECK(memory_stats(device).reserved == 0);
  }
  CHECK(!is_deferred(zeros({2})));  // the scope ended
}

TEST_CASE("DeferredInit is per thread and nests") {
  DeferredInit outer;
  {
    DeferredInit inner;
    CHECK(DeferredInit::is_active());
  }
  CHECK(DeferredInit::is_active());
  CHECK(is_deferred(zeros({2})));
  bool other_thread_deferred = true;
  std::thread([&] { other_thread_deferred = DeferredInit::is_active() || is_deferred(zeros({2})); }).join();
  CHECK(!other_thread_deferred);
}

TEST_CASE("materialize_range gives the eager tensor's values bit for bit, from any element") {
  for (const Device device : devices()) {
    for (const DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      for (const auto& [name, make] : factories()) {
        const std::string factory = name;  // INFO's lambda cannot capture a structured binding (Clang)
        INFO(device.str() << " " << zg::name(dtype) << " " << factory);
        const TensorOptions options = TensorOptions(dtype).device(device);
        const auto [eager, deferred] = eager_and_deferred(make, {7, 9}, options);  // 63 elements: 15 blocks and 3
        const Tensor flat = eager.flatten();
        check_identical(materialize(deferred), eager, "whole");
        for (int64_t begin = 0; begin <= 12; ++begin) {
          for (const int64_t length : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5},
                                       int64_t{7}, int64_t{8}, int64_t{13}, 63 - begin}) {
            const Tensor out = empty({length}, options);
            materialize_range(deferred, begin, out);
            check_identical(out, flat.narrow(0, begin, length), "[" + std::to_string(begin) + ", +" +
                                                                     std::to_string(length) + ")");
          }
        }
        const Tensor tail = empty({2}, options), block = empty({3, 4}, options);  // any shape: flat order
        materialize_range(deferred, 61, tail);
        check_identical(tail, flat.narrow(0, 61, 2), "the last two");
        materialize_range(deferred, 5, block);
        check_identical(block, flat.narrow(0, 5, 12).view({3, 4}), "into a [3, 4]");
      }
    }
  }
}

TEST_CASE("a long slice that starts mid-block is the eager tensor's, on every device") {
  for (const Device device : devices()) {
    const auto [eager, deferred] = eager_and_deferred(factories()[0].second, {100003}, TensorOptions().device(device));
    const Tensor out = empty({90001}, TensorOptions().device(device));
    materialize_range(deferred, 4099, out);
    check_identical(out, eager.narrow(0, 4099, 90001), device.str());
  }
}

TEST_CASE("materialize_range writes the tensor's own values converted to the output's dtype") {
  for (const Device device : devices()) {
    for (const auto& [name, make] : factories()) {
      for (const auto& [own, into] : std::vector<std::pair<DType, DType>>{
               {DType::bf16, DType::f32}, {DType::f32, DType::bf16}, {DType::f16, DType::f64}, {DType::f64, DType::f16}}) {
        const std::string what = std::string(name) + " " + zg::name(own) + " into " + zg::name(into);  // INFO cannot capture bindings (Clang)
        INFO(device.str() << " " << what);
        const auto [eager, deferred] = eager_and_deferred(make, {23}, TensorOptions(own).device(device));
        const Tensor out = empty({17}, TensorOptions(into).device(device));
        materialize_range(deferred, 3, out);
        check_identical(out, eager.narrow(0, 3, 17).to(into), "a bf16 master holds the bf16 values");
      }
    }
  }
}

TEST_CASE("a contiguous view of a deferred tensor materialises its part") {
  const auto [eager, deferred] = eager_and_deferred(factories()[0].second, {6, 5}, {});
  const Tensor rows = deferred.narrow(0, 2, 3);  // elements 10 to 25
  CHECK(is_deferred(rows));
  check_identical(materialize(rows), eager.narrow(0, 2, 3), "rows 2 to 4");
  const Tensor out = empty({5});
  materialize_range(rows, 3, out);
  check_identical(out, eager.narrow(0, 2, 3).flatten().narrow(0, 3, 5), "part of them");
}

TEST_CASE("a deferred GPT costs no memory and materialises into the eager one") {
  Context rank;
  ContextGuard guard(rank);
  const nn::GPTConfig config = tiny_config();
  manual_seed(1);
  std::shared_ptr<nn::GPT> model;
  {
    DeferredInit deferring;
    model = std::make_shared<nn::GPT>(config);
  }
  const uint64_t offset = rank.generator().offset();
  CHECK(memory_stats(kCPU).peak_total == 0);
  std::vector<const TensorImpl*> handles;
  for (const auto& [name, p] : model->named_parameters()) {
    CHECK(is_deferred(p));
    CHECK(p.requires_grad());
    handles.push_back(&p.impl());
  }

  nn::materialize(*model);
  manual_seed(1);
  nn::GPT eager(config);
  CHECK(rank.generator().offset() == offset);
  const nn::NamedTensors got = model->named_parameters(), want = eager.named_parameters();
  REQUIRE(got.size() == want.size());
  int64_t bytes = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& [name, p] = got[i];
    CHECK(name == want[i].first);
    CHECK(!is_deferred(p));
    CHECK(&p.impl() == handles[i]);  // the same parameter objects, now with values
    CHECK(p.requires_grad());
    CHECK(p.storage()->category() == MemoryCategory::parameter);
    check_identical(p, want[i].second, name);
    bytes += p.nbytes();
  }
  CHECK(memory_stats(kCPU)[MemoryCategory::parameter] == 2 * bytes);  // this model's and the eager one's
  const Sequence s = fixed_sequence();
  CHECK(model->forward(s.inputs, s.targets).loss.item<float>() == eager.forward(s.inputs, s.targets).loss.item<float>());
}

TEST_CASE("a 7.5B-parameter GPT built deferred takes no memory, on the CPU or on meta") {
  Context rank;
  ContextGuard guard(rank);
  nn::GPTConfig config;
  config.n_layer = 36, config.n_head = 32, config.n_embd = 4096, config.vocab_size = 50304, config.block_size = 2048;
  for (const Device device : {kCPU, kMeta}) {
    DeferredInit deferring;
    const nn::GPT model(config, TensorOptions(DType::bf16).device(device));
    CHECK(model.num_parameters() > 7'400'000'000);
    CHECK(memory_stats(device).peak_total == 0);
  }
}

TEST_CASE("a deferred model on meta materialises slices into real buffers, as one-rank eager values") {
  const nn::GPTConfig config = tiny_config();
  manual_seed(3);
  std::shared_ptr<nn::GPT> model;
  {
    DeferredInit deferring;
    model = std::make_shared<nn::GPT>(config, kMeta);
  }
  manual_seed(3);
  const nn::GPT eager(config);
  const nn::NamedTensors got = model->named_parameters(), want = eager.named_parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    // Four "ranks", each taking its quarter (rounded up) of every parameter.
    const int64_t n = want[i].second.numel(), shard = (n + 3) / 4;
    for (int64_t begin = 0; begin < n; begin += shard) {
      const Tensor out = empty({std::min(shard, n - begin)});
      materialize_range(got[i].second, begin, out);
      check_identical(out, want[i].second.flatten().narrow(0, begin, out.numel()), got[i].first);
    }
  }
}

TEST_CASE("Module::to keeps a deferred model deferred, with the eager conversion's values") {
  const nn::GPTConfig config = tiny_config();
  manual_seed(5);
  nn::GPT eager(config);
  eager.to(DType::bf16);
  manual_seed(5);
  std::shared_ptr<nn::GPT> model;
  {
    DeferredInit deferring;
    model = std::make_shared<nn::GPT>(config);
  }
  model->to(DType::bf16);
  model->to(kMeta);
  for (const auto& [name, p] : model->named_parameters()) {
    CHECK(is_deferred(p));
    CHECK(p.dtype() == DType::bf16);
    CHECK(p.device() == kMeta);
  }
  CHECK_THROWS_WITH_AS(model->to(DType::f16), doctest::Contains("was made in f32 and converted once already"), Error);
  model->to(kCPU);
  nn::materialize(*model);
  const nn::NamedTensors got = model->named_parameters(), want = eager.named_parameters();
  for (size_t i = 0; i < got.size(); ++i) check_identical(got[i].second, want[i].second, got[i].first);
}

TEST_CASE("nn::materialize keeps tied weights tied and fills buffers") {
  struct Tied : nn::Module {
    std::shared_ptr<nn::Linear> a;
    std::shared_ptr<nn::Module> b;
    Tensor scale;
    Tied() {
      a = register_module("a", std::make_shared<nn::Linear>(4, 6, true, 0.02));
      b = register_module("b", std::make_shared<nn::Module>());
      b->register_parameter("weight", a->weight);
      scale = register_buffer("scale", full({2}, 0.5));
    }
  };
  std::shared_ptr<Tied> m;
  {
    DeferredInit deferring;
    m = std::make_shared<Tied>();
  }
  REQUIRE(m->named_parameters(false).size() == 3);
  CHECK(m->named_parameters(false)[2].second.is_same(m->a->weight));
  nn::materialize(*m);
  const Tensor tied = m->named_parameters(false)[2].second;
  CHECK(tied.is_same(m->a->weight));
  CHECK(!is_deferred(tied));
  CHECK(tied.storage() == m->a->weight.storage());
  CHECK(!is_deferred(m->scale));
  CHECK(m->scale.to_vector<float>() == std::vector<float>{0.5f, 0.5f});
}

TEST_CASE("materialize makes a whole tensor in the current memory category") {
  Context rank;
  ContextGuard guard(rank);
  Tensor d;
  {
    DeferredInit deferring;
    d = randn({3, 4});
  }
  MemoryScope scope(MemoryCategory::optimizer_state);
  const Tensor t = materialize(d);
  CHECK(memory_stats()[MemoryCategory::optimizer_state] == 48);
  CHECK(is_deferred(d));  // materialize() leaves the deferred tensor as it was
}

TEST_CASE("ops on a deferred tensor throw, naming the op and the tensor") {
  Tensor d, one;
  {
    DeferredInit deferring;
    d = randn({3, 4});
    one = zeros({});
  }
  const Tensor real = zeros({3, 4});
  const auto deferred = [](const std::string& op, const std::string& tensor = "f32[3, 4] on cpu") {
    return op + ": " + tensor + kDeferred;
  };
  CHECK_THROWS_WITH_AS(d + real, deferred("add").c_str(), Error);
  CHECK_THROWS_WITH_AS(real * d, deferred("mul").c_str(), Error);
  CHECK_THROWS_WITH_AS(d * 2.0, deferred("mul").c_str(), Error);
  CHECK_THROWS_WITH_AS(exp(d), deferred("exp").c_str(), Error);
  CHECK_THROWS_WITH_AS(matmul(d, real.t()), deferred("matmul").c_str(), Error);
  CHECK_THROWS_WITH_AS(sum(d), deferred("sum").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.to_vector<float>(), deferred("to_vector").c_str(), Error);
  CHECK_THROWS_WITH_AS(one.item<float>(), deferred("item", "f32[] on cpu").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.to(DType::f64), deferred("to_dtype").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.to(kMeta), deferred("to_device").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.clone(), deferred("clone").c_str(), Error);
  CHECK_THROWS_WITH_AS(Tensor(real).copy_(d), deferred("copy_").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.copy_(real), deferred("copy_").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.fill_(1.0), deferred("fill_").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.add_(real), deferred("add_").c_str(), Error);
  CHECK_THROWS_WITH_AS(d.mul_(2.0), deferred("mul_").c_str(), Error);
  // Below the op front-ends, the storage refuses too.
  CHECK_THROWS_WITH_AS(d.data_ptr(), doctest::Contains("storage: the 48 B storage on cpu is deferred"), Error);
  CHECK_THROWS_WITH_AS(d.storage()->materialize(), doctest::Contains("materialised through its tensor"), Error);
  CHECK(d.str() == "tensor(..., size=(3, 4), deferred)");
}

TEST_CASE("materialize_range refuses what it cannot write") {
  Tensor d, d2;
  {
    DeferredInit deferring;
    d = randn({3, 4});
    d2 = zeros({12});
    CHECK_THROWS_WITH_AS(full({2}, 1e6, DType::f16), "full: the value 1e+06 does not fit f16", Error);
  }
  const char* op = "materialize_range: ";
  CHECK_THROWS_WITH_AS(materialize_range(d, 10, empty({3})),
                       (op + std::string("the 3 elements from element 10 are out of range for f32[3, 4] on cpu (12 "
                                         "elements)")).c_str(), Error);
  CHECK_THROWS_WITH_AS(materialize_range(d, -1, empty({3})), doctest::Contains("out of range"), Error);
  CHECK_THROWS_WITH_AS(materialize_range(d, 0, d2),
                       (op + std::string("the output must hold values, got the deferred f32[12] on cpu")).c_str(), Error);
  CHECK_THROWS_WITH_AS(materialize_range(d, 0, empty({4, 3}).t()),
                       (op + std::string("the output f32[3, 4] on cpu is not contiguous")).c_str(), Error);
  CHECK_THROWS_WITH_AS(materialize_range(d, 0, empty({12}, DType::i64)),
                       (op + std::string("cannot write the values of f32[3, 4] on cpu into i64[12] on cpu (its dtype, "
                                         "or for a floating tensor any floating dtype)")).c_str(), Error);
  CHECK_THROWS_WITH_AS(materialize_range(zeros({3, 4}), 0, empty({12})),
                       (op + std::string("expected a deferred tensor, got f32[3, 4] on cpu, which has its values "
                                         "already")).c_str(), Error);
  CHECK_THROWS_WITH_AS(materialize(d.t()),
                       "materialize: the deferred f32[4, 3] on cpu is a view that is not contiguous; materialise the "
                       "tensor it views", Error);
}

}  // namespace zg::test
