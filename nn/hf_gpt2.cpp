#include "nn/hf_gpt2.h"
#include "nn/hf_config.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "autograd/graph.h"
#include "nn/hf_weights.h"
#include "tensor/safetensors.h"

namespace zg::nn {

namespace {

constexpr const char* kPrefix = "transformer.";

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// Conv1D weights, [in, out] in the file.
bool is_conv1d(const std::string& name) {
  for (const char* layer : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (ends_with(name, layer)) return true;
  return false;
}

// The buffers older files carry (the causal mask), not weights.
bool is_mask_buffer(const std::string& name) { return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias"); }

// Our name of a file's tensor ("" for lm_head.weight, a name of wte).
std::string our_name(const std::string& name) {
  if (name == "lm_head.weight") return "";
  return starts_with(name, kPrefix) ? name : kPrefix + name;
}

// The file's tensors by our names, Conv1D weights transposed to [out, in].
std::map<std::string, std::string> names_by_ours(const SafetensorsFile& file) {
  std::map<std::string, std::string> by_ours;
  for (const std::string& name : file.names()) {
    if (is_mask_buffer(name)) continue;
    const std::string ours = our_name(name);
    if (!ours.empty()) {
      ZG_CHECK(by_ours.emplace(ours, name).second, "load_hf_gpt2: ", file.path(), " holds '", name, "' twice (with and ",
               "without the transformer. prefix)");
    }
  }
  if (file.contains("lm_head.weight") && !by_ours.count("transformer.wte.weight"))
    by_ours["transformer.wte.weight"] = "lm_head.weight";
  return by_ours;
}

Tensor read_as_ours(const SafetensorsFile& file, const std::string& name) {
  const Tensor t = file.read(name);
  return is_conv1d(name) ? t.t().contiguous() : t;
}

// GPT2Config's three dropout probabilities (transformers' default 0.1 for one not given),
// as nn::GPT's one: refused where they differ.
double dropout_of(const nlohmann::json& json, const std::string& json_path) {
  double p[3] = {0.1, 0.1, 0.1};
  const char* names[3] = {"embd_pdrop", "attn_pdrop", "resid_pdrop"};
  for (int i = 0; i < 3; ++i) {
    if (!json.contains(names[i])) continue;
    ZG_CHECK(json[names[i]].is_number(), "hf_gpt2_config: ", json_path, ": ", names[i], " is not a number");
    p[i] = json[names[i]].get<double>();
  }
  ZG_CHECK(p[0] == p[1] && p[1] == p[2], "hf_gpt2_config: ", json_path, " gives embd_pdrop ", p[0], ", attn_pdrop ",
           p[1], " and resid_pdrop ", p[2], ", but nn::GPT has one dropout for all three; make them equal there");
  return p[0];
}

}  // namespace

GPTConfig hf_gpt2_config(const std::string& path, int64_t n_head) {
  const SafetensorsFile file(path);
  const std::map<std::string, std::string> names = names_by_ours(file);
  const auto shape_of = [&](const std::string& ours) {
    const auto it = names.find(ours);
    ZG_CHECK(it != names.end(), "hf_gpt2_config: ", path, " has no '", ours, "' (nor without the prefix): not a GPT-2 file");
    return file.entry(it->second).shape;
  };
  GPTConfig config;
  const Shape wte = shape_of("transformer.wte.weight"), wpe = shape_of("transformer.wpe.weight");
  ZG_CHECK(wte.size() == 2 && wpe.size() == 2, "hf_gpt2_config: ", path, ": wte and wpe must be matrices");
  config.vocab_size = wte[0], config.n_embd = wte[1], config.block_size = wpe[0];
  config.n_layer = 0;
  while (names.count("transformer.h." + std::to_string(config.n_layer) + ".ln_1.weight")) ++config.n_layer;
  const std::filesystem::path json_path = std::filesystem::path(path).parent_path() / "config.json";
  if (std::filesystem::is_regular_file(json_path)) {
    std::ifstream in(json_path);
    const nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    ZG_CHECK(json.is_object() && json.contains("n_head") && json["n_head"].is_number_integer(), "hf_gpt2_config: ",
             json_path.string(), " has no whole number n_head");
    const int64_t from_json = json["n_head"].get<int64_t>();
    ZG_CHECK(n_head == 0 || n_head == from_json, "hf_gpt2_config: n_head ", n_head, " was asked for but ",
             json_path.string(), " says ", from_json);
    n_head = from_json;
    config.dropout = dropout_of(json, json_path.string());
  }
  ZG_CHECK(n_head > 0, "hf_gpt2_config: ", path, " has no config.json beside it to give n_head; pass the head count");
  config.n_head = n_head;
  check_config(config);
  return config;
}

GPTConfig hf_gpt2_config_json(const std::string& path) {
  const HfConfigReader r("hf_gpt2_config_json", path);
  if (r.get("model_type") != "gpt2") r.refuse("model_type", r.get("model_type"), "is not \"gpt2\"");
  for (const nlohmann::json& arch : r.get("architectures"))  // null: an empty loop
    if (arch != "GPT2LMHeadModel" && arch != "GPT2Model")
      r.refuse("architectures", r.get("architectures"), "must be GPT2LMHeadModel or GPT2Model: other heads are not an nn::GPT");
  static const std::set<std::string> known = {
      "n_layer", "n_head", "n_embd", "vocab_size", "n_positions", "n_ctx", "n_inner", "activation_function",
      "layer_norm_epsilon", "embd_pdrop", "attn_pdrop", "resid_pdrop", "scale_attn_weights",
      "scale_attn_by_inverse_layer_idx", "add_cross_attention", "tie_word_embeddings", "reorder_and_upcast_attn",
      "initializer_range"};
  static const std::set<std::string> ignored = {
      "_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "model_type", "dtype",
      "torch_dtype", "transformers_version", "use_cache", "summary_type", "summary_use_proj", "summary_activation",
      "summary_proj_to_labels", "summary_first_dropout", "task_specific_params"};
  r.check_keys({&known, &ignored}, "nn::GPT does not know");
  GPTConfig c;
  c.n_layer = r.size("n_layer"), c.n_head = r.size("n_head"), c.n_embd = r.size("n_embd");
  c.vocab_size = r.size("vocab_size"), c.block_size = r.size("n_positions");
  if (r.size("n_ctx", c.block_size) != c.block_size) r.refuse("n_ctx", r.get("n_ctx"), "must equal n_positions");
  if (r.has("n_inner") && !r.get("n_inner").is_null() && r.size("n_inner") != 4 * c.n_embd)
    r.refuse("n_inner", r.get("n_inner"), "must be null or 4 n_embd, nn::GPT's MLP width");
  const nlohmann::json activation = r.has("activation_function") ? r.get("activation_function") : "gelu_new";
  if (activation != "gelu_new" && activation != "gelu_pytorch_tanh")
    r.refuse("activation_function", activation, "must be gelu_new (the tanh GELU nn::GPT computes)");
  if (r.number("layer_norm_epsilon", 1e-5) != 1e-5)
    r.refuse("layer_norm_epsilon", r.get("layer_norm_epsilon"), "must be 1e-5, nn::GPT's layer norms'");
  for (const auto& [key, want] : {std::pair{"scale_attn_weights", true}, {"scale_attn_by_inverse_layer_idx", false},
                                  {"add_cross_attention", false}, {"tie_word_embeddings", true}})
    if (r.flag(key, want) != want) r.refuse(key, r.get(key), std::string("must be ") + (want ? "true" : "false") +
                                                             " for nn::GPT");
  c.dropout = dropout_of(r.config(), path);
  check_config(c);
  return c;
}

void load_hf_gpt2(GPT& model, const std::string& path) {
  const SafetensorsFile file(path);
  const std::map<std::string, std::string> names = names_by_ours(file);
  NamedTensors to_write;
  refuse_owned_parameters(model, "load_hf_gpt2");
  for (const auto& [ours, param] : model.named_parameters()) {
    const auto it = names.find(ours);
    ZG_CHECK(it != names.end(), "load_hf_gpt2: ", path, " has no tensor for '", ours, "'");
    const Tensor value = read_as_ours(file, it->second);
    ZG_CHECK(value.shape() == param.shape() && is_floating(value.dtype()), "load_hf_gpt2: ", path, ": '", it->second,
             "' is ", describe(value), is_conv1d(it->second) ? " (transposed from Conv1D's [in, out])" : "",
             " but the model's '", ours, "' is ", describe(param));
    to_write.emplace_back(ours, value);
  }
  std::set<std::string> used;
  for (const auto& [ours, _] : to_write) used.insert(names.at(ours));
  for (const std::string& name : file.names()) {
    if (used.count(name) || is_mask_buffer(name)) continue;
    if (name == "lm_head.weight") {  // tied: must be wte
      const Tensor head = file.read(name), wte = read_as_ours(file, names.at("transformer.wte.weight"));
      ZG_CHECK(same_values(head, wte), "load_hf_gpt2: ", path, ": lm_head.weight differs from wte, but nn::GPT ties them");
      continue;
    }
    fail("load_hf_gpt2: ", path, " has a tensor '", name, "' a GPT-2 of this shape does not have");
  }
  NoGradGuard no_grad;
  const NamedTensors params = model.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) Tensor(params[i].second).copy_(to_write[i].second);
}

void save_hf_gpt2(const GPT& model, const std::string& path) {
  NamedTensors out;
  for (const auto& [name, param] : model.named_parameters()) {
    const Tensor value = param.to(kCPU).to(DType::f32);
    out.emplace_back(name, is_conv1d(name) ? value.t().contiguous() : value.contiguous());
  }
  save_safetensors(path, out, {{"format", "pt"}});
}

}  // namespace zg::nn
