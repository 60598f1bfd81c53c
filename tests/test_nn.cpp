// nn: modules and names, the GPT model, activation checkpointing, Hugging Face GPT-2 files.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "nn/checkpoint.h"
#include "nn/hf_gpt2.h"
#include "tiny_gpt.h"

namespace zg::test {

TEST_CASE("GPT parameters carry Hugging Face GPT-2 names, in order") {
  manual_seed(0);
  const nn::GPT model(tiny_config());
  const auto named = model.named_parameters();
  std::vector<std::string> names;
  for (const auto& [name, p] : named) names.push_back(name);
  const std::vector<std::string> block0 = {
      "transformer.h.0.ln_1.weight",      "transformer.h.0.ln_1.bias",      "transformer.h.0.attn.c_attn.weight",
      "transformer.h.0.attn.c_attn.bias", "transformer.h.0.attn.c_proj.weight", "transformer.h.0.attn.c_proj.bias",
      "transformer.h.0.ln_2.weight",      "transformer.h.0.ln_2.bias",      "transformer.h.0.mlp.c_fc.weight",
      "transformer.h.0.mlp.c_fc.bias",    "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias"};
  REQUIRE(names.size() == 2 + 2 * 12 + 2);
  CHECK(names[0] == "transformer.wte.weight");
  CHECK(names[1] == "transformer.wpe.weight");
  CHECK(std::vector<std::string>(names.begin() + 2, names.begin() + 14) == block0);
  CHECK(names.back() == "transformer.ln_f.bias");
  CHECK(named[4].second.shape() == Shape{96, 32});  // c_attn: [3C, C]
  for (const auto& [name, p] : named) {
    CHECK(p.requires_grad());
    CHECK(p.storage()->category() == MemoryCategory::parameter);
  }
}

TEST_CASE("GPT-2 124M has 124,439,808 parameters (counted on the meta device)") {
  Context rank;
  ContextGuard guard(rank);
  nn::GPTConfig gpt2;  // the defaults are GPT-2 small
  const nn::GPT model(gpt2, kMeta);
  CHECK(model.num_parameters() == 124'439'808);
  CHECK(memory_stats(kMeta)[MemoryCategory::parameter] == 124'439'808 * 4);
}

TEST_CASE("GPT-2 initialisation: std 0.02, residual projections 0.02 / sqrt(2 n_layer)") {
  manual_seed(0);
  nn::GPTConfig config = tiny_config();
  config.n_embd = 64, config.n_layer = 8;
  const nn::GPT model(config);
  auto std_of = [](const Tensor& t) {
    const Tensor x = t.to(DType::f64);
    return std::sqrt(mean(pow(x - mean(x), 2.0)).item<double>());
  };
  for (const auto& [name, p] : model.named_parameters()) {
    const std::string& parameter = name;  // INFO's lambda cannot capture a structured binding (Clang)
    INFO(parameter);
    if (name.ends_with("c_proj.weight")) CHECK(std_of(p) == doctest::Approx(0.02 / 4).epsilon(0.05));
    else if (name.ends_with(".weight") && p.dim() == 2) CHECK(std_of(p) == doctest::Approx(0.02).epsilon(0.05));
    else if (name.ends_with("bias")) CHECK(max(abs(p)).item<double>() == 0.0);
    else CHECK(min(p).item<double>() == 1.0);  // norm weights
  }
}

TEST_CASE("nn::Linear starts as torch.nn.Linear: weight and bias U(-1/sqrt(in), 1/sqrt(in)); init_std gives N(0, std)") {
  manual_seed(0);
  const nn::Linear layer(400, 300);
  const double bound = 1.0 / std::sqrt(400.0);
  for (const Tensor& t : {layer.weight, layer.bias}) {
    CHECK(max(abs(t)).item<double>() <= bound);
    CHECK(max(abs(t)).item<double>() > 0.95 * bound);  // spread over the whole interval
  }
  // U(-b, b) has standard deviation b / sqrt(3): 120,000 draws give it to within 1%.
  CHECK(std(layer.weight).item<double>() == doctest::Approx(bound / std::sqrt(3.0)).epsilon(0.01));
  CHECK(std(layer.bias).item<double>() == doctest::Approx(bound / std::sqrt(3.0)).epsilon(0.1));
  const nn::Linear gpt_style(400, 300, true, 0.02);
  CHECK(std(gpt_style.weight).item<double>() == doctest::Approx(0.02).epsilon(0.01));
  CHECK(max(abs(gpt_style.bias)).item<double>() == 0.0);
  CHECK_THROWS_WITH_AS(nn::Linear(-1, 3), "Linear: in_features and out_features must be >= 0, got -1 and 3", Error);
}

TEST_CASE("module hooks, train/eval and conversions") {
  manual_seed(0);
  auto layer = std::make_shared<nn::Linear>(4, 3);
  int pre = 0, post = 0;
  layer->register_forward_pre_hook([&](nn::Module&, const Tensor&) { ++pre; return Tensor(); });
  layer->register_forward_hook([&](nn::Module&, const Tensor&, const Tensor& out) { ++post; return out * 2.0; });
  const Tensor x = randn({2, 4});
  const Tensor plain = matmul(x, layer->weight, false, true) + layer->bias;
  CHECK(pre == 0);
  const Tensor y = (*layer)(x);
  CHECK(pre == 1);
  CHECK(post == 1);
  check_close(y, Host::of(plain * 2.0), 1e-6, 1e-6, "hooked output");

  const Tensor held = layer->weight;  // a handle held elsewhere sees the conversion
  layer->to(DType::bf16);
  CHECK(held.dtype() == DType::bf16);
  CHECK(held.requires_grad());
  CHECK(held.storage()->category() == MemoryCategory::parameter);

  nn::GELU act;
  CHECK(act(tensor<float>({0, 100})).to_vector<float>() == std::vector<float>{0, 100});

  nn::Dropout drop(0.5);
  const Tensor ones_in = ones({1000});
  CHECK(drop(ones_in).to_vector<float>() != ones_in.to_vector<float>());
  drop.eval();
  CHECK(drop(ones_in).is_same(ones_in));
  CHECK_THROWS_WITH_AS(nn::Dropout(1.5), "Dropout: p must be in [0, 1], got 1.5", Error);
  // p = 1 drops everything, as in PyTorch: zeros, and a zero gradient (not 0 * 1/0 = NaN).
  const Tensor kept = ones({4}).set_requires_grad(true);
  const Tensor all_dropped = nn::Dropout(1.0)(kept);
  CHECK(all_dropped.to_vector<float>() == std::vector<float>(4, 0.0f));
  sum(all_dropped).backward();
  CHECK(kept.grad().to_vector<float>() == std::vector<float>(4, 0.0f));
}

TEST_CASE("a GPT memorises a 64-token sequence: loss below 0.05 within 300 AdamW steps") {
  for (Device device : devices()) {
    Context rank;
    ContextGuard guard(rank);
    TinyTrainer t(DType::f32, false, 1, 0, device);
    const Sequence s = fixed_sequence();
    double loss = 0;
    int step = 0;
    for (; step < 300; ++step) {
      loss = t.step(s, 1e-2);
      if (loss < 0.05) break;
    }
    MESSAGE("loss " << loss << " after " << step + 1 << " steps on " << device.str());
    CHECK(loss < 0.05);
  }
}

TEST_CASE("activation checkpointing: the same gradients, a lower activation peak") {
  const Sequence s = fixed_sequence();
  auto run = [&](bool checkpointing, std::vector<float>& grads) {
    Context rank;
    ContextGuard guard(rank);
    nn::GPTConfig config = tiny_config();
    config.n_layer = 4, config.dropout = 0.1, config.activation_checkpointing = checkpointing;
    manual_seed(5);
    nn::GPT model(config);
    dist::SingleRank one;  // gradients land in its flat buffers, made before the peak is reset
    dist::ShardedModel trainer(model, one, {.compute_dtype = DType::f32});
    rank.allocator(kCPU)->reset_peaks();
    {
      MemoryScope scope(MemoryCategory::activation);
      model.forward(s.inputs, s.targets).loss.backward();
    }
    grads = gradients_of(model);
    return memory_stats().peak_of(MemoryCategory::activation);
  };
  std::vector<float> plain, recomputed;
  const int64_t plain_peak = run(false, plain);
  const int64_t checkpoint_peak = run(true, recomputed);
  MESSAGE("activation peak: plain " << plain_peak << " B, checkpointed " << checkpoint_peak << " B");
  CHECK(checkpoint_peak < plain_peak);
  REQUIRE(plain.size() == recomputed.size());
  double worst = 0;
  for (size_t i = 0; i < plain.size(); ++i) worst = std::max(worst, std::fabs(double(plain[i]) - recomputed[i]));
  CHECK(worst <= 1e-6);
}

TEST_CASE("modules refuse names, trees, configs and inputs that would break them") {
  // Each of these crashed or misbehaved before (found by fuzzing): a 4-D input read past
  // the split's end; n_head 0 divided by zero; a module under itself recursed for ever.
  nn::GPTConfig config{.n_layer = 1, .n_head = 2, .n_embd = 8, .vocab_size = 16, .block_size = 8};
  nn::CausalSelfAttention attn(config, DType::f32);
  CHECK_THROWS_WITH_AS(attn(zeros({1, 2, 4, 8})), "CausalSelfAttention: expected input [B, T, 8], got f32[1, 2, 4, 8] on cpu",
                       Error);
  CHECK_THROWS_WITH_AS(attn(zeros({2, 8})), doctest::Contains("expected input [B, T, 8]"), Error);
  for (const auto& [bad, message] :
       {std::pair{nn::GPTConfig{.n_head = 0}, "every size in the config must be positive"},
        std::pair{nn::GPTConfig{.n_layer = 0}, "every size in the config must be positive"},
        std::pair{nn::GPTConfig{.n_head = 1, .n_embd = int64_t{1} << 62}, "4 n_embd overflows int64"},
        std::pair{nn::GPTConfig{.n_head = 5}, "n_embd 768 is not a multiple of n_head 5"},
        std::pair{nn::GPTConfig{.dropout = 1.0}, "dropout must be in [0, 1)"}}) {
    CHECK_THROWS_WITH_AS(nn::CausalSelfAttention(bad, kMeta), doctest::Contains(message), Error);
    CHECK_THROWS_WITH_AS(nn::MLP(bad, kMeta), doctest::Contains(message), Error);
    CHECK_THROWS_WITH_AS(nn::Block(bad, kMeta), doctest::Contains(message), Error);
    CHECK_THROWS_WITH_AS(nn::GPT(bad, kMeta), doctest::Contains(message), Error);
  }
  CHECK_THROWS_WITH_AS(nn::dropout(ones({4}), -0.5, true), "dropout: p must be in [0, 1], got -0.5", Error);
  CHECK_THROWS_WITH_AS(nn::dropout(ones({4}), std::nan(""), true), doctest::Contains("dropout: p must be"), Error);
  CHECK_THROWS_WITH_AS(nn::dropout(ones({4}, DType::i64), 0.5, true), doctest::Contains("expected a floating tensor"),
                       Error);

  auto root = std::make_shared<nn::Module>();
  auto child = root->register_module("child", std::make_shared<nn::Module>());
  CHECK_THROWS_WITH_AS(root->register_module("self", root), doctest::Contains("modules form a tree"), Error);
  CHECK_THROWS_WITH_AS(child->register_module("parent", root), doctest::Contains("modules form a tree"), Error);
  CHECK_THROWS_WITH_AS(root->register_module("", std::make_shared<nn::Module>()), doctest::Contains("invalid name ''"),
                       Error);
  CHECK_THROWS_WITH_AS(root->register_module("a.b", std::make_shared<nn::Module>()),
                       doctest::Contains("invalid name 'a.b'"), Error);
  root->register_buffer("steps", zeros({1}));
  CHECK_THROWS_WITH_AS(root->register_buffer("steps", zeros({1})), doctest::Contains("'steps' is already registered"),
                       Error);
  CHECK_THROWS_WITH_AS(root->register_parameter("child", zeros({1})), doctest::Contains("'child' is already registered"),
                       Error);
  CHECK_THROWS_WITH_AS(root->register_buffer("empty", Tensor()), "register_buffer: 'empty' is an undefined tensor", Error);
  nn::ModuleList list;
  list.push_back(std::make_shared<nn::Module>());
  CHECK_THROWS_WITH_AS(list[1], "ModuleList: index 1 is out of range for a list of 1", Error);
  CHECK(root->named_parameters().empty());  // the refused registrations left nothing behind
}

TEST_CASE("ModuleList's at<M> and ptr<M> give an item as its own class, or a clear error") {
  manual_seed(0);
  const nn::GPT model(tiny_config());
  // A user reached a block's members through dynamic_cast<nn::Block&>((*model.h)[0]).
  nn::Block& first = model.h->at<nn::Block>(0);
  CHECK(&first == &(*model.h)[0]);
  CHECK(first.attn->n_head == 2);
  const std::shared_ptr<nn::Block> second = model.h->ptr<nn::Block>(1);
  CHECK(second.get() == &(*model.h)[1]);
  CHECK(&model.h->at<nn::Module>(1) == second.get());  // a base class of the item's
  CHECK_THROWS_WITH_AS(model.h->at<nn::Linear>(0),
                       "ModuleList::at: item 0 of a list of 2 is a zg::nn::Block, not a zg::nn::Linear", Error);
  CHECK_THROWS_WITH_AS(model.h->ptr<nn::Linear>(1),
                       "ModuleList::ptr: item 1 of a list of 2 is a zg::nn::Block, not a zg::nn::Linear", Error);
  CHECK_THROWS_WITH_AS(model.h->at<nn::Block>(2), "ModuleList::at: index 2 is out of range for a list of 2", Error);
  CHECK_THROWS_WITH_AS(model.h->ptr<nn::Block>(2), "ModuleList::ptr: index 2 is out of range for a list of 2", Error);
}

TEST_CASE("Hugging Face GPT-2 files load with and without the transformer. prefix and give transformers' logits") {
  // tests/fixtures/make_hf_gpt2.py: a GPT2LMHeadModel of 2 layers, 2 heads, n_embd 16, 256 tokens.
  const std::string dir = std::string(ZG_TEST_FIXTURES) + "/hf_gpt2";
  std::ifstream in(dir + "/logits.json");
  const nlohmann::json fixture = nlohmann::json::parse(in);
  std::vector<int64_t> ids;
  std::vector<double> want;
  for (const auto& row : fixture["ids"])
    for (const auto& id : row) ids.push_back(id.get<int64_t>());
  for (const auto& row : fixture["logits"])
    for (const auto& position : row)
      for (const auto& v : position) want.push_back(v.get<double>());
  for (const char* file : {"model.safetensors", "bare.safetensors"}) {
    INFO(file);
    const nn::GPTConfig config = nn::hf_gpt2_config(dir + "/" + file);
    CHECK(config.n_layer == 2);
    CHECK(config.n_head == 2);  // from config.json
    CHECK(config.n_embd == 16);
    CHECK(config.vocab_size == 256);
    CHECK(config.block_size == 32);
    CHECK(config.dropout == 0.1);  // config.json's embd_pdrop, attn_pdrop, resid_pdrop (it was 0 whatever they said)
    manual_seed(0);
    nn::GPT model(config);
    nn::load_hf_gpt2(model, dir + "/" + file);
    model.eval();
    const Tensor logits = model.forward(tensor<int64_t>(ids, {2, 7}), Tensor()).logits;
    CHECK(max(abs(logits.to(DType::f64) - tensor<double>(want, {2, 7, 256}))).item<double>() < 1e-5);
  }
  // Written back in Conv1D's layout under GPT2LMHeadModel's names; read back the same.
  manual_seed(1);
  nn::GPT model(nn::hf_gpt2_config(dir + "/model.safetensors"));
  nn::load_hf_gpt2(model, dir + "/model.safetensors");
  const std::string path =
      (std::filesystem::temp_directory_path() / ("zg-hf-" + std::to_string(getpid()) + ".safetensors")).string();
  nn::save_hf_gpt2(model, path);
  {
    const SafetensorsFile saved(path);
    CHECK(saved.entry("transformer.h.0.attn.c_attn.weight").shape == Shape{16, 48});
    CHECK(saved.entry("transformer.h.1.mlp.c_proj.weight").shape == Shape{64, 16});
    CHECK_FALSE(saved.contains("lm_head.weight"));
  }
  manual_seed(2);
  nn::GPT again(model.config);
  nn::load_hf_gpt2(again, path);
  const std::vector<Tensor> before = model.parameters(), after = again.parameters();
  for (size_t i = 0; i < before.size(); ++i) CHECK(max(abs(before[i] - after[i])).item<double>() == 0.0);
  std::filesystem::remove(path);
  // Another shape is refused, naming the tensor.
  nn::GPTConfig deeper = model.config;
  deeper.n_layer = 3;
  nn::GPT wrong(deeper);
  CHECK_THROWS_WITH_AS(nn::load_hf_gpt2(wrong, dir + "/model.safetensors"),
                       doctest::Contains("has no tensor for 'transformer.h.2.ln_1.weight'"), Error);
  nn::GPTConfig wider = model.config;
  wider.n_embd = 32;
  nn::GPT wide(wider);
  CHECK_THROWS_WITH_AS(nn::load_hf_gpt2(wide, dir + "/model.safetensors"),
                       doctest::Contains("'transformer.wte.weight' is f32[256, 16] on cpu but the model's "
                                         "'transformer.wte.weight' is f32[256, 32] on cpu"),
                       Error);
  // Dropouts that nn::GPT's one cannot give are refused, naming them.
  const std::filesystem::path other =
      std::filesystem::temp_directory_path() / ("zg-hf-dropout-" + std::to_string(getpid()));
  std::filesystem::create_directories(other);
  std::filesystem::copy_file(dir + "/model.safetensors", other / "model.safetensors");
  std::ifstream config_in(dir + "/config.json");
  nlohmann::json config_json = nlohmann::json::parse(config_in);
  config_json["attn_pdrop"] = 0.0;
  std::ofstream(other / "config.json") << config_json.dump();
  CHECK_THROWS_WITH_AS(nn::hf_gpt2_config((other / "model.safetensors").string()),
                       doctest::Contains("config.json gives embd_pdrop 0.1, attn_pdrop 0 and resid_pdrop 0.1, but "
                                         "nn::GPT has one dropout for all three; make them equal there"),
                       Error);
  std::filesystem::remove_all(other);
}

TEST_CASE("dropout in bf16 rounds once and its backward keeps a bool mask: 1 byte an element, not an f32 mask") {
  manual_seed(4);
  Tensor x = randn({128, 256}).to(DType::bf16);
  x.set_requires_grad();
  const int64_t before = memory_stats().allocated_total;
  Tensor y = nn::dropout(x, 0.25, true);
  // y (bf16), the mask (bool) and the f32 factor 1/(1-p) remain; the f32 draws and x / (1 - p) are gone.
  CHECK(memory_stats().allocated_total - before == 128 * 256 * (2 + 1) + 4);
  const Tensor dropped = eq(y, 0.0);
  CHECK(max_abs_diff(y, masked_fill((x.to(DType::f32) / 0.75).to(DType::bf16), dropped, 0.0)) == 0.0);
  sum(y.to(DType::f32)).backward();
  CHECK(max_abs_diff(x.grad(), masked_fill(full({128, 256}, 1 / 0.75, DType::bf16), dropped, 0.0)) == 0.0);
}

TEST_CASE("a GPT's state dict as torch lists it (lm_head.weight beside transformer.wte.weight) loads strictly") {
  // nanoGPT's and transformers' state_dict() name the tied head weight lm_head.weight too;
  // nn::load_state refused such a file ("a tensor 'lm_head.weight' the module does not have").
  manual_seed(0);
  nn::GPT source(tiny_config());
  nn::NamedTensors state = source.named_parameters(/*remove_duplicates=*/false);
  REQUIRE(state.back().first == "lm_head.weight");
  CHECK(state.back().second.is_same(source.wte->weight));
  CHECK(source.named_parameters().size() == state.size() - 1);  // listed once where names do not matter
  int64_t every_name = 0;
  for (const auto& [_, p] : state) every_name += p.numel();
  CHECK(source.num_parameters() == every_name - source.wte->weight.numel());  // counted once
  for (const auto& entry : source.named_buffers()) state.push_back(entry);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("zg-lm-head-" + std::to_string(getpid()) + ".safetensors")).string();
  const Tensor idx = tensor<int64_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  source.eval();
  const Tensor want = source.forward(idx, Tensor()).logits;
  for (const bool with_wte : {true, false}) {
    INFO("transformer.wte.weight in the file: " << with_wte);
    nn::NamedTensors file = state;
    if (!with_wte) std::erase_if(file, [](const auto& e) { return e.first == "transformer.wte.weight"; });
    save_safetensors(path, file);
    manual_seed(1);
    nn::GPT model(tiny_config());
    nn::load_state(model, path);  // strict
    CHECK(model.lm_head->named_parameters()[0].second.is_same(model.wte->weight));  // still tied
    model.eval();
    CHECK(max(abs(model.forward(idx, Tensor()).logits - want)).item<double>() == 0.0);
  }
  // What save_state writes names the tied weight once, as Hugging Face's files do.
  nn::save_state(source, path);
  CHECK_FALSE(SafetensorsFile(path).contains("lm_head.weight"));
  std::filesystem::remove(path);
}

}  // namespace zg::test

// User code with both using-directives names the GPT block as plain Block. (The
// allocator's struct was zg::Block too, which made every such use ambiguous; it is
// zg::Allocation now.)
namespace user_code {
using namespace zg;
using namespace zg::nn;
static_assert(std::is_base_of_v<Module, Block>);
}  // namespace user_code
