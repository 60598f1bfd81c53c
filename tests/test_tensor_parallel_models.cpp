// Tensor parallelism applied to whole models (dist/tensor/parallelize.h): a GPT and a
// Llama with grouped-query attention, cut by their own plans at T = 1, 2, 4 ranks, compute
// the one-rank model's loss, logits and gradients from the same seed, and train as one
// rank does under every ZeRO stage over a dp_shard x tp mesh; plans that do not divide are
// refused by name.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "helpers.h"

using namespace zg;
using test::check_close;
using test::Host;

namespace {

const TensorOptions kF64(DType::f64);

nn::GPTConfig tiny_gpt() {
  return {.n_layer = 2, .n_head = 4, .n_embd = 32, .vocab_size = 64, .block_size = 16};
}

nn::LlamaConfig tiny_llama(bool tied = false, bool biased = false) {
  return {.n_layer = 2, .n_head = 8, .n_kv_head = 4, .n_embd = 64, .vocab_size = 64, .block_size = 16,
          .tie_embeddings = tied, .attention_bias = biased, .mlp_bias = biased};
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

// The model's own plan, with sequence parallelism on or off.
nn::ParallelPlan plan_of(const nn::Module& model, bool sequence_parallel) {
  nn::ParallelPlan plan = model.parallel_plan();
  plan.sequence_parallel = sequence_parallel;
  return plan;
}

void check_cut_model(const MakeModel& make, int64_t vocab) {
  const Batch b = batch(vocab);
  const Reference ref = one_rank(make, b);
  for (int world : {1, 2, 4})
    for (bool sp : {false, true}) {
      INFO("T = " << world << ", sequence parallel " << sp);
      dist::run_local(world, [&](dist::ProcessGroup& group) {
        manual_seed(5);
        std::shared_ptr<nn::CausalLM> model = make();
        dist::parallelize_module(*model, group, plan_of(*model, sp));
        int64_t rows_seen = 0;  // by the second block: its rows of the sequence with sp, all of them without
        const std::string second = model->unit_plan().units.at(1);
        for (const auto& [path, module] : model->named_modules())
          if (path == second)
            module->register_forward_pre_hook([&rows_seen](nn::Module&, const Tensor& x) {
              rows_seen = x.size(1);
              return Tensor();
            });
        const nn::CausalLMOutput out = model->forward(b.idx, b.targets);
        CHECK(rows_seen == (sp ? 12 / world : 12));
        CHECK(out.logits.size(2) == vocab / world);  // this rank's vocabulary shard
        CHECK(std::abs(out.loss.item<double>() - ref.loss) < 1e-12);
        const Tensor whole = dist::gather_split(out.logits.detach(), {2, 1, world, group.rank()}, group);
        check_close(whole, ref.logits, 1e-12, 1e-12, "logits");
        out.loss.backward();
        check_gradients(*model, ref, group, 1e-12);
      });
    }
}

// A training run's losses (the global batch's) and the whole model after it.
struct Run {
  std::vector<double> losses;
  nn::NamedTensors state;
};

// How one training run is laid out: tp = 0 is the one-rank model, not cut; the mesh is
// dp_replicate x dp_shard x tp, each data-parallel rank on its rows of a global batch of 4,
// in `micro` micro-batches (gradients synchronised on the last).
struct Layout {
  int tp = 0, replicas = 1, shards = 1, stage = 0, micro = 1;
  DType dtype = DType::f64;
  bool sp = false;
  dist::Offload offload = dist::Offload::none;
  std::string save_to, resume_from;  // a sharded save after step 3 of 5; a load before training
  bool deferred = false;              // built under DeferredInit: cut without values, each rank filling its shards
};

// `make`'s model trained 5 steps (AdamW, clipping at 0.05); resumed, the steps after the save's.
Run train(const MakeModel& make, const Layout& l) {
  Run run;
  const int data_ranks = l.replicas * l.shards;
  dist::run_local(std::max(l.tp, 1) * data_ranks, [&](dist::ProcessGroup& world) {
    manual_seed(5);
    std::shared_ptr<nn::CausalLM> model;
    {
      std::optional<DeferredInit> deferring;
      if (l.deferred) deferring.emplace();
      model = make();
    }
    dist::DeviceMesh mesh(world, {{"dp_replicate", l.replicas}, {"dp_shard", l.shards}, {"tp", std::max(l.tp, 1)}});
    if (l.tp > 0) dist::parallelize_module(*model, mesh.group("tp"), plan_of(*model, l.sp));
    dist::ShardedModel sharded(*model, mesh, {.stage = l.stage, .compute_dtype = l.dtype, .max_grad_norm = 0.05,
                                              .offload = l.offload});
    dist::ProcessGroup& data = mesh.flatten("dp", {"dp_replicate", "dp_shard"});
    const int64_t rows = 4 / data_ranks / l.micro, first = data.rank() * rows * l.micro;
    std::vector<double> losses;
    if (!l.resume_from.empty()) sharded.load(l.resume_from);
    for (int64_t step = sharded.steps(); step < 5; ++step) {
      manual_seed(100 + step);
      const Tensor tokens = randint(0, 64, {4, 13}, TensorOptions(DType::i64));
      sharded.zero_grad();
      Tensor global = zeros({1}, kF64);
      for (int m = 0; m < l.micro; ++m) {
        const Tensor mine = tokens.narrow(0, first + m * rows, rows);
        sharded.set_gradient_sync(m + 1 == l.micro);
        const Tensor loss = model->forward(mine.narrow(1, 0, 12), mine.narrow(1, 1, 12)).loss / double(l.micro);
        loss.backward();
        global = global + loss.detach().to(DType::f64).reshape({1});
      }
      global = global.contiguous().clone();
      data.all_reduce(global, dist::ReduceKind::average);
      losses.push_back(global.item<double>());
      sharded.step(1e-2);
      if (step == 2 && !l.save_to.empty()) sharded.save(l.save_to);
    }
    nn::NamedTensors state = sharded.consolidated_state();
    if (world.rank() == 0) run = {losses, state};
  });
  return run;
}

// Losses within loss_tol (a resumed run's, those of the last steps), every parameter within param_tol.
void check_same_run(const Run& got, const Run& want, double loss_tol, double param_tol) {
  REQUIRE(got.losses.size() <= want.losses.size());
  const size_t skipped = want.losses.size() - got.losses.size();
  for (size_t i = 0; i < got.losses.size(); ++i)
    CHECK_MESSAGE(std::abs(got.losses[i] - want.losses[skipped + i]) <= loss_tol, "loss of step ", skipped + i, ": ",
                  got.losses[i], " vs ", want.losses[skipped + i]);
  REQUIRE(got.state.size() == want.state.size());
  for (size_t i = 0; i < want.state.size(); ++i) {
    CHECK(got.state[i].first == want.state[i].first);
    check_close(got.state[i].second, Host::of(want.state[i].second), param_tol, param_tol,
                "after training: " + want.state[i].first);
  }
}

// f64: losses and parameters to 1e-12. f32: losses to 1e-5, parameters to 2e-3 -- AdamW
// divides each element's step by its own gradient's size, so an element whose gradient is
// near zero (rounded differently when the ranks' partial products are summed) moves by up
// to lr = 1e-2 a step either way.
void check_grid(const MakeModel& make, DType dtype, const std::vector<int>& tps, const std::vector<int>& stages) {
  const double loss_tol = dtype == DType::f64 ? 1e-12 : 1e-5, param_tol = dtype == DType::f64 ? 1e-12 : 2e-3;
  const Run reference = train(make, {.dtype = dtype});
  for (int tp : tps)
    for (int dp : {1, 2})
      for (int stage : stages)
        for (bool sp : {false, true}) {
          INFO("tp " << tp << ", dp " << dp << ", stage " << stage << ", sequence parallel " << sp);
          check_same_run(train(make, {.tp = tp, .shards = dp, .stage = stage, .dtype = dtype, .sp = sp}), reference,
                         loss_tol, param_tol);
        }
}

// A sharded save in one layout resumes in others with the losses and weights of the
// uninterrupted run: between tp = 2 and tp = 1 (a model not cut) or tp = 4, stages and
// offload changed with it.
void check_resumes(const MakeModel& make, const Layout& saving, const std::vector<Layout>& resuming) {
  const std::string dir = "/tmp/zg_test_tp_checkpoint_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const Run reference = train(make, {});
  Layout save = saving;
  save.save_to = dir;
  check_same_run(train(make, save), reference, 1e-12, 1e-12);
  for (Layout resume : resuming) {
    INFO("resumed at tp " << resume.tp << " x dp " << resume.shards << ", stage " << resume.stage);
    resume.resume_from = dir;
    const Run resumed = train(make, resume);
    CHECK(resumed.losses.size() == 2);
    check_same_run(resumed, reference, 1e-12, 1e-12);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE("tensor parallelism composed with ZeRO: a GPT at (tp, dp, stage) in {1, 2, 4} x {1, 2} x {0, 1, 2, 3} "
          "trains as one rank, sequence parallelism on and off (f64; f32 at tp 2)") {
  check_grid([] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); }, DType::f64, {1, 2, 4}, {0, 1, 2, 3});
  check_grid([] { return std::make_shared<nn::GPT>(tiny_gpt()); }, DType::f32, {2}, {0, 3});
}

TEST_CASE("tensor parallelism composed with ZeRO: a Llama with grouped-query attention at (tp, dp, stage) in "
          "{1, 2, 4} x {1, 2} x {0, 1, 2, 3} trains as one rank, sequence parallelism on and off (f64; f32 at tp 2)") {
  check_grid([] { return std::make_shared<nn::Llama>(tiny_llama(), kF64); }, DType::f64, {1, 2, 4}, {0, 1, 2, 3});
  check_grid([] { return std::make_shared<nn::Llama>(tiny_llama()); }, DType::f32, {2}, {0, 3});
}

TEST_CASE("tensor parallelism with hybrid sharding, offload and gradient accumulation trains as one rank") {
  const MakeModel gpt = [] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); };
  const Run reference = train(gpt, {});
  for (int stage : {2, 3}) {
    INFO("HSDP 2 x 2 x tp 2, stage " << stage);
    check_same_run(train(gpt, {.tp = 2, .replicas = 2, .shards = 2, .stage = stage}), reference, 1e-12, 1e-12);
  }
  for (dist::Offload offload : {dist::Offload::optimizer, dist::Offload::optimizer_and_params}) {
    INFO("offload " << int(offload));
    check_same_run(train(gpt, {.tp = 2, .shards = 2, .stage = 3, .sp = true, .offload = offload}), reference, 1e-12,
                   1e-12);
  }
  for (int stage : {0, 1, 2, 3}) {
    INFO("2 micro-batches, tp 2 x dp 2, stage " << stage);
    check_same_run(train(gpt, {.tp = 2, .shards = 2, .stage = stage, .micro = 2}), reference, 1e-12, 1e-12);
  }
}

TEST_CASE("tensor parallelism of a deferred model: cut without values, each rank materialising its slices' shards, "
          "it trains as the eager one-rank model") {
  const MakeModel gpt = [] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); };
  const Run reference = train(gpt, {});
  for (int stage : {0, 1, 2, 3}) {
    INFO("deferred GPT, tp 2 x dp 2, stage " << stage);
    check_same_run(train(gpt, {.tp = 2, .shards = 2, .stage = stage, .deferred = true}), reference, 1e-12, 1e-12);
  }
  const MakeModel llama = [] { return std::make_shared<nn::Llama>(tiny_llama(), kF64); };
  const Run llama_reference = train(llama, {});
  INFO("deferred Llama, tp 4, stage 3, sequence parallel");
  check_same_run(train(llama, {.tp = 4, .stage = 3, .sp = true, .deferred = true}), llama_reference, 1e-12, 1e-12);
}

TEST_CASE("tensor parallelism with dropout: a GPT dropping its embeddings, attention probabilities and residual "
          "branches trains as one rank at tp 2 and 4, sequence parallelism on and off, activation checkpointing too") {
  // Every rank draws its part of the one-rank masks (its heads' probabilities, its rows of
  // a sequence shard) from the one-rank generator state: the same run, to 1e-12. One
  // data-parallel rank: more would each drop their own rows of the batch.
  nn::GPTConfig dropping = tiny_gpt();
  dropping.dropout = 0.2;
  const MakeModel gpt = [dropping] { return std::make_shared<nn::GPT>(dropping, kF64); };
  const Run reference = train(gpt, {});
  for (int tp : {2, 4})
    for (int stage : {0, 3})
      for (bool sp : {false, true}) {
        INFO("tp " << tp << ", stage " << stage << ", sequence parallel " << sp);
        check_same_run(train(gpt, {.tp = tp, .stage = stage, .sp = sp}), reference, 1e-12, 1e-12);
      }
  // Activation checkpointing recomputes each block, its collectives and its masks, in backward.
  nn::GPTConfig recomputing = dropping;
  recomputing.activation_checkpointing = true;
  for (bool sp : {false, true}) {
    INFO("activation checkpointing, tp 2, stage 3, sequence parallel " << sp);
    check_same_run(train([recomputing] { return std::make_shared<nn::GPT>(recomputing, kF64); },
                         {.tp = 2, .stage = 3, .sp = sp}),
                   reference, 1e-12, 1e-12);
  }
  const Run no_dropout = train([] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); }, {});
  CHECK(std::abs(no_dropout.losses.back() - reference.losses.back()) > 1e-5);  // the masks did something
}

TEST_CASE("tensor-parallel checkpoints: a save at tp 2 x dp 2 stage 3 resumes at tp 1 x dp 4 stage 1, at one rank "
          "and at other cuts with the losses of the uninterrupted run") {
  const MakeModel gpt = [] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); };
  check_resumes(gpt, {.tp = 2, .shards = 2, .stage = 3},
                {{.shards = 4, .stage = 1},
                 {},
                 {.tp = 1, .shards = 4, .stage = 1},
                 {.tp = 4, .stage = 0, .sp = true},
                 {.tp = 2, .shards = 2, .stage = 3},
                 {.tp = 2, .replicas = 2, .stage = 2, .offload = dist::Offload::optimizer}});
  const MakeModel llama = [] { return std::make_shared<nn::Llama>(tiny_llama(), kF64); };
  check_resumes(llama, {.shards = 2, .stage = 2}, {{.tp = 4, .shards = 1, .stage = 3}, {.tp = 2, .shards = 2, .stage = 1}});
  check_resumes(llama, {.tp = 4, .stage = 1, .sp = true}, {{.tp = 2, .shards = 2, .stage = 3}, {}});
}

TEST_CASE("tensor-parallel checkpoints: the consolidated export at tp 2 x dp 2 stage 3 is one rank's file, byte for "
          "byte") {
  const std::string dir = "/tmp/zg_test_tp_export_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const auto exported = [&](const Layout& l, const std::string& path) {
    dist::run_local(std::max(l.tp, 1) * l.shards, [&](dist::ProcessGroup& world) {
      manual_seed(5);
      nn::GPT model(tiny_gpt(), kF64);
      dist::DeviceMesh mesh(world, {{"dp_shard", l.shards}, {"tp", std::max(l.tp, 1)}});
      if (l.tp > 0) dist::parallelize_module(model, mesh.group("tp"));
      dist::ShardedModel sharded(model, mesh, {.stage = l.stage, .compute_dtype = DType::f64});
      sharded.export_consolidated(path);
    });
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string one_rank = exported({}, dir + "/one.safetensors");
  CHECK(one_rank.size() > 100000);
  CHECK(exported({.tp = 2, .shards = 2, .stage = 3}, dir + "/tp2.safetensors") == one_rank);
  CHECK(exported({.tp = 4, .stage = 1}, dir + "/tp4.safetensors") == one_rank);
  std::filesystem::remove_all(dir);
}

TEST_CASE("tensor-parallel checkpoints: a save whose files disagree on a cut, or whose cut does not fit, is refused "
          "by name; a caller's split/ metadata key is refused") {
  const std::string dir = "/tmp/zg_test_tp_bad_cut_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const auto run = [&](const std::function<void(dist::ShardedModel&)>& fn) {
    dist::run_local(2, [&](dist::ProcessGroup& world) {
      manual_seed(5);
      nn::GPT model(tiny_gpt(), kF64);
      dist::DeviceMesh mesh(world, {{"dp_shard", 1}, {"tp", 2}});
      dist::parallelize_module(model, mesh.group("tp"));
      dist::ShardedModel sharded(model, mesh, {.stage = 1, .compute_dtype = DType::f64});
      fn(sharded);
    });
  };
  CHECK_THROWS_WITH_AS(run([&](dist::ShardedModel& m) { m.save(dir, {{"split/x", "0,1,2"}}); }),
                       doctest::Contains("the metadata key 'split/x' is one the checkpoint writes itself"), Error);
  run([&](dist::ShardedModel& m) { m.save(dir); });
  const std::string file1 = dist::ShardedModel::current_save(dir) + "/rank-00001-of-00002.safetensors";
  const std::string key = "split/transformer.h.0.attn.c_proj.weight";  // rowwise: [C, C] cut along dim 1
  REQUIRE(SafetensorsFile(file1).metadata().at(key) == "1,1,2");
  const auto with_cut = [&](const std::string& cut) {
    const SafetensorsFile file(file1);
    nn::NamedTensors content;
    for (const std::string& name : file.names()) content.emplace_back(name, file.read(name));
    Metadata meta = file.metadata();
    meta[key] = cut;
    save_safetensors(file1, content, meta);
  };
  with_cut("0,1,2");
  CHECK_THROWS_WITH_AS(run([&](dist::ShardedModel& m) { m.load(dir); }),
                       doctest::Contains("cuts 'transformer.h.0.attn.c_proj.weight' as 0,1,2 but an earlier file of "
                                         "the save as 1,1,2"),
                       Error);
  with_cut("2,1,2");
  CHECK_THROWS_WITH_AS(run([&](dist::ShardedModel& m) { m.load(dir); }),
                       doctest::Contains("metadata 'split/transformer.h.0.attn.c_proj.weight' is '2,1,2', not "
                                         "<dim>,<chunks>,<parts> of a cut that fits shape [32, 32]"),
                       Error);
  with_cut("1,1,2");
  run([&](dist::ShardedModel& m) { m.load(dir); });  // restored: it loads
  std::filesystem::remove_all(dir);
}

TEST_CASE("parallelize_module: a GPT cut at T = 1, 2, 4, sequence parallelism on and off, computes the one-rank "
          "loss, logits and gradients") {
  check_cut_model([] { return std::make_shared<nn::GPT>(tiny_gpt(), kF64); }, 64);
}

TEST_CASE("parallelize_module: a Llama with grouped-query attention, untied, tied and biased, cut at T = 1, 2, 4, "
          "sequence parallelism on and off, computes the one-rank loss, logits and gradients") {
  for (const std::pair<bool, bool> layout : {std::pair{false, false}, {true, false}, {false, true}}) {
    const bool tied = layout.first, biased = layout.second;
    INFO("tied " << tied << ", biased " << biased);  // colwise layers' biases cut with them, rowwise ones whole
    check_cut_model(
        [tied, biased] {
          auto model = std::make_shared<nn::Llama>(tiny_llama(tied, biased), kF64);
          NoGradGuard no_grad;  // biases start at 0: random ones show where each rank adds its part
          for (const auto& [name, p] : model->named_parameters())
            if (name.ends_with(".bias")) Tensor(p).copy_(randn(p.shape(), kF64) * 0.1);
          return model;
        },
        64);
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
    nn::GPTConfig dropping = tiny_gpt();
    dropping.dropout = 0.1;
    nn::GPT dropping_gpt(dropping, kF64);
    nn::ParallelPlan unnamed_dropouts = plan_of(dropping_gpt, true);  // GPT's plan without its sequence_dropout rules
    std::erase_if(unnamed_dropouts.rules, [](const nn::ParallelRule& r) {
      return r.style == nn::ParallelStyle::sequence_dropout;
    });
    CHECK_THROWS_WITH_AS(dist::parallelize_module(dropping_gpt, group, unnamed_dropouts),
                         "parallelize_module: transformer.h.0.attn.resid_dropout drops with p = 0.1 and no rule names "
                         "it: under sequence parallelism a dropout on sequence shards needs a sequence_dropout rule "
                         "(its mask is then the one-rank mask's rows); set its p to 0 if it drops something else",
                         Error);
    CHECK_THROWS_WITH_AS(dist::parallelize_module(dropping_gpt, group,
                                                  {.rules = {{"transformer.ln_f", nn::ParallelStyle::sequence_dropout}},
                                                   .sequence_parallel = true}),
                         "parallelize_module: transformer.ln_f (sequence_dropout): the module is not an nn::Dropout",
                         Error);
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
