#include "nn/hf_llama.h"

#include <filesystem>
#include <set>

#include "nn/hf_weights.h"
#include "tensor/atomic_file.h"

namespace zg::nn {

namespace {

constexpr const char* kEmbedding = "model.embed_tokens.weight";

// The rotary tables older transformers saved with each layer: made from the config, not weights.
bool is_rotary_buffer(const std::string& name) { return name.ends_with(".rotary_emb.inv_freq"); }

// transformers' name of a dtype, for config.json's torch_dtype.
std::string torch_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::f64: return "float64";
    default: fail("save_hf_llama: parameters of dtype ", name(dtype), " have no Hugging Face config; use a floating dtype");
  }
}

}  // namespace

void load_hf_llama(Llama& model, const std::string& path) {
  constexpr const char* who = "load_hf_llama";
  refuse_owned_parameters(model, who);
  const HfWeights weights(path, who);
  const NamedTensors params = model.named_parameters();
  std::set<std::string> expected;
  for (const auto& [name, param] : params) {  // all checked before anything is written
    ZG_CHECK(weights.contains(name), who, ": ", path, " has no tensor '", name, "'; its config.json and weights do not ",
             "match this model");
    const SafetensorsFile& file = weights.file_of(name);
    ZG_CHECK(file.entry(name).shape == param.shape(), who, ": ", file.path(), ": '", name, "' is ",
             shape_str(file.entry(name).shape), " but the model's is ", describe(param),
             "; build the model from the checkpoint's config (hf_llama_config)");
    file.check_readable_into(name, param);
    expected.insert(name);
  }
  for (const std::string& name : weights.names()) {
    if (expected.count(name) || is_rotary_buffer(name)) continue;
    if (name == "lm_head.weight" && model.config.tie_embeddings) {
      ZG_CHECK(same_values(weights.file_of(name).read(name), weights.file_of(kEmbedding).read(kEmbedding)), who, ": ",
               weights.file_of(name).path(), ": lm_head.weight differs from ", kEmbedding, ", but the model ties them ",
               "(tie_embeddings); build it with tie_embeddings false");
      continue;
    }
    fail(who, ": ", weights.file_of(name).path(), " has a tensor '", name, "' this Llama does not have; its ",
         "config.json and weights do not match this model");
  }
  for (const auto& [name, param] : params) weights.file_of(name).read_into(name, param);
}

void save_hf_llama(const Llama& model, const std::string& folder, int64_t max_shard_bytes) {
  constexpr const char* who = "save_hf_llama";
  refuse_owned_parameters(model, who);
  const NamedTensors params = model.named_parameters();
  const DType dtype = params.front().second.dtype();
  for (const auto& [param_name, param] : params)
    ZG_CHECK(param.dtype() == dtype, who, ": '", param_name, "' is ", describe(param), " but '", params.front().first,
             "' is ", name(dtype), "; config.json gives one dtype for all, so convert the model to one first");
  const std::string config = hf_llama_config_json(model.config, torch_name(dtype));
  save_hf_weights(folder, params, max_shard_bytes, who);
  write_file_atomically((std::filesystem::path(folder) / "config.json").string(), config, who);
}

}  // namespace zg::nn
