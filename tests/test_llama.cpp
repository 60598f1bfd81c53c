// Llama-family layers and model: Hugging Face names, grouped-query shapes, it trains, and
// ZeRO-3 over its own unit plan trains it like one rank; Sequential and nn::init; generation
// with a KV cache for GPT and Llama.
#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "helpers.h"
#include "nn/generate.h"
#include "nn/init.h"
#include "nn/llama.h"

namespace zg::test {

namespace {

nn::LlamaConfig tiny_llama() {
  nn::LlamaConfig c;
  c.n_layer = 2, c.n_head = 4, c.n_kv_head = 2, c.n_embd = 32, c.vocab_size = 64, c.block_size = 32;
  return c;
}

// Batch s of 4 x 16 tokens: rows counting up by 3 (mod 64) from starts that vary with s, a
// pattern the model can learn, and the next-token targets.
std::pair<Tensor, Tensor> llama_batch(int s) {
  std::vector<int64_t> ids;
  for (int64_t row = 0; row < 4; ++row)
    for (int64_t t = 0; t < 17; ++t) ids.push_back((5 * s + 11 * row + 3 * t) % 64);
  const Tensor tokens = tensor<int64_t>(ids, {4, 17});
  return {tokens.narrow(1, 0, 16).contiguous(), tokens.narrow(1, 1, 16).contiguous()};
}

}  // namespace

TEST_CASE("Llama parameters carry Hugging Face names and grouped-query shapes") {
  manual_seed(0);
  nn::Llama model(tiny_llama());
  const nn::NamedTensors params = model.named_parameters();
  std::vector<std::string> names;
  for (const auto& [name, _] : params) names.push_back(name);
  const std::vector<std::string> first = {"model.embed_tokens.weight",
                                          "model.layers.0.input_layernorm.weight",
                                          "model.layers.0.self_attn.q_proj.weight",
                                          "model.layers.0.self_attn.k_proj.weight",
                                          "model.layers.0.self_attn.v_proj.weight",
                                          "model.layers.0.self_attn.o_proj.weight",
                                          "model.layers.0.post_attention_layernorm.weight",
                                          "model.layers.0.mlp.gate_proj.weight",
                                          "model.layers.0.mlp.up_proj.weight",
                                          "model.layers.0.mlp.down_proj.weight"};
  REQUIRE(names.size() == 1 + 2 * 9 + 2);
  CHECK(std::vector<std::string>(names.begin(), names.begin() + 10) == first);
  CHECK(names[names.size() - 2] == "model.norm.weight");
  CHECK(names.back() == "lm_head.weight");
  CHECK(model.layers->at<nn::LlamaBlock>(0).self_attn->k_proj->weight.shape() == Shape{16, 32});  // 2 kv heads of 8
  CHECK(nn::intermediate_size(tiny_llama()) == 128);  // 8/3 * 32 = 85.3, rounded up to 64s
  nn::LlamaConfig tied = tiny_llama();
  tied.tie_embeddings = true;
  CHECK(nn::Llama(tied).named_parameters().size() == names.size() - 1);
  CHECK(model.num_parameters() == 64 * 32 * 2 + 32 + 2 * (32 + 32 * 32 * 2 + 16 * 32 * 2 + 32 + 3 * 128 * 32));
}

TEST_CASE("a Llama trains: the loss falls well below its start") {
  manual_seed(0);
  nn::Llama model(tiny_llama());
  dist::SingleRank one;
  dist::ShardedModel trainer(model, one, {.compute_dtype = DType::f32});
  double first = 0, last = 0;
  for (int s = 0; s < 60; ++s) {
    const auto [x, y] = llama_batch(s % 4);
    trainer.zero_grad();
    const Tensor loss = model.forward(x, y).loss;
    loss.backward();
    trainer.step(3e-3);
    (s == 0 ? first : last) = loss.item<double>();
  }
  CHECK(first > 3.5);  // about log(64) = 4.16 at the start
  CHECK(last < 0.5 * first);
}

TEST_CASE("a Llama under ZeRO-3 at N = 4 trains like one rank (its own unit plan)") {
  const auto train = [](dist::ProcessGroup& pg, int stage) {
    manual_seed(1);
    nn::Llama model(tiny_llama());
    dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f32});
    const int64_t rows = 4 / pg.size();
    for (int s = 0; s < 4; ++s) {
      const auto [x, y] = llama_batch(s);
      sharded.zero_grad();
      model.forward(x.narrow(0, pg.rank() * rows, rows), y.narrow(0, pg.rank() * rows, rows)).loss.backward();
      sharded.step(1e-3);
    }
    nn::NamedTensors out;
    for (const auto& [name, t] : sharded.gathered_master()) out.emplace_back(name, t.clone());
    return out;
  };
  nn::NamedTensors reference;
  {
    Context rank;
    ContextGuard guard(rank);
    dist::SingleRank one;
    reference = train(one, 0);
  }
  nn::NamedTensors sharded;
  dist::run_local(4, [&](dist::ProcessGroup& pg) {
    nn::NamedTensors mine = train(pg, 3);
    if (pg.rank() == 3) sharded = std::move(mine);
  });
  REQUIRE(sharded.size() == reference.size());
  for (size_t i = 0; i < reference.size(); ++i) {
    INFO(reference[i].first);
    CHECK(sharded[i].first == reference[i].first);
    CHECK(max(abs(sharded[i].second - reference[i].second)).item<double>() < 1e-5);
  }
}

TEST_CASE("bad Llama configs and inputs are clear errors") {
  nn::LlamaConfig c = tiny_llama();
  c.n_kv_head = 3;
  CHECK_THROWS_WITH_AS(nn::Llama{c}, "Llama: n_kv_head 3 must divide n_head 4", Error);
  c = tiny_llama();
  c.n_embd = 36;  // head size 9: odd
  CHECK_THROWS_WITH_AS(nn::Llama{c}, doctest::Contains("even head size"), Error);
  nn::Llama model(tiny_llama());
  CHECK_THROWS_WITH_AS(model.forward(zeros({1, 33}, DType::i64), Tensor()),
                       "Llama: sequence of 33 tokens is longer than block_size 32", Error);
}

TEST_CASE("Sequential calls its modules in turn, named 0, 1, ..., hooks included") {
  manual_seed(0);
  auto first = std::make_shared<nn::Linear>(3, 5);
  auto second = std::make_shared<nn::Linear>(5, 2);
  nn::Sequential net{first, std::make_shared<nn::SiLU>(), second};
  CHECK(net.named_parameters().front().first == "0.weight");
  CHECK(net.named_parameters().back().first == "2.bias");
  int calls = 0;
  second->register_forward_pre_hook([&](nn::Module&, const Tensor&) { ++calls; return Tensor(); });
  const Tensor x = randn({4, 3});
  const Tensor want = linear(silu(linear(x, first->weight, first->bias)), second->weight, second->bias);
  CHECK(max(abs(net(x) - want)).item<double>() == 0.0);
  CHECK(calls == 1);
}

TEST_CASE("nn::init fills in place with the fans' scale; PyTorch's Linear default is there") {
  manual_seed(0);
  nn::Linear layer(400, 300);
  nn::init::linear_default_(layer);
  const double bound = 1.0 / std::sqrt(400.0);
  CHECK(max(abs(layer.weight)).item<double>() <= bound);
  CHECK(max(abs(layer.weight)).item<double>() > 0.99 * bound);
  CHECK(max(abs(layer.bias)).item<double>() <= bound);
  nn::init::xavier_normal_(layer.weight);
  CHECK(std(layer.weight).item<double>() == doctest::Approx(std::sqrt(2.0 / 700.0)).epsilon(0.02));
  nn::init::kaiming_normal_(layer.weight, 0.0, nn::init::Fan::out);
  CHECK(std(layer.weight).item<double>() == doctest::Approx(std::sqrt(2.0 / 300.0)).epsilon(0.02));
  nn::init::kaiming_uniform_(layer.weight);
  CHECK(max(abs(layer.weight)).item<double>() <= std::sqrt(6.0 / 400.0));
  nn::init::zeros_(layer.bias);
  CHECK(max(abs(layer.bias)).item<double>() == 0.0);
  CHECK(layer.weight.requires_grad());
  CHECK_THROWS_WITH_AS(nn::init::xavier_uniform_(layer.bias), doctest::Contains("fans need a tensor of rank >= 2"), Error);
}

TEST_CASE("attention dropout drops probabilities as its definition says; eval and p = 0 are the fused op") {
  for (const Device device : devices()) {  // (random: outside the every-op table, on every backend here)
    INFO("on " << device.str());
    const TensorOptions options = TensorOptions(DType::f32).device(device);
    manual_seed(0);
    const Tensor q = randn({2, 3, 5, 4}, options), k = randn({2, 3, 5, 4}, options), v = randn({2, 3, 5, 4}, options);
    const Tensor fused = scaled_dot_product_attention(q, k, v, true);
    CHECK(max(abs(scaled_dot_product_attention(q, k, v, true, 0.5, false) - fused)).item<double>() == 0.0);
    CHECK(max(abs(scaled_dot_product_attention(q, k, v, true, 0.0) - fused)).item<double>() == 0.0);
    manual_seed(9);
    const Tensor dropped = scaled_dot_product_attention(q, k, v, true, 0.4);
    manual_seed(9);
    const Tensor keep = lt(rand({2, 3, 5, 5}, options), 0.6).to(DType::f32);
    const Tensor mask = gt(triu(ones({5, 5}, options), 1), 0.0);
    const Tensor scores = masked_fill(matmul(q, k, false, true) * 0.5, mask, -INFINITY);
    const Tensor want = matmul(softmax(scores) * keep * (1 / 0.6), v);
    CHECK(max(abs(dropped - want)).item<double>() < 1e-5);
    CHECK(max(abs(dropped - fused)).item<double>() > 1e-3);
    CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q, k, v, true, 1.0),
                         doctest::Contains("dropout_p must be in [0, 1)"), Error);
  }
}

TEST_CASE("GPTConfig.dropout drops attention probabilities too: training differs from eval, eval is the plain model") {
  nn::GPTConfig c;
  c.n_layer = 1, c.n_head = 2, c.n_embd = 16, c.vocab_size = 32, c.block_size = 8, c.dropout = 0.2;
  manual_seed(0);
  nn::GPT with(c);
  c.dropout = 0;
  manual_seed(0);
  nn::GPT without(c);
  const Tensor ids = tensor<int64_t>({1, 2, 3, 4, 5, 6, 7, 8}, {1, 8});
  with.eval();
  without.eval();
  CHECK(max(abs(with.forward(ids, Tensor()).logits - without.forward(ids, Tensor()).logits)).item<double>() == 0.0);
  // The attention alone, its residual dropout off: training still drops (its probabilities).
  nn::CausalSelfAttention& attn = *with.h->at<nn::Block>(0).attn;
  attn.resid_dropout->p = 0;
  const Tensor h = randn({1, 8, 16});
  const Tensor evaluated = attn(h);
  attn.train();
  CHECK(attn.attn_dropout == 0.2);
  CHECK(max(abs(attn(h) - evaluated)).item<double>() > 1e-4);
}

TEST_CASE("multinomial draws in proportion, distinct without replacement, reproducibly; sort and topk edge cases") {
  for (const Device device : devices()) {  // (random: outside the every-op table, on every backend here)
    INFO("on " << device.str());
    manual_seed(4);
    const Tensor weights = tensor<double>({6.0, 3.0, 1.0, 0.0}, {4}).to(device);  // unnormalised; 3 never drawn
    const Tensor many = multinomial(weights.unsqueeze(0).expand({3000, 4}).contiguous(), 1, true);
    CHECK(many.shape() == Shape{3000, 1});
    CHECK(sum(eq(many, 0.0)).item<int64_t>() / 3000.0 == doctest::Approx(0.6).epsilon(0.06));
    CHECK(sum(eq(many, 2.0)).item<int64_t>() / 3000.0 == doctest::Approx(0.1).epsilon(0.2));
    CHECK(sum(eq(many, 3.0)).item<int64_t>() == 0);
    const Tensor three = multinomial(weights.unsqueeze(0).expand({500, 4}).contiguous(), 3);
    CHECK(max(three).item<int64_t>() == 2);  // the three of positive weight, each once
    CHECK(sum(three, {1}).to(kCPU).to_vector<int64_t>() == std::vector<int64_t>(500, 3));
    // Without replacement the first draw is still p-distributed (Gumbel-top-k).
    CHECK(sum(eq(three.select(1, 0), 0.0)).item<int64_t>() / 500.0 == doctest::Approx(0.6).epsilon(0.15));
    manual_seed(5);
    const std::vector<int64_t> a = multinomial(weights, 2).to(kCPU).to_vector<int64_t>();
    manual_seed(5);
    CHECK(multinomial(weights, 2).to(kCPU).to_vector<int64_t>() == a);
    CHECK_THROWS_WITH_AS(multinomial(weights, 4), doctest::Contains("a row has 3 categories of positive weight"), Error);
    CHECK_THROWS_WITH_AS(multinomial(tensor<double>({1.0, -1.0}).to(device), 1, true), doctest::Contains("non-negative"),
                         Error);
  }
  // Ties keep their order; NaN sorts above +inf; integers sort too.
  const SortResult ties = sort(tensor<float>({2.0f, 1.0f, 2.0f, NAN, INFINITY, 1.0f}), 0, true);
  CHECK(ties.indices.to_vector<int64_t>() == std::vector<int64_t>{3, 4, 0, 2, 1, 5});
  CHECK(sort(tensor<int64_t>({5, -3, 9})).values.to_vector<int64_t>() == std::vector<int64_t>{-3, 5, 9});
  CHECK(topk(tensor<float>({1.0f, 4.0f, 2.0f}), 2, 0, false).indices.to_vector<int64_t>() == std::vector<int64_t>{0, 2});
  CHECK_THROWS_WITH_AS(topk(ones({3}), 4), "topk: k 4 is outside [0, 3], the size of dim -1 of f32[3] on cpu", Error);
}

TEST_CASE("bf16 dropout scales survivors by 1/(1-p) exactly, rounded once") {
  manual_seed(3);
  const Tensor x = ones({4096}, DType::bf16);
  const Tensor y = nn::dropout(x, 0.1, true).to(DType::f64);
  const double kept_value = max(y).item<double>();
  CHECK(kept_value == static_cast<double>(static_cast<float>(BFloat16(1.0f / 0.9f))));
}

TEST_CASE("a KV cache gives the logits of the whole sequence's forward, for GPT and Llama") {
  manual_seed(0);
  nn::GPTConfig gc;
  gc.n_layer = 2, gc.n_head = 2, gc.n_embd = 16, gc.vocab_size = 64, gc.block_size = 16;
  nn::GPT gpt(gc);
  nn::Llama llama(tiny_llama());
  const Tensor tokens = llama_batch(0).first.narrow(1, 0, 9);  // [4, 9]
  const auto check = [&](const std::function<Tensor(const Tensor&, nn::KVCache*)>& forward) {
    NoGradGuard no_grad;
    const Tensor whole = forward(tokens, nullptr);  // [4, 9, V]
    nn::KVCache cache;
    const Tensor prompt = forward(tokens.narrow(1, 0, 6), &cache);
    CHECK(max(abs(prompt - whole.narrow(1, 0, 6))).item<double>() < 1e-5);
    const void* buffer = nullptr;
    for (int64_t t = 6; t < 9; ++t) {
      const Tensor one = forward(tokens.narrow(1, t, 1), &cache);
      CHECK(cache.length() == t + 1);
      CHECK(max(abs(one - whole.narrow(1, t, 1))).item<double>() < 1e-5);
      // The first token after the prompt makes room for 12 (twice the 6 cached); the next ones write into it.
      for (const nn::KVCache::Layer& layer : cache.layers) CHECK(layer.key_buffer.size(2) == 12);
      if (t == 6) buffer = cache.layers[0].value_buffer.data_ptr();
      CHECK(cache.layers[0].value_buffer.data_ptr() == buffer);
    }
    CHECK_THROWS_WITH_AS(forward(tokens.narrow(1, 0, 2), &cache), doctest::Contains("one token a forward"), Error);
  };
  check([&](const Tensor& x, nn::KVCache* c) { return c ? gpt.forward(x, *c) : gpt.forward(x, Tensor()).logits; });
  check([&](const Tensor& x, nn::KVCache* c) { return c ? llama.forward(x, *c) : llama.forward(x, Tensor()).logits; });
  // With grad on, a gradient flows through the cache (a cat, not the buffer's in-place writes).
  nn::KVCache graded;
  gpt.forward(tokens.narrow(1, 0, 6), graded);
  sum(gpt.forward(tokens.narrow(1, 6, 1), graded)).backward();
  CHECK_FALSE(graded.layers[0].key_buffer.defined());
  for (const Tensor& p : gpt.parameters()) CHECK(p.grad().defined());
}

TEST_CASE("generation with a fixed seed is reproducible; greedy is top-k 1; sampling follows the probabilities") {
  manual_seed(0);
  nn::Llama model(tiny_llama());
  const Tensor prompt = llama_batch(1).first.narrow(1, 0, 4);
  const nn::SamplingOptions warm{.temperature = 1.5, .top_k = 20, .top_p = 0.95};
  manual_seed(7);
  const Tensor a = nn::generate(model, prompt, 12, warm);
  manual_seed(7);
  const Tensor b = nn::generate(model, prompt, 12, warm);
  manual_seed(8);
  const Tensor c = nn::generate(model, prompt, 12, warm);
  CHECK(a.shape() == Shape{4, 16});
  CHECK(a.to_vector<int64_t>() == b.to_vector<int64_t>());
  CHECK(a.to_vector<int64_t>() != c.to_vector<int64_t>());
  CHECK(max(abs(a.narrow(1, 0, 4) - prompt)).item<int64_t>() == 0);
  CHECK(model.is_training());  // restored
  const Tensor greedy = nn::generate(model, prompt, 6, {.temperature = 0});
  CHECK(nn::generate(model, prompt, 6, {.top_k = 1}).to_vector<int64_t>() == greedy.to_vector<int64_t>());
  CHECK(nn::generate(model, prompt, 6, {.top_p = 1e-9}).to_vector<int64_t>() == greedy.to_vector<int64_t>());

  // p = (0.6, 0.3, 0.1): top-k 2 leaves (2/3, 1/3); top-p 0.8 the same two.
  const Tensor logits = log(tensor<double>({0.6, 0.3, 0.1}, {1, 3})).expand({4000, 3}).contiguous();
  const auto share_of_first = [&](const nn::SamplingOptions& o) {
    const Tensor picked = nn::sample(logits, o);
    CHECK(max(picked).item<int64_t>() <= 2);
    return sum(eq(picked, 0.0)).item<int64_t>() / 4000.0;
  };
  CHECK(share_of_first({}) == doctest::Approx(0.6).epsilon(0.05));
  CHECK(share_of_first({.top_k = 2}) == doctest::Approx(2.0 / 3).epsilon(0.05));
  CHECK(share_of_first({.top_p = 0.8}) == doctest::Approx(2.0 / 3).epsilon(0.05));
  // Past block_size (32): each token from the 32 before it, as a loop without a cache does.
  const Tensor long_run = nn::generate(model, prompt, 36, {.temperature = 0});
  Tensor naive = prompt;
  {
    NoGradGuard no_grad;
    model.eval();
    while (naive.size(1) < 40) {
      const Tensor window = naive.narrow(1, std::max<int64_t>(0, naive.size(1) - 32), std::min<int64_t>(naive.size(1), 32));
      const Tensor logits = model.forward(window, Tensor()).logits;
      naive = cat({naive, argmax(logits.select(1, logits.size(1) - 1), -1, true)}, 1);
    }
    model.train();
  }
  CHECK(long_run.to_vector<int64_t>() == naive.to_vector<int64_t>());
  CHECK_THROWS_WITH_AS(nn::sample(logits, {.top_p = 0}), doctest::Contains("top_p in (0, 1]"), Error);
  // Logits with no distribution in them are refused, as torch.multinomial refuses NaN
  // probabilities -- greedy or not: a diverged model must not print tokens.
  const Tensor fine = tensor<float>({0, 1, -INFINITY}, {1, 3});
  CHECK(nn::sample(fine, {.temperature = 0}).item<int64_t>() == 1);
  for (const double temperature : {0.0, 1.0}) {
    CAPTURE(temperature);
    CHECK_THROWS_WITH_AS(nn::sample(cat({fine, tensor<float>({NAN, NAN, NAN}, {1, 3})}), {.temperature = temperature}),
                         "sample: row 1 of the logits f32[2, 3] on cpu holds NaN or +inf, so it gives no distribution to "
                         "draw from; check the model's forward (a diverged run gives NaN)",
                         Error);
    CHECK_THROWS_WITH_AS(nn::sample(tensor<float>({0, INFINITY}, {1, 2}), {.temperature = temperature}),
                         doctest::Contains("row 0 of the logits f32[1, 2] on cpu holds NaN or +inf"), Error);
    CHECK_THROWS_WITH_AS(nn::sample(tensor<float>({-INFINITY, -INFINITY}, {1, 2}), {.temperature = temperature}),
                         doctest::Contains("is -inf everywhere"), Error);
  }
}

}  // namespace zg::test
