// config.json <-> LlamaConfig (nn/hf_llama.h lists the keys and what each may be).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <nlohmann/json.hpp>

#include "nn/hf_llama.h"
#include "nn/hf_config.h"

namespace zg::nn {

namespace {

using nlohmann::json;
using Reader = HfConfigReader;

struct Family {
  const char* model_type;
  const char* architecture;
  std::set<std::string> keys;  // its own, beside kCommon
};

// The keys every family's config may hold; those that do not change the forward pass.
const std::set<std::string> kCommon = {"hidden_size",     "num_hidden_layers",   "num_attention_heads",
                                       "num_key_value_heads", "intermediate_size", "vocab_size",
                                       "max_position_embeddings", "rms_norm_eps", "rope_theta",
                                       "rope_scaling",    "rope_parameters",     "head_dim",
                                       "tie_word_embeddings", "initializer_range", "hidden_act",
                                       "attention_dropout"};
const std::set<std::string> kIgnored = {"_name_or_path", "architectures", "bos_token_id", "dtype",
                                        "eos_token_id",  "model_type",    "pad_token_id", "torch_dtype",
                                        "transformers_version", "use_cache"};
const Family kFamilies[] = {
    {"llama", "LlamaForCausalLM", {"attention_bias", "mlp_bias", "pretraining_tp"}},
    {"mistral", "MistralForCausalLM", {"sliding_window"}},
    {"qwen2", "Qwen2ForCausalLM", {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}},
};

const Family& family_of(const Reader& r) {
  const json type = r.get("model_type");
  for (const Family& f : kFamilies) {
    if (type != f.model_type) continue;
    for (const json& arch : r.get("architectures"))  // null: an empty loop
      if (arch != f.architecture)
        r.refuse("architectures", r.get("architectures"), std::string("must be [\"") + f.architecture +
                                                              "\"] for model_type " + f.model_type +
                                                              "; other heads are not an nn::Llama");
    r.check_keys({&kCommon, &kIgnored, &f.keys}, std::string("nn::Llama does not know for model_type ") + f.model_type);
    return f;
  }
  r.refuse("model_type", type, "is not a Llama-family model; expected \"llama\", \"mistral\" or \"qwen2\"");
}

// The rope's theta and scaling: 4.x's rope_theta and rope_scaling, or 5.x's rope_parameters
// (one dict with rope_theta in it).
void read_rope(const Reader& r, LlamaConfig& c) {
  const json scaling = r.get("rope_scaling"), params = r.get("rope_parameters");
  if (!scaling.is_null() && !params.is_null())
    r.refuse("rope_scaling", scaling, "is given beside rope_parameters; keep one");
  const std::string where = scaling.is_null() ? "rope_parameters" : "rope_scaling";
  const json rope = scaling.is_null() ? params : scaling;
  if (!rope.is_null() && !rope.is_object()) r.refuse(where, rope, "must be an object");
  const json theta = !r.get("rope_theta").is_null() ? r.get("rope_theta")
                     : rope.contains("rope_theta")    ? rope["rope_theta"]
                                                      : json();
  if (!theta.is_number() || theta.get<double>() <= 0)
    r.refuse("rope_theta", theta, "must be a positive number (rope_theta, or rope_parameters.rope_theta)");
  if (rope.contains("rope_theta") && rope["rope_theta"] != theta)
    r.refuse(where + ".rope_theta", rope["rope_theta"], "differs from rope_theta; keep one");
  c.rope_theta = theta.get<double>();
  if (rope.is_null()) return;
  const json type = rope.contains("rope_type") ? rope["rope_type"] : rope.value("type", json("default"));
  std::set<std::string> keys = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
  if (type == "linear") {
    c.rope_scaling.type = RopeScaling::Type::linear;
    keys.insert("factor");
  } else if (type == "llama3") {
    c.rope_scaling.type = RopeScaling::Type::llama3;
    keys.insert({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
  } else if (type != "default") {
    r.refuse(where + ".rope_type", type, "is not supported; nn::Llama has \"default\", \"linear\" and \"llama3\"");
  }
  for (const auto& [key, value] : rope.items())
    if (!keys.count(key))
      r.refuse(where + "." + key, value, "is not a key of rope_type " + type.dump() + " nn::Llama knows");
  const auto number = [&](const char* key, std::optional<double> fallback = std::nullopt) {
    const json v = rope.contains(key) ? rope[key] : fallback ? json(*fallback) : json();
    if (!v.is_number() || v.get<double>() <= 0) r.refuse(where + "." + key, v, "must be a positive number");
    return v.get<double>();
  };
  if (number("partial_rotary_factor", 1.0) != 1.0)
    r.refuse(where + ".partial_rotary_factor", rope["partial_rotary_factor"], "must be 1: nn::Llama rotates whole heads");
  if (c.rope_scaling.type == RopeScaling::Type::none) return;
  c.rope_scaling.factor = number("factor");
  if (c.rope_scaling.type != RopeScaling::Type::llama3) return;
  c.rope_scaling.low_freq_factor = number("low_freq_factor");
  c.rope_scaling.high_freq_factor = number("high_freq_factor");
  const double context = number("original_max_position_embeddings", static_cast<double>(c.block_size));
  c.rope_scaling.original_max_position_embeddings = static_cast<int64_t>(context);
}

// Mistral's and Qwen2's sliding window: nn::Llama attends to every earlier token, which is
// the window's attention only where the window is not in use or spans block_size.
void check_window(const Reader& r, const Family& f, const LlamaConfig& c) {
  if (!f.keys.count("sliding_window")) return;
  const json window = r.has("sliding_window") ? r.get("sliding_window") : json(4096);  // both classes' default
  bool used = !window.is_null();
  if (used && !window.is_number_integer()) r.refuse("sliding_window", window, "must be a whole number or null");
  if (f.keys.count("use_sliding_window")) {  // Qwen2: the sliding layers' window, with use_sliding_window
    used = used && r.flag("use_sliding_window", false);
    const json types = r.get("layer_types"), first_sliding = r.get("max_window_layers");
    if (!types.is_null()) {  // transformers 5: each layer's type
      if (!types.is_array() || static_cast<int64_t>(types.size()) != c.n_layer)
        r.refuse("layer_types", types, "must list num_hidden_layers attention types");
      for (const json& type : types)
        if (type != "full_attention" && type != "sliding_attention")
          r.refuse("layer_types", types, "may hold only \"full_attention\" and \"sliding_attention\"");
      used = used && std::count(types.begin(), types.end(), json("sliding_attention")) > 0;
    } else {  // 4.x: the layers from max_window_layers on slide
      if (!first_sliding.is_null() && (!first_sliding.is_number_integer() || first_sliding.get<int64_t>() < 0))
        r.refuse("max_window_layers", first_sliding, "must be a whole number >= 0");
      const int64_t first = first_sliding.is_null() ? 28 : first_sliding.get<int64_t>();  // Qwen2Config's default
      used = used && c.n_layer > first;
    }
  }
  if (used && window.get<int64_t>() < c.block_size)
    r.refuse("sliding_window", window, "is in use and shorter than max_position_embeddings " +
                                           std::to_string(c.block_size) + ", but nn::Llama has no sliding-window "
                                           "attention, so it would compute another model");
}

}  // namespace

LlamaConfig hf_llama_config(const std::string& path) {
  const Reader r("hf_llama_config", path);
  const Family& family = family_of(r);
  LlamaConfig c;
  c.n_embd = r.size("hidden_size");
  c.n_layer = r.size("num_hidden_layers");
  c.n_head = r.size("num_attention_heads");
  c.n_kv_head = r.size("num_key_value_heads", c.n_head);
  c.intermediate_size = r.size("intermediate_size");
  c.vocab_size = r.size("vocab_size");
  c.block_size = r.size("max_position_embeddings");
  c.norm_eps = r.number("rms_norm_eps");
  c.tie_embeddings = r.flag("tie_word_embeddings", false);
  c.init_std = r.number("initializer_range", 0.02);
  if (c.n_embd % c.n_head != 0 || r.size("head_dim", c.n_embd / c.n_head) != c.n_embd / c.n_head)
    r.refuse("head_dim", r.get("head_dim"), "must be hidden_size / num_attention_heads (" + std::to_string(c.n_embd) +
                                                " / " + std::to_string(c.n_head) + "), the head size nn::Llama has");
  const json act = r.has("hidden_act") ? r.get("hidden_act") : json("silu");
  if (act != "silu") r.refuse("hidden_act", act, "must be \"silu\", the SwiGLU nn::Llama has");
  if (r.number("attention_dropout", 0.0) != 0)
    r.refuse("attention_dropout", r.get("attention_dropout"), "must be 0: nn::Llama has no attention dropout");
  if (!r.get("pretraining_tp").is_null() && r.get("pretraining_tp") != 1)
    r.refuse("pretraining_tp", r.get("pretraining_tp"), "must be 1 (null): nn::Llama does not slice its projections");
  read_rope(r, c);
  check_window(r, family, c);
  c.attention_bias = r.flag("attention_bias", false);
  c.mlp_bias = r.flag("mlp_bias", false);
  c.qkv_bias = std::string(family.model_type) == "qwen2";  // Qwen2's q, k and v always have biases
  check_config(c);
  return c;
}

std::string hf_llama_config_json(const LlamaConfig& c, const std::string& dtype) {
  check_config(c);
  const bool qwen2 = c.qkv_bias && !c.attention_bias;
  ZG_CHECK(!(qwen2 && c.mlp_bias), "save_hf_llama: q, k and v biased but not o_proj is Qwen2's attention, and Qwen2 ",
           "has no mlp_bias; transformers has no class for this model, so no config.json can describe it");
  json config = {{"architectures", json::array({qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"})},
                 {"model_type", qwen2 ? "qwen2" : "llama"},
                 {"hidden_size", c.n_embd},
                 {"num_hidden_layers", c.n_layer},
                 {"num_attention_heads", c.n_head},
                 {"num_key_value_heads", c.n_kv_head},
                 {"head_dim", c.n_embd / c.n_head},
                 {"intermediate_size", intermediate_size(c)},
                 {"vocab_size", c.vocab_size},
                 {"max_position_embeddings", c.block_size},
                 {"rms_norm_eps", c.norm_eps},
                 {"rope_theta", c.rope_theta},
                 {"rope_scaling", nullptr},
                 {"tie_word_embeddings", c.tie_embeddings},
                 {"initializer_range", c.init_std},
                 {"hidden_act", "silu"},
                 {"attention_dropout", 0.0},
                 {"torch_dtype", dtype}};
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScaling::Type::linear) config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", s.factor}};
  if (s.type == RopeScaling::Type::llama3)
    config["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", s.factor},
                              {"low_freq_factor", s.low_freq_factor},
                              {"high_freq_factor", s.high_freq_factor},
                              {"original_max_position_embeddings", s.original_max_position_embeddings}};
  if (qwen2) {
    config.update({{"use_sliding_window", false}, {"sliding_window", nullptr}});
  } else {
    config.update({{"attention_bias", c.attention_bias}, {"mlp_bias", c.mlp_bias}, {"pretraining_tp", 1}});
  }
  return config.dump(2) + "\n";
}

}  // namespace zg::nn
