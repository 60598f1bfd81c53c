// Context parallelism (dist/tensor/context_parallel.h): each variant -- ring, all_gather,
// ulysses -- at C = 2 and 4 gives every rank its rows of the one-rank causal attention with
// grouped-query heads and the one-rank gradients, sending the bytes its formula says; the
// load-balanced split gives every rank the same blocks of work; GPT and Llama models cut
// over cp, alone and with tp = 2 x dp = 2 at ZeRO-3, train 5 steps as one rank does.
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "helpers.h"

using namespace zg;
using test::check_close;
using test::Host;

namespace {

const TensorOptions kF64(DType::f64);
constexpr dist::ContextVariant kVariants[] = {dist::ContextVariant::ring, dist::ContextVariant::all_gather,
                                              dist::ContextVariant::ulysses};

}  // namespace

TEST_CASE("the load-balanced split: every rank computes 2C + 1 blocks, 2 of them diagonal, and together the ranks "
          "compute each causal (query piece, key piece) block once") {
  for (int c : {1, 2, 4, 8}) {
    INFO("C = " << c);
    std::set<std::pair<int, int>> covered;
    for (int r = 0; r < c; ++r) {
      const std::vector<dist::AttentionBlock> blocks = dist::context_schedule(r, c);
      CHECK(blocks.size() == static_cast<size_t>(2 * c + 1));
      int diagonal = 0;
      for (const dist::AttentionBlock& b : blocks) {
        diagonal += b.diagonal;
        CHECK(b.key <= b.query);
        CHECK(b.source == (r - b.step + c) % c);
        CHECK(covered.insert({b.query, b.key}).second);
      }
      CHECK(diagonal == 2);
    }
    CHECK(covered.size() == static_cast<size_t>(2 * c * (2 * c + 1) / 2));  // every key piece <= its query piece
  }
  // Cut into C contiguous pieces instead, rank r would compute r + 1 blocks: C times the first rank's work for the last.
}

TEST_CASE("sequence pieces: positions, refinement by sequence parallelism, and dropout masks that are the whole "
          "sequence's rows") {
  const nn::SequencePieces pieces = nn::load_balanced_pieces(1, 4);  // pieces 1 and 6 of 8
  CHECK(pieces.parts == 8);
  CHECK(pieces.held == std::vector<int>{1, 6});
  CHECK(pieces.whole_length(6) == 24);
  CHECK(pieces.refine(2, 1).held == std::vector<int>{6});
  const nn::SequencePieces quarter = pieces.refine(4, 2);  // piece 6 cut in two, its first half
  CHECK(quarter.parts == 16);
  CHECK(quarter.held == std::vector<int>{12});
  CHECK_THROWS_WITH_AS(pieces.refine(3, 0), doctest::Contains("does not cut the 2 pieces"), Error);
  CHECK_THROWS_WITH_AS(pieces.whole_length(5), doctest::Contains("5 rows do not divide into the 2 pieces"), Error);

  manual_seed(3);
  const Tensor x = randn({2, 24, 3}, kF64);
  manual_seed(11);
  const Tensor whole = dropout(x, 0.3, true);
  const Tensor after_whole = rand({4}, kF64);
  for (int r = 0; r < 4; ++r) {
    const nn::SequencePieces mine = nn::load_balanced_pieces(r, 4);
    manual_seed(11);
    const Tensor part = dropout_pieces(dist::context_shard(x, r, 4), 0.3, true, 1, mine.held, mine.parts);
    check_close(part, Host::of(dist::context_shard(whole, r, 4)), 0, 0, "rank " + std::to_string(r) + "'s mask");
    check_close(rand({4}, kF64), Host::of(after_whole), 0, 0, "the generator after the draw");
  }
}

namespace {

// The one-rank attention of q [B, H, S, D], k, v [B, H_kv, S, D] (f64 on the CPU, from
// inputs rounded to `dtype`), and its gradients for an upstream gradient g; each rank's
// context_attention of its pieces, in `dtype` on `device`, must give its rows.
struct AttentionCase {
  dist::ContextVariant variant;
  int c;
  int64_t heads, kv_heads;
  DType dtype;
  double tol;
  Device device = kCPU;
  int64_t seq = 16, dim = 4;
};
void check_attention(const AttentionCase& a) {
  manual_seed(21);
  const auto input = [&](int64_t heads) { return randn({2, heads, a.seq, a.dim}, kF64).to(a.dtype).to(DType::f64); };
  const Tensor q = input(a.heads), k = input(a.kv_heads), v = input(a.kv_heads), g = input(a.heads);
  const Tensor qr = q.clone().set_requires_grad(true), kr = k.clone().set_requires_grad(true),
               vr = v.clone().set_requires_grad(true);
  const Tensor want = scaled_dot_product_attention(qr, kr, vr, true);
  sum(want * g).backward();
  const auto on = [&](const Tensor& t) { return t.to(a.dtype).to(a.device); };
  dist::run_local(a.c, [&](dist::ProcessGroup& group) {
    const int r = group.rank();
    const auto mine = [&](const Tensor& t) { return dist::context_shard(t, r, a.c, 2).contiguous(); };
    const Tensor ql = on(mine(q)).set_requires_grad(true), kl = on(mine(k)).set_requires_grad(true),
                 vl = on(mine(v)).set_requires_grad(true);
    group.reset_bytes_sent();
    const Tensor out = dist::context_attention(ql, kl, vl, group, a.variant);
    const int64_t accumulate = element_size(a.dtype == DType::f64 ? a.dtype : DType::f32);
    const dist::ContextBytes bytes = dist::context_attention_bytes(a.variant, a.c, 2, a.seq / a.c, a.heads, a.kv_heads,
                                                                   a.dim, element_size(a.dtype), accumulate);
    CHECK(group.bytes_sent() == bytes.forward);
    check_close(out, Host::of(mine(want)), a.tol, a.tol, "out");
    sum(out * on(mine(g))).backward();
    CHECK(group.bytes_sent() == bytes.forward + bytes.backward);
    check_close(ql.grad(), Host::of(mine(qr.grad())), a.tol, a.tol, "dq");
    check_close(kl.grad(), Host::of(mine(kr.grad())), a.tol, a.tol, "dk");
    check_close(vl.grad(), Host::of(mine(vr.grad())), a.tol, a.tol, "dv");
    CHECK(out.dtype() == a.dtype);
    CHECK(out.device() == a.device);
    check_close(dist::context_unshard(out, group, 2), Host::of(want), a.tol, a.tol, "unsharded out");
  });
}

}  // namespace

TEST_CASE("context_attention: each variant at C = 2 and 4, causal, with grouped-query heads, gives every rank its "
          "rows of the one-rank attention and the one-rank gradients of its q, k, v, and sends its formula's bytes "
          "(f64 1e-12, f32 1e-5)") {
  for (dist::ContextVariant variant : kVariants)
    for (int c : {2, 4}) {
      INFO(dist::name(variant) << " at C = " << c);
      check_attention({variant, c, 8, 4, DType::f64, 1e-12});
      check_attention({variant, c, 8, 8, DType::f32, 1e-5});
    }
}

TEST_CASE("context_attention on each device present: bf16 with the fused kernels (cuDNN's flash attention a block "
          "on a GPU), every variant at C = 2 and 4, within bf16's rounding of the f64 one-rank attention") {
  for (Device device : test::devices())
    for (dist::ContextVariant variant : kVariants)
      for (int c : {2, 4}) {
        INFO(device.str() << ", " << dist::name(variant) << " at C = " << c);
        check_attention({variant, c, 8, 4, DType::bf16, 3e-2, device, 256, 64});
      }
}

TEST_CASE("context_attention refuses what it cannot split, naming it") {
  dist::run_local(4, [](dist::ProcessGroup& group) {
    const Tensor q = zeros({1, 8, 4, 2}, kF64), k = zeros({1, 2, 4, 2}, kF64);
    CHECK_THROWS_WITH_AS(dist::context_attention(q, k, k, group, dist::ContextVariant::ulysses),
                         doctest::Contains("the 8 query heads and 2 key/value heads a rank holds must both divide by "
                                           "the cp group's C = 4"),
                         Error);
    CHECK_THROWS_WITH_AS(dist::context_attention(zeros({1, 8, 3, 2}, kF64), zeros({1, 2, 3, 2}, kF64),
                                                 zeros({1, 2, 3, 2}, kF64), group, dist::ContextVariant::ring),
                         doctest::Contains("3 rows are not this rank's two equal pieces"), Error);
  });
  CHECK_THROWS_WITH_AS(dist::context_shard(zeros({2, 12}), 0, 4), doctest::Contains("make the length a multiple of 8"),
                       Error);
  CHECK_THROWS_WITH_AS(dist::parse_context_variant("tree"), doctest::Contains("use ring, all_gather or ulysses"), Error);
}

namespace {

using MakeModel = std::function<std::shared_ptr<nn::CausalLM>()>;

nn::GPTConfig tiny_gpt() { return {.n_layer = 2, .n_head = 8, .n_embd = 32, .vocab_size = 64, .block_size = 16}; }
nn::LlamaConfig tiny_llama() {
  return {.n_layer = 2, .n_head = 16, .n_kv_head = 8, .n_embd = 64, .vocab_size = 64, .block_size = 16};
}

// cp = 1, tp = 0: the one-rank model. Otherwise the mesh dp_shard x cp x tp, each data-parallel
// rank on its rows of a global batch of 4, each cp rank on its pieces of the rows' 16 tokens.
struct Layout {
  int cp = 1, tp = 0, dp = 1, stage = 0;
  bool sp = true;  // with tp: sequence parallelism too
  dist::ContextVariant variant = dist::ContextVariant::ring;
  DType dtype = DType::f64;
};

struct Run {
  std::vector<double> losses;
  nn::NamedTensors state;
};

Run train(const MakeModel& make, const Layout& l) {
  Run run;
  dist::run_local(l.dp * l.cp * std::max(l.tp, 1), [&](dist::ProcessGroup& world) {
    manual_seed(5);
    std::shared_ptr<nn::CausalLM> model = make();
    dist::DeviceMesh mesh(world, {{"dp_shard", l.dp}, {"cp", l.cp}, {"tp", std::max(l.tp, 1)}});
    if (l.tp > 0) {
      nn::ParallelPlan plan = model->parallel_plan();
      plan.sequence_parallel = l.sp;
      dist::parallelize_module(*model, mesh.group("tp"), plan);
    }
    dist::parallelize_context(*model, mesh.group("cp"), l.variant);
    dist::ShardedModel sharded(*model, mesh, {.stage = l.stage, .compute_dtype = l.dtype, .max_grad_norm = 0.05});
    dist::ProcessGroup& data = mesh.flatten("dp", {"dp_shard", "cp"});
    const int cp_rank = mesh.coordinate("cp"), rows = 4 / l.dp;
    std::vector<double> losses;
    for (int64_t step = 0; step < 5; ++step) {
      manual_seed(100 + step);
      const Tensor tokens = randint(0, 64, {4, 17}, TensorOptions(DType::i64)).narrow(0, mesh.coordinate("dp_shard") * rows, rows);
      sharded.zero_grad();
      const Tensor idx = dist::context_shard(tokens.narrow(1, 0, 16), cp_rank, l.cp);
      const Tensor targets = dist::context_shard(tokens.narrow(1, 1, 16), cp_rank, l.cp);
      const Tensor loss = model->forward(idx, targets).loss;
      loss.backward();
      Tensor global = loss.detach().to(DType::f64).reshape({1}).contiguous().clone();
      data.all_reduce(global, dist::ReduceKind::average);
      losses.push_back(global.item<double>());
      sharded.step(1e-2);
    }
    nn::NamedTensors state = sharded.consolidated_state();
    if (world.rank() == 0) run = {losses, state};
  });
  return run;
}

void check_same_run(const Run& got, const Run& want, double loss_tol, double param_tol) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i)
    CHECK_MESSAGE(std::abs(got.losses[i] - want.losses[i]) <= loss_tol, "loss of step ", i, ": ", got.losses[i], " vs ",
                  want.losses[i]);
  REQUIRE(got.state.size() == want.state.size());
  for (size_t i = 0; i < want.state.size(); ++i)
    check_close(got.state[i].second, Host::of(want.state[i].second), param_tol, param_tol,
                "after training: " + want.state[i].first);
}

void check_trains_as_one_rank(const MakeModel& make64, const MakeModel& make32) {
  const Run reference = train(make64, {});
  for (dist::ContextVariant variant : kVariants)
    for (int c : {2, 4}) {
      INFO(dist::name(variant) << " at cp " << c << " alone");
      check_same_run(train(make64, {.cp = c, .variant = variant}), reference, 1e-12, 1e-12);
      INFO(dist::name(variant) << " at cp " << c << " x tp 2 x dp 2, ZeRO-3");
      check_same_run(train(make64, {.cp = c, .tp = 2, .dp = 2, .stage = 3, .variant = variant}), reference, 1e-12,
                     1e-12);
    }
  // f32: losses to 1e-5 (parameters to 2e-3: AdamW's step of a near-zero gradient is its sign)
  const Run reference32 = train(make32, {.dtype = DType::f32});
  for (dist::ContextVariant variant : kVariants) {
    INFO(dist::name(variant) << " at cp 2 in f32");
    check_same_run(train(make32, {.cp = 2, .variant = variant, .dtype = DType::f32}), reference32, 1e-5, 2e-3);
  }
}

}  // namespace

TEST_CASE("context parallelism: a GPT at cp 2 and 4, each variant, alone and with tp 2 x dp 2 at ZeRO-3, trains 5 "
          "steps as one rank (f64 1e-12; f32 1e-5)") {
  check_trains_as_one_rank([] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); },
                           [] { return std::make_shared<nn::GPT>(tiny_gpt()); });
}

TEST_CASE("context parallelism: a Llama with grouped-query attention at cp 2 and 4, each variant, alone and with "
          "tp 2 x dp 2 at ZeRO-3, trains 5 steps as one rank (f64 1e-12; f32 1e-5)") {
  check_trains_as_one_rank([] { return std::make_shared<nn::Llama>(tiny_llama(), kF64); },
                           [] { return std::make_shared<nn::Llama>(tiny_llama()); });
}

TEST_CASE("context parallelism with dropout: a GPT dropping its embeddings, residual branches and attention "
          "probabilities trains as one rank under Ulysses at cp 2 and 4, alone and with tp 2 (sequence parallelism on "
          "and off) at ZeRO-3: every mask is the one-rank mask's part (f64 1e-12; data-parallel ranks would draw "
          "masks of their own rows, so dp = 1)") {
  nn::GPTConfig config = tiny_gpt();
  config.dropout = 0.1;
  const MakeModel make = [config] { return std::make_shared<nn::GPT>(config, kF64); };
  const Run reference = train(make, {});
  const auto ulysses = dist::ContextVariant::ulysses;
  for (int c : {2, 4}) {
    INFO("cp " << c);
    check_same_run(train(make, {.cp = c, .variant = ulysses}), reference, 1e-12, 1e-12);
    for (bool sp : {true, false}) {
      INFO("with tp 2, sequence parallel " << sp);
      check_same_run(train(make, {.cp = c, .tp = 2, .stage = 3, .sp = sp, .variant = ulysses}), reference,
                     1e-12, 1e-12);
    }
  }
  const Run no_dropout = train([] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); }, {});
  double moved = 0;  // the masks did drop: the weights trained otherwise
  for (size_t i = 0; i < no_dropout.state.size(); ++i)
    moved = std::max(moved, test::max_abs_diff(no_dropout.state[i].second, reference.state[i].second));
  CHECK(moved > 1e-3);
}

TEST_CASE("a model cut over cp refuses attention dropout on the ring and generation with a KV cache, naming them") {
  dist::run_local(2, [](dist::ProcessGroup& group) {
    nn::GPTConfig config = tiny_gpt();
    config.dropout = 0.1;
    nn::GPT gpt(config, kF64);
    dist::parallelize_context(gpt, group, dist::ContextVariant::ring);
    const Tensor idx = zeros({1, 8}, TensorOptions(DType::i64));
    CHECK_THROWS_WITH_AS(gpt.forward(idx, idx), doctest::Contains("context_attention (ring): attention dropout (p = "
                                                                  "0.1) does not run on the ring variant"),
                         Error);
    gpt.eval();
    nn::KVCache cache;
    CHECK_THROWS_WITH_AS(gpt.forward(idx, cache), doctest::Contains("generation with a KV cache on a model whose "
                                                                     "sequences are cut"),
                         Error);
    CHECK_THROWS_WITH_AS(gpt.forward(zeros({1, 16}, TensorOptions(DType::i64)), Tensor()),
                         doctest::Contains("sequence of 32 tokens is longer than block_size 16"), Error);
  });
}

#ifdef ZG_BENCH_DIR  // a build with -Dbench=false has no zero_memory to run
TEST_CASE("zero_memory --cp 8: Llama 3.1 8B on 131,072 tokens, each variant: a rank's activations and the bytes the "
          "cp group sends equal their formulas to the byte; the ZeRO-3 traffic to 1e-6") {
  const std::string command = std::string(ZG_BENCH_DIR) + "/zero_memory --config " + ZG_TEST_FIXTURES +
                              "/llama3.1_8b/config.json --world-size 16 --cp 8 --stage 3 --seq 131072 --json";
  std::map<std::string, int64_t> activation;
  for (const char* variant : {"ring", "all_gather", "ulysses"}) {
    INFO(variant);
    int status = 0;
    const std::string out = test::run_command(command + " --cp-variant " + variant, status);
    REQUIRE(status == 0);
    const nlohmann::json r = nlohmann::json::parse(out).at(0);
    CHECK(r["cp"] == 8);
    CHECK(r["activation"].get<int64_t>() == r["formula_activation"].get<int64_t>());
    CHECK(r["sent_context_parallel"].get<int64_t>() == r["formula_sent_context_parallel"].get<int64_t>());
    CHECK(r["sent_per_step"].get<double>() == doctest::Approx(r["formula_sent_per_step"].get<double>()).epsilon(1e-6));
    CHECK(r["shard_group"] == 16);  // ZeRO over dp_shard 2 x cp 8
    activation[variant] = r["activation"].get<int64_t>();
  }
  CHECK(activation["ring"] == activation["all_gather"]);  // the same blocks, the same saved tensors
  CHECK(activation["ulysses"] > activation["ring"]);      // its out again, and the repeated key/value heads
}
#endif  // ZG_BENCH_DIR
