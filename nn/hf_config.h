// A Hugging Face config.json, read strictly: each value with its type checked, every error
// naming the reader, the file, the key and the value (nn/hf_llama.h's and nn/hf_gpt2.h's
// config readers). Internal: not installed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <nlohmann/json.hpp>

#include "tensor/error.h"

namespace zg::nn {

class HfConfigReader {
 public:
  using json = nlohmann::json;
  // `path`: a config.json, or a folder holding one; `op` names the reader in errors.
  HfConfigReader(std::string op, const std::string& path) : op_(std::move(op)) {
    const std::filesystem::path file = std::filesystem::is_directory(path) ? std::filesystem::path(path) / "config.json"
                                                                            : std::filesystem::path(path);
    file_ = file.string();
    std::ifstream in(file);
    ZG_CHECK(in.good(), op_, ": cannot open ", file_, "; pass a config.json or a save_pretrained folder");
    config_ = json::parse(in, nullptr, /*allow_exceptions=*/false);
    ZG_CHECK(config_.is_object(), op_, ": ", file_, " is not a JSON object");
  }
  const json& config() const { return config_; }
  bool has(const std::string& key) const { return config_.contains(key); }
  // The key's value; null (JSON null or absent) when not given.
  json get(const std::string& key) const { return config_.contains(key) ? config_[key] : json(); }
  [[noreturn]] void refuse(const std::string& key, const json& value, const std::string& why) const {
    fail(op_, ": ", file_, ": ", key, " ", value.dump(), " ", why);
  }
  // Refuses every key in none of `known`: it may change the model. `who`: "nn::GPT does not know".
  void check_keys(std::initializer_list<const std::set<std::string>*> known, const std::string& who) const {
    for (const auto& item : config_.items()) {
      const std::string& key = item.key();
      if (std::none_of(known.begin(), known.end(), [&](const std::set<std::string>* k) { return k->count(key) > 0; }))
        refuse(key, item.value(), "is a key " + who + "; it may change the model, so it is refused rather than ignored");
    }
  }
  int64_t size(const std::string& key, std::optional<int64_t> fallback = std::nullopt) const {
    const json v = get(key);
    if (v.is_null() && fallback) return *fallback;
    if (v.is_null()) refuse(key, v, "is required (a positive whole number); the file is not a complete config.json");
    if (!v.is_number_integer() || v.get<int64_t>() <= 0) refuse(key, v, "must be a positive whole number");
    return v.get<int64_t>();
  }
  double number(const std::string& key, std::optional<double> fallback = std::nullopt) const {
    const json v = get(key);
    if (v.is_null() && fallback) return *fallback;
    if (v.is_null()) refuse(key, v, "is required (a number); the file is not a complete config.json");
    if (!v.is_number()) refuse(key, v, "must be a number");
    return v.get<double>();
  }
  bool flag(const std::string& key, bool fallback) const {
    const json v = get(key);
    if (v.is_null()) return fallback;
    if (!v.is_boolean()) refuse(key, v, "must be true or false");
    return v.get<bool>();
  }

 private:
  std::string op_, file_;
  json config_;
};

}  // namespace zg::nn
