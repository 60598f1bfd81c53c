#include "nn/hf_weights.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <nlohmann/json.hpp>

#include "autograd/functions.h"
#include "autograd/graph.h"
#include "tensor/atomic_file.h"

namespace zg::nn {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSingle = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";

std::string shard_name(size_t i, size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i, n);
  return name;
}

// The index's weight_map as {shard file: its tensors}.
std::map<std::string, std::set<std::string>> read_index(const fs::path& index, const std::string& who) {
  std::ifstream in(index);
  const nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ZG_CHECK(json.is_object() && json.contains("weight_map") && json["weight_map"].is_object(), who, ": ",
           index.string(), " is not a safetensors index (a JSON object with a \"weight_map\" object)");
  std::map<std::string, std::set<std::string>> shards;
  for (const auto& [tensor, shard] : json["weight_map"].items()) {
    ZG_CHECK(shard.is_string() && fs::path(shard.get<std::string>()).filename() == shard.get<std::string>(), who, ": ",
             index.string(), " maps '", tensor, "' to ", shard.dump(), ", which is not a file name in its folder");
    shards[shard.get<std::string>()].insert(tensor);
  }
  return shards;
}

}  // namespace

HfWeights::HfWeights(const std::string& path, std::string who) : path_(path), who_(std::move(who)) {
  const fs::path folder(path);
  if (!fs::is_directory(folder) || fs::exists(folder / kSingle)) {
    add(fs::is_directory(folder) ? (folder / kSingle).string() : path);
    return;
  }
  ZG_CHECK(fs::exists(folder / kIndex), who_, ": ", path, " holds neither ", kSingle, " nor ", kIndex,
           "; pass a save_pretrained folder or a .safetensors file");
  for (const auto& [shard, tensors] : read_index(folder / kIndex, who_)) {
    ZG_CHECK(fs::is_regular_file(folder / shard), who_, ": ", (folder / kIndex).string(), " names the shard ", shard,
             " (holding '", *tensors.begin(), "'), but ", path, " has no such file; copy every shard of the checkpoint");
    add((folder / shard).string());
    const SafetensorsFile& file = *files_.back();
    for (const std::string& name : tensors)
      ZG_CHECK(file.contains(name), who_, ": ", kIndex, " puts '", name, "' in ", file.path(), ", which has no such tensor");
    for (const std::string& name : file.names())
      ZG_CHECK(tensors.count(name), who_, ": ", file.path(), " holds '", name, "', which ", kIndex, " does not map to it");
  }
}

void HfWeights::add(const std::string& file_path) {
  files_.push_back(std::make_unique<SafetensorsFile>(file_path));
  for (const std::string& name : files_.back()->names()) {
    const auto [it, added] = file_of_.emplace(name, files_.back().get());
    ZG_CHECK(added, who_, ": '", name, "' is in both ", it->second->path(), " and ", file_path);
    names_.push_back(name);
  }
}

const SafetensorsFile& HfWeights::file_of(const std::string& name) const {
  const auto it = file_of_.find(name);
  ZG_CHECK(it != file_of_.end(), who_, ": ", path_, " has no tensor '", name, "'");
  return *it->second;
}

void save_hf_weights(const std::string& folder, const NamedTensors& tensors, int64_t max_shard_bytes, const char* who) {
  ZG_CHECK(max_shard_bytes > 0, who, ": max_shard_bytes must be positive, got ", max_shard_bytes);
  fs::create_directories(folder);
  std::vector<NamedTensors> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& [name, t] : tensors) {  // consecutive tensors, a shard filled before the next begins
    if (!shards.back().empty() && in_shard + t.nbytes() > max_shard_bytes) shards.emplace_back(), in_shard = 0;
    shards.back().emplace_back(name, t);
    in_shard += t.nbytes(), total += t.nbytes();
  }
  const Metadata metadata = {{"format", "pt"}};
  std::set<std::string> written;
  if (shards.size() == 1) {
    save_safetensors((fs::path(folder) / kSingle).string(), tensors, metadata);
    written.insert(kSingle);
  } else {
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name = shard_name(i + 1, shards.size());
      save_safetensors((fs::path(folder) / name).string(), shards[i], metadata);
      for (const auto& [tensor, _] : shards[i]) weight_map[tensor] = name;
      written.insert(name);
    }
    const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomically((fs::path(folder) / kIndex).string(), index.dump(2) + "\n", who);
    written.insert(kIndex);
  }
  const std::regex previous(R"(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?)");
  for (const fs::directory_entry& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && std::regex_match(name, previous) && !written.count(name)) fs::remove(entry.path());
  }
  sync_folder(folder);
}

void refuse_owned_parameters(const Module& model, const char* who) {
  for (const auto& [name, param] : model.named_parameters())
    if (const ParameterOwner* owner = ParameterOwner::of(param))
      fail(who, ": parameter '", name, "' lives in the flat buffers of ", owner->describe(), "; call ", who,
           " before building that");
}

bool same_values(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && (a.numel() == 0 || max(abs(a.to(DType::f64) - b.to(DType::f64))).item<double>() == 0);
}

}  // namespace zg::nn
