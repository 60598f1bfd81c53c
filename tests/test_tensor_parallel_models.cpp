// Tensor parallelism applied to whole models (dist/tensor/parallelize.h): a GPT and a
// Llama with grouped-query attention, cut by their own plans at T = 1, 2, 4 ranks, compute
// the one-rank model's loss, logits and gradients from the same seed; plans that do not
// divide are refused by name.
#include <map>

#include "helpers.h"

using namespace zg;
using test::check_close;
using test::Host;

namespace {

const TensorOptions kF64(DType::f64);

nn::GPTConfig tiny_gpt() {
  return {.n_layer = 2, .n_head = 4, .n_embd = 32, .vocab_size = 64, .block_size = 16};
}

nn::LlamaConfig tiny_llama(bool tied = false) {
  return {.n_layer = 2, .n_head = 8, .n_kv_head = 4, .n_embd = 64, .vocab_size = 64, .block_size = 16,
          .tie_embeddings = tied};
}

using MakeModel = std::function<std::shared_ptr<nn::CausalLM>()>;

// Tokens and next-token targets, alike on every rank (a target of -1 is ignored).
struct Batch {
  Tensor idx, targets;
};
Batch batch(int64_t vocab) {
  manual_seed(99);
  Batch b{randint(0, vocab, {2, 12}, TensorOptions(DType::i64)), randint(0, vocab, {2, 12}, TensorOptions(DType::i64))};
  NoGradGuard no_grad;
  b.targets.narrow(1, 0, 1).fill_(-1.0);
  return b;
}

// The one-rank run: loss, logits and every parameter's gradient by name.
struct Reference {
  double loss;
  Host logits;
  std::map<std::string, Host> grads;
};
Reference one_rank(const MakeModel& make, const Batch& b) {
  manual_seed(5);
  std::shared_ptr<nn::CausalLM> model = make();
  const nn::CausalLMOutput out = model->forward(b.idx, b.targets);
  out.loss.backward();
  Reference ref{out.loss.item<double>(), Host::of(out.logits), {}};
  for (const auto& [name, p] : model->named_parameters()) ref.grads.emplace(name, Host::of(p.grad()));
  return ref;
}

// Every parameter's gradient made whole again (gathered along its split) equals the one-rank one.
void check_gradients(nn::Module& model, const Reference& ref, dist::ProcessGroup& group, double tol) {
  std::map<std::string, nn::TensorSplit> splits;
  for (const auto& [name, split] : model.named_splits()) splits.emplace(name, split);
  for (const auto& [name, p] : model.named_parameters()) {
    const auto split = splits.find(name);
    const Tensor whole = split == splits.end() ? p.grad() : dist::gather_split(p.grad(), split->second, group);
    check_close(whole, ref.grads.at(name), tol, tol, "gradient of " + name);
  }
}

void check_cut_model(const MakeModel& make, int64_t vocab) {
  const Batch b = batch(vocab);
  const Reference ref = one_rank(make, b);
  for (int world : {1, 2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, [&](dist::ProcessGroup& group) {
      manual_seed(5);
      std::shared_ptr<nn::CausalLM> model = make();
      dist::parallelize_module(*model, group);
      const nn::CausalLMOutput out = model->forward(b.idx, b.targets);
      CHECK(out.logits.size(2) == vocab / world);  // this rank's vocabulary shard
      CHECK(std::abs(out.loss.item<double>() - ref.loss) < 1e-12);
      const Tensor whole = dist::gather_split(out.logits.detach(), {2, 1, world, group.rank()}, group);
      check_close(whole, ref.logits, 1e-12, 1e-12, "logits");
      out.loss.backward();
      check_gradients(*model, ref, group, 1e-12);
    });
  }
}

}  // namespace

TEST_CASE("parallelize_module: a GPT cut at T = 1, 2, 4 computes the one-rank loss, logits and gradients") {
  check_cut_model([] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); }, 64);
}

TEST_CASE("parallelize_module: a Llama with grouped-query attention, untied and tied, cut at T = 1, 2, 4 computes "
          "the one-rank loss, logits and gradients") {
  for (bool tied : {false, true}) {
    INFO("tied " << tied);
    check_cut_model([tied] { return std::make_shared<nn::Llama>(tiny_llama(tied), kF64); }, 64);
  }
}

TEST_CASE("parallelize_module: generation with a KV cache gathers the vocabulary and matches one rank") {
  const Batch b = batch(64);
  manual_seed(5);
  nn::Llama whole(tiny_llama(), kF64);
  NoGradGuard no_grad;
  nn::KVCache cache;
  const Host prompt = Host::of(whole.forward(b.idx, cache));
  const Host next = Host::of(whole.forward(b.idx.narrow(1, 0, 1), cache));
  dist::run_local(2, [&](dist::ProcessGroup& group) {
    manual_seed(5);
    nn::Llama cut(tiny_llama(), kF64);
    dist::parallelize_module(cut, group);
    nn::KVCache mine;
    check_close(cut.forward(b.idx, mine), prompt, 1e-12, 1e-12, "prompt logits");
    check_close(cut.forward(b.idx.narrow(1, 0, 1), mine), next, 1e-12, 1e-12, "next token's logits");
  });
}

TEST_CASE("parallelize_module refuses a plan that does not divide, names what fails, and changes nothing") {
  dist::run_local(4, [](dist::ProcessGroup& group) {
    nn::GPTConfig six_heads = tiny_gpt();
    six_heads.n_head = 8, six_heads.n_embd = 48, six_heads.vocab_size = 66;
    nn::GPT gpt(six_heads, kF64);
    CHECK_THROWS_WITH_AS(dist::parallelize_module(gpt, group),
                         "parallelize_module: the model's vocab_size 66 does not divide by the tensor-parallel "
                         "group's size T = 4", Error);
    CHECK(gpt.transformer->named_parameters().front().second.size(0) == 66);  // nothing cut
    nn::LlamaConfig two_kv = tiny_llama();
    two_kv.n_kv_head = 2;
    nn::Llama llama(two_kv, kF64);
    CHECK_THROWS_WITH_AS(dist::parallelize_module(llama, group),
                         "parallelize_module: the model's n_kv_head 2 does not divide by the tensor-parallel group's "
                         "size T = 4", Error);
    nn::Linear odd(8, 6, true, std::nullopt, kF64);
    using enum nn::ParallelStyle;
    CHECK_THROWS_WITH_AS(dist::parallelize_module(odd, group, {.rules = {{"*", colwise}}}),
                         "parallelize_module: rule '*' (colwise) matches no module of the model", Error);
    nn::Sequential mlp{std::make_shared<nn::Linear>(8, 6, true, std::nullopt, kF64), std::make_shared<nn::GELU>()};
    CHECK_THROWS_WITH_AS(dist::parallelize_module(mlp, group, {.rules = {{"0", colwise}}}),
                         "parallelize_module: 0 (colwise): out_features 6 does not divide into 1 chunk(s) of T = 4 "
                         "equal parts", Error);
    CHECK_THROWS_WITH_AS(dist::parallelize_module(mlp, group, {.rules = {{"1", rowwise}}}),
                         "parallelize_module: 1 (rowwise): the module is not an nn::Linear", Error);
    nn::Sequential pair{std::make_shared<nn::Linear>(8, 8, true, std::nullopt, kF64),
                        std::make_shared<nn::Linear>(8, 8, true, std::nullopt, kF64)};
    CHECK_THROWS_WITH_AS(dist::parallelize_module(pair, group, {.rules = {{"0", colwise}, {"?", rowwise}}}),
                         "parallelize_module: 0 is named by more than one rule", Error);
    CHECK_THROWS_WITH_AS(dist::parallelize_module(mlp, group, {}),
                         "parallelize_module: the plan names no module; give the model a parallel_plan() or pass a "
                         "plan", Error);
  });
}
