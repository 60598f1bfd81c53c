// Hugging Face Llama-family checkpoints (nn/hf_llama.h): transformers' tiny models load and
// give its logits and greedy tokens; saves round-trip bit for bit, sharded or not; every
// field the model cannot honour is refused by name.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "helpers.h"
#include "nn/generate.h"
#include "nn/hf_gpt2.h"
#include "nn/hf_llama.h"

namespace zg::test {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// tests/fixtures/make_hf_llama.py wrote these, with transformers.
std::string fixture(const std::string& name) { return std::string(ZG_TEST_FIXTURES) + "/" + name; }

// A fresh folder under the temporary directory.
fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("zg-hf-llama-" + std::to_string(getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A copy of fixture `name` whose config.json `edit` changed.
std::string edited(const std::string& name, const std::function<void(json&)>& edit) {
  const fs::path dir = scratch(name + "-edited");
  fs::copy(fixture(name), dir, fs::copy_options::recursive);
  std::ifstream in(dir / "config.json");
  json config = json::parse(in);
  edit(config);
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir.string();
}

Tensor ids_of(const json& rows) {
  std::vector<int64_t> ids;
  for (const auto& row : rows)
    for (const auto& id : row) ids.push_back(id.get<int64_t>());
  return tensor<int64_t>(ids, {static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())});
}

std::unique_ptr<nn::Llama> load(const std::string& path, TensorOptions options = {}) {
  auto model = std::make_unique<nn::Llama>(nn::hf_llama_config(path), options);
  nn::load_hf_llama(*model, path);
  return model;
}

void check_identical_parameters(const nn::Llama& a, const nn::Llama& b) {
  const nn::NamedTensors pa = a.named_parameters(), pb = b.named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    CHECK(pa[i].first == pb[i].first);
    check_identical(pb[i].second, pa[i].second, pa[i].first);
  }
}

}  // namespace

TEST_CASE("Hugging Face Llama, Mistral, Qwen2 and Llama 3.1 checkpoints give transformers' logits and greedy tokens") {
  for (const char* name : {"hf_llama", "hf_mistral", "hf_qwen2", "hf_llama3"}) {
    INFO(name);
    std::ifstream in(fixture(name) + "/logits.json");
    const json want = json::parse(in);
    manual_seed(0);
    const auto model = load(fixture(name));
    model->eval();
    const Tensor ids = ids_of(want["ids"]);
    const Tensor logits = model->forward(ids, Tensor()).logits;
    std::vector<double> expected;
    for (const auto& row : want["logits"])
      for (const auto& position : row)
        for (const auto& v : position) expected.push_back(v.get<double>());
    CHECK(max(abs(logits.to(DType::f64) - tensor<double>(expected, logits.shape()))).item<double>() < 1e-5);
    const Tensor greedy = nn::generate(*model, ids, 8, {.temperature = 0});
    CHECK(greedy.to_vector<int64_t>() == ids_of(want["generated"]).to_vector<int64_t>());
  }
  const nn::LlamaConfig llama = nn::hf_llama_config(fixture("hf_llama"));  // sharded, GQA
  CHECK((llama.n_layer == 2 && llama.n_head == 4 && llama.n_kv_head == 2 && llama.n_embd == 32));
  CHECK((llama.intermediate_size == 48 && llama.vocab_size == 256 && llama.block_size == 64));
  CHECK((llama.rope_theta == 500000.0 && !llama.tie_embeddings && !llama.qkv_bias && !llama.attention_bias));
  const nn::LlamaConfig qwen2 = nn::hf_llama_config(fixture("hf_qwen2"));
  CHECK((qwen2.qkv_bias && !qwen2.attention_bias && qwen2.tie_embeddings));
  CHECK((qwen2.rope_scaling.type == nn::RopeScaling::Type::linear && qwen2.rope_scaling.factor == 2.0));
  const nn::LlamaConfig llama3 = nn::hf_llama_config(fixture("hf_llama3") + "/config.json");
  CHECK((llama3.attention_bias && llama3.mlp_bias && llama3.rope_scaling.type == nn::RopeScaling::Type::llama3));
  CHECK(llama3.rope_scaling.original_max_position_embeddings == 64);
}

TEST_CASE("rms_norm_eps comes from config.json: 1e-6 is 1e-6, not LlamaConfig's 1e-5 default") {
  CHECK(nn::LlamaConfig{}.norm_eps == 1e-5);
  CHECK(nn::hf_llama_config(fixture("hf_llama")).norm_eps == 1e-6);
  CHECK(nn::hf_llama_config(fixture("hf_mistral")).norm_eps == 1e-5);
  CHECK_THROWS_WITH_AS(nn::hf_llama_config(edited("hf_llama", [](json& c) { c.erase("rms_norm_eps"); })),
                       doctest::Contains("rms_norm_eps null is required"), Error);
}

TEST_CASE("save_hf_llama writes what load_hf_llama reads back bit for bit, sharded or not, in the model's dtype") {
  for (const char* name : {"hf_llama3", "hf_qwen2"}) {  // biases and scaled rope; q, k, v biases and a tied head
    INFO(name);
    const auto model = load(fixture(name));
    const fs::path dir = scratch("save");
    nn::save_hf_llama(*model, dir.string(), 20'000);  // ~30 KB a layer: shards
    std::set<std::string> shards;
    const json index = json::parse(std::ifstream(dir / "model.safetensors.index.json"));
    for (const auto& [_, shard] : index["weight_map"].items()) shards.insert(shard.get<std::string>());
    CHECK(shards.size() > 2);
    CHECK(shards.count("model-00001-of-0000" + std::to_string(shards.size()) + ".safetensors"));
    CHECK_FALSE(fs::exists(dir / "model.safetensors"));
    check_identical_parameters(*model, *load(dir.string()));
    nn::save_hf_llama(*model, dir.string());  // one file; the shards and their index are removed
    CHECK(fs::exists(dir / "model.safetensors"));
    CHECK_FALSE(fs::exists(dir / "model.safetensors.index.json"));
    for (const std::string& shard : shards) CHECK_FALSE(fs::exists(dir / shard));
    const nn::LlamaConfig again = nn::hf_llama_config(dir.string());
    CHECK(json::parse(nn::hf_llama_config_json(again)) == json::parse(nn::hf_llama_config_json(model->config)));
    check_identical_parameters(*model, *load(dir.string()));
    fs::remove_all(dir);
  }
  // bf16 weights are written as bf16 and convert on the way into an f32 model.
  const auto half = load(fixture("hf_mistral"), TensorOptions(DType::bf16));
  const fs::path dir = scratch("bf16");
  nn::save_hf_llama(*half, dir.string());
  CHECK(SafetensorsFile((dir / "model.safetensors").string()).entry("model.norm.weight").dtype == DType::bf16);
  CHECK(json::parse(std::ifstream(dir / "config.json"))["torch_dtype"] == "bfloat16");
  const auto wide = load(dir.string());
  for (size_t i = 0; i < wide->parameters().size(); ++i)
    CHECK(max_abs_diff(wide->parameters()[i], half->parameters()[i].to(DType::f32)) == 0.0);
  fs::remove_all(dir);
}

TEST_CASE("load_hf_llama reads one .safetensors file too: older files' rotary buffers are skipped, a tied head "
          "must equal the embedding") {
  const auto model = load(fixture("hf_qwen2"));  // tied
  nn::NamedTensors tensors = model->named_parameters();
  tensors.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", ones({4}));
  const fs::path dir = scratch("single");
  save_safetensors((dir / "old.safetensors").string(), tensors);
  nn::Llama again(model->config);
  nn::load_hf_llama(again, (dir / "old.safetensors").string());
  check_identical_parameters(*model, again);
  tensors.emplace_back("lm_head.weight", model->embed_tokens->weight + 1.0);
  save_safetensors((dir / "old.safetensors").string(), tensors);
  CHECK_THROWS_WITH_AS(nn::load_hf_llama(again, (dir / "old.safetensors").string()),
                       doctest::Contains("lm_head.weight differs from model.embed_tokens.weight"), Error);
  fs::remove_all(dir);
}

TEST_CASE("config.json fields nn::Llama cannot honour are refused, naming the field and its value") {
  const auto refused = [](const std::string& name, const std::function<void(json&)>& edit, const std::string& message) {
    INFO(message);
    CHECK_THROWS_WITH_AS(nn::hf_llama_config(edited(name, edit)), doctest::Contains(message.c_str()), Error);
  };
  const json yarn = {{"rope_type", "yarn"}, {"rope_theta", 1e4}, {"factor", 4.0}};
  const json dynamic = {{"type", "dynamic"}, {"factor", 2.0}};  // 4.x's spelling
  refused("hf_llama", [&](json& c) { c["rope_parameters"] = yarn; }, "rope_parameters.rope_type \"yarn\" is not supported");
  refused("hf_llama", [&](json& c) { c["rope_scaling"] = dynamic; }, "is given beside rope_parameters; keep one");
  refused("hf_llama", [&](json& c) { c.erase("rope_parameters"), c["rope_theta"] = 1e4, c["rope_scaling"] = dynamic; },
          "rope_scaling.rope_type \"dynamic\" is not supported");
  refused("hf_mistral", [](json& c) { c["sliding_window"] = 16; },
          "sliding_window 16 is in use and shorter than max_position_embeddings 64");
  refused("hf_mistral", [](json& c) { c.erase("sliding_window"), c["max_position_embeddings"] = 8192; },
          "sliding_window 4096 is in use");  // MistralConfig's default
  refused("hf_qwen2",
          [](json& c) { c["use_sliding_window"] = true, c["sliding_window"] = 8, c["layer_types"][1] = "sliding_attention"; },
          "sliding_window 8 is in use");
  refused("hf_llama", [](json& c) { c["head_dim"] = 16; },
          "hf_llama_config: " + scratch("hf_llama-edited").string() + "/config.json: head_dim 16 must be hidden_size / "
          "num_attention_heads (32 / 4), the head size nn::Llama has");
  refused("hf_llama", [](json& c) { c["hidden_act"] = "gelu"; }, "hidden_act \"gelu\" must be \"silu\"");
  refused("hf_llama", [](json& c) { c["attention_dropout"] = 0.1; }, "attention_dropout 0.1 must be 0");
  refused("hf_llama", [](json& c) { c["pretraining_tp"] = 2; }, "pretraining_tp 2 must be 1");
  refused("hf_llama", [](json& c) { c["quantization_config"] = {{"bits", 4}}; },
          "quantization_config {\"bits\":4} is a key nn::Llama does not know for model_type llama");
  refused("hf_mistral", [](json& c) { c["mlp_bias"] = true; }, "mlp_bias true is a key nn::Llama does not know");
  refused("hf_llama", [](json& c) { c["model_type"] = "gemma"; }, "model_type \"gemma\" is not a Llama-family model");
  refused("hf_llama", [](json& c) { c["architectures"] = {"LlamaForSequenceClassification"}; },
          "must be [\"LlamaForCausalLM\"] for model_type llama");
  // Unused windows are the plain attention: accepted.
  CHECK_NOTHROW(nn::hf_llama_config(edited("hf_qwen2", [](json& c) { c["sliding_window"] = 8; })));
  CHECK_NOTHROW(nn::hf_llama_config(edited("hf_mistral", [](json& c) { c["sliding_window"] = 64; })));
  fs::remove_all(scratch("hf_llama-edited")), fs::remove_all(scratch("hf_mistral-edited")),
      fs::remove_all(scratch("hf_qwen2-edited"));
}

TEST_CASE("a GPT-2 config.json alone gives the shape its weights give, and what nn::GPT cannot honour is refused") {
  const nn::GPTConfig from_json = nn::hf_gpt2_config_json(fixture("hf_gpt2"));
  const nn::GPTConfig from_weights = nn::hf_gpt2_config(fixture("hf_gpt2/model.safetensors"));
  CHECK(from_json.n_layer == from_weights.n_layer);
  CHECK(from_json.n_head == from_weights.n_head);
  CHECK(from_json.n_embd == from_weights.n_embd);
  CHECK(from_json.vocab_size == from_weights.vocab_size);
  CHECK(from_json.block_size == from_weights.block_size);
  CHECK(from_json.dropout == from_weights.dropout);
  const auto refused = [](const std::function<void(json&)>& edit, const std::string& message) {
    INFO(message);
    CHECK_THROWS_WITH_AS(nn::hf_gpt2_config_json(edited("hf_gpt2", edit)), doctest::Contains(message.c_str()), Error);
  };
  refused([](json& c) { c["activation_function"] = "relu"; }, "activation_function \"relu\" must be gelu_new");
  refused([](json& c) { c["n_inner"] = 100; }, "n_inner 100 must be null or 4 n_embd");
  refused([](json& c) { c["layer_norm_epsilon"] = 1e-6; }, "layer_norm_epsilon 1e-06 must be 1e-5");
  refused([](json& c) { c["scale_attn_by_inverse_layer_idx"] = true; }, "scale_attn_by_inverse_layer_idx true must be false");
  refused([](json& c) { c["attn_pdrop"] = 0.0; }, "but nn::GPT has one dropout for all three");
  refused([](json& c) { c["rotary"] = true; }, "rotary true is a key nn::GPT does not know");
  refused([](json& c) { c["model_type"] = "llama"; }, "model_type \"llama\" is not \"gpt2\"");
  refused([](json& c) { c.erase("n_head"); }, "n_head null is required");
  fs::remove_all(scratch("hf_gpt2-edited"));
}

TEST_CASE("weights that do not fit the model are refused, naming the tensor, and nothing is written") {
  const std::string dir = fixture("hf_llama");
  nn::LlamaConfig biased = nn::hf_llama_config(dir);
  biased.attention_bias = true;
  nn::Llama with_bias(biased);
  CHECK_THROWS_WITH_AS(nn::load_hf_llama(with_bias, dir),
                       doctest::Contains("has no tensor 'model.layers.0.self_attn.q_proj.bias'"), Error);
  nn::Llama plain(nn::hf_llama_config(dir));
  CHECK_THROWS_WITH_AS(nn::load_hf_llama(plain, fixture("hf_llama3")),
                       doctest::Contains("'model.layers.0.mlp.down_proj.bias' this Llama does not have"), Error);
  nn::LlamaConfig wider = nn::hf_llama_config(dir);
  wider.intermediate_size = 64;
  nn::Llama wide(wider);
  const Tensor before = wide.embed_tokens->weight.clone();
  CHECK_THROWS_WITH_AS(nn::load_hf_llama(wide, dir),
                       doctest::Contains("'model.layers.0.mlp.gate_proj.weight' is [48, 32] but the model's is "
                                         "f32[64, 32] on cpu"),
                       Error);
  CHECK(max_abs_diff(wide.embed_tokens->weight, before) == 0.0);  // read before the failure, not written
  const fs::path missing = scratch("shard");
  fs::copy(dir, missing, fs::copy_options::recursive);
  fs::remove(missing / "model-00002-of-00004.safetensors");
  CHECK_THROWS_WITH_AS(nn::load_hf_llama(plain, missing.string()),
                       doctest::Contains("names the shard model-00002-of-00004.safetensors"), Error);
  fs::remove_all(missing);
  dist::SingleRank one;
  dist::ShardedModel sharded(plain, one, {.compute_dtype = DType::f32});
  CHECK_THROWS_WITH_AS(nn::load_hf_llama(plain, dir), doctest::Contains("lives in the flat buffers of"), Error);
}

}  // namespace zg::test
