// The program of docs/15-writing-models.md, compiled and run by the tests so the chapter
// stays true: an op of your own with its gradient checked, a layer of your own, a Llama
// trained, exported under Hugging Face's names, loaded back and made to generate, and
// the same Llama built already sharded on 2 ranks.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autograd/custom_op.h"
#include "autograd/gradcheck.h"
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/generate.h"
#include "nn/layers.h"
#include "nn/llama.h"
#include "nn/serialize.h"
#include "zerograd.h"

using namespace zg;

// squareplus(x) = (x + sqrt(x^2 + 4)) / 2, a smooth ReLU; its derivative is
// (1 + x / sqrt(x^2 + 4)) / 2, which reuses the square root the forward computed.
Tensor squareplus(const Tensor& x) {
  static const CustomOp op("squareplus");  // a name no other op has
  Tensor root, y;
  {
    NoGradGuard no_grad;  // the forward records nothing itself
    root = sqrt(x * x + 4.0);
    y = (x + root) * 0.5;
  }
  return op.apply(y, {x}, [x = SavedTensor(x), root = SavedTensor(root)](const Tensor& g) {
    return std::vector<Tensor>{g * (x.get("squareplus") / root.get("squareplus") + 1.0) * 0.5};
  });
}

// squareplus(x W^T + b) * gain: a layer, an op of our own and a parameter of our own.
struct ScaledSquareplus : nn::Module {
  std::shared_ptr<nn::Linear> fc;
  Tensor gain;
  ScaledSquareplus(int64_t in, int64_t out) {
    fc = register_module("fc", std::make_shared<nn::Linear>(in, out));
    gain = register_parameter("gain", ones({out}));
  }
  Tensor forward(const Tensor& x) override { return squareplus((*fc)(x)) * gain; }
};

// A tiny Llama and its data: rows that count up by 3 (mod 64) from a start that varies.
nn::LlamaConfig tiny_llama() {
  nn::LlamaConfig c;
  c.n_layer = 2, c.n_head = 4, c.n_kv_head = 2, c.n_embd = 32, c.vocab_size = 64, c.block_size = 32;
  return c;
}

std::pair<Tensor, Tensor> batch(int step) {
  std::vector<int64_t> ids;
  for (int64_t row = 0; row < 4; ++row)
    for (int64_t t = 0; t < 17; ++t) ids.push_back((5 * step + 11 * row + 3 * t) % 64);
  const Tensor tokens = tensor<int64_t>(ids, {4, 17});
  return {tokens.narrow(1, 0, 16).contiguous(), tokens.narrow(1, 1, 16).contiguous()};  // inputs, next tokens
}

void custom_op_section() {
  manual_seed(0);
  const GradcheckResult check = gradcheck([](const std::vector<Tensor>& in) { return squareplus(in[0]); },
                                          {randn({3, 4}, DType::f64).set_requires_grad(true)});
  std::printf("gradcheck(squareplus): %s\n", check.ok ? "ok" : check.message.c_str());

  ScaledSquareplus layer(3, 4);
  for (const auto& [name, p] : layer.named_parameters()) std::printf("  %-9s %s\n", name.c_str(), shape_str(p.shape()).c_str());
  layer.to(DType::f64);  // gradcheck's finite differences need f64 throughout
  const GradcheckResult whole = gradcheck([&layer](const std::vector<Tensor>& in) { return layer(in[0]); },
                                          {randn({2, 3}, DType::f64).set_requires_grad(true)});
  std::printf("gradcheck(layer): %s\n", whole.ok ? "ok" : whole.message.c_str());
}

void llama_section() {
  manual_seed(0);
  const nn::LlamaConfig config = tiny_llama();
  const std::string path = "/tmp/zg_own_model_" + std::to_string(::getpid()) + ".safetensors";
  {
    nn::Llama model(config);
    dist::SingleRank one;  // one device: the same training path as N ranks
    dist::ShardedModel trainer(model, one, {.compute_dtype = DType::f32});
    std::printf("Llama: %lld parameters, units:", (long long)model.num_parameters());
    for (const std::string& unit : model.unit_plan().units) std::printf(" %s", unit.c_str());
    std::printf("\n");
    for (int step = 1; step <= 40; ++step) {
      const auto [x, y] = batch(step % 8);
      trainer.zero_grad();
      const Tensor loss = model.forward(x, y).loss;
      loss.backward();
      trainer.step(1e-2);
      if (step == 1 || step % 20 == 0) std::printf("step %3d | loss %.4f\n", step, loss.item<double>());
    }
    trainer.export_consolidated(path);  // one safetensors file, Hugging Face's names
  }
  nn::Llama restored(config);
  nn::load_state(restored, path);  // strict: every name and shape must match
  const Tensor prompt = tensor<int64_t>(std::vector<int64_t>{5, 8, 11}, {1, 3});
  const Tensor text = nn::generate(restored, prompt, 8, {.temperature = 0});  // greedy
  std::printf("generate after 5 8 11:");
  for (int64_t token : text.to_vector<int64_t>()) std::printf(" %lld", (long long)token);
  std::printf("\n");
  std::filesystem::remove(path);
}

void sharded_section() {
  // One rank, built as usual: the weights the sharded build must reproduce.
  manual_seed(1);
  nn::Llama eager(tiny_llama());
  const nn::NamedTensors reference = eager.named_parameters();
  const int64_t psi = eager.num_parameters();
  std::vector<std::string> lines(2);
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    std::optional<nn::Llama> model;
    {
      DeferredInit nothing_allocated;  // parameters are recipes: no bytes yet
      model.emplace(tiny_llama());
    }
    dist::ShardedModel sharded(*model, pg, {.stage = 3});  // each rank fills its own shards
    const MemoryStats built = memory_stats();
    const int64_t states = built[MemoryCategory::parameter] + built[MemoryCategory::gradient] +
                           built[MemoryCategory::optimizer_state];
    const nn::NamedTensors weights = sharded.consolidated_state();  // gathered: a collective
    bool same = weights.size() == reference.size();
    for (size_t i = 0; same && i < weights.size(); ++i)
      same = weights[i].first == reference[i].first && sum(ne(weights[i].second, reference[i].second)).item<int64_t>() == 0;
    char line[160];
    std::snprintf(line, sizeof line, "rank %d of 2: model states %lld B (16 x %lld / 2), peak while building %lld B; weights %s",
                  pg.rank(), (long long)states, (long long)psi, (long long)built.peak_total,
                  same ? "equal the eager build's" : "differ");
    lines[static_cast<size_t>(pg.rank())] = line;  // printed in rank order below
  });
  for (const std::string& line : lines) std::printf("%s\n", line.c_str());
}

// --figure FILE: the two ways to build, as a dry run on the meta device at a size where
// it matters -- Llama 2 7B's shape, rank 0 of 8 at ZeRO-3 -- each followed by one training
// step, recorded and drawn on one scale. Eager: every f32 weight allocated whole, then
// sharded. Deferred: nothing until the ShardedModel fills this rank's shards.
MemoryPanel build_and_step(bool deferred) {
  nn::LlamaConfig config;
  config.n_layer = 32, config.n_head = 32, config.n_kv_head = 32, config.n_embd = 4096;
  config.intermediate_size = 11008, config.vocab_size = 32000, config.block_size = 4096;
  Context rank0(0);
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, 8);  // rank 0 of 8: moves nothing, counts everything
  MemoryTimeline timeline;
  std::optional<nn::Llama> model;
  std::optional<dist::ShardedModel> sharded;
  {
    MemoryTimelineRecording recording(timeline);
    if (deferred) {
      DeferredInit nothing_allocated;
      model.emplace(config, TensorOptions().device(kMeta));
    } else {
      model.emplace(config, TensorOptions().device(kMeta));
    }
    sharded.emplace(*model, group, dist::ZeroConfig{.stage = 3, .compute_dtype = DType::bf16});
    const Tensor tokens = zeros({1, 1024}, TensorOptions(DType::i64).device(kMeta));
    sharded->zero_grad();
    {
      MemoryScope scope(MemoryCategory::activation);
      model->forward(tokens, tokens).loss.backward();
    }
    sharded->step(1e-4);
  }
  const int64_t formula = 16 * model->num_parameters() / 8;  // 16Ψ/N: ZeRO-3's model states
  return {deferred ? "deferred: each rank fills its own shards" : "eager: the whole model, then sharded",
          memory_series(timeline, 0, kMeta), {{"16Ψ/8", formula}}};
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--figure") {
    std::ofstream out(argv[2]);
    out << memory_figure_svg({build_and_step(false), build_and_step(true)},
                             "Llama 2 7B's shape at ZeRO-3, rank 0 of 8, bf16 compute: built, then one step");
    if (!out.flush()) {
      std::fprintf(stderr, "own_model: cannot write %s\n", argv[2]);
      return 1;
    }
    std::printf("wrote %s\n", argv[2]);
    return 0;
  }
  if (argc != 1) {
    std::fprintf(stderr, "usage: own_model [--figure FILE]\n");
    return 1;
  }
  custom_op_section();
  llama_section();
  sharded_section();
}
