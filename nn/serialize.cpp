#include "nn/serialize.h"

#include <set>

#include "tensor/autograd.h"

namespace zg::nn {

void save_state(const Module& module, const std::string& path, const Metadata& metadata) {
  NamedTensors state = module.named_parameters();
  for (const auto& [name, p] : state)
    ZG_CHECK(!p.storage()->is_released(), "save_state: parameter '", name, "' is not materialized (ZeRO-3 keeps only "
             "a shard per rank): save through the ShardedModel, while it lives, with save or export_consolidated");
  for (auto& entry : module.named_buffers()) state.push_back(entry);
  save_safetensors(path, state, metadata);
}

LoadedState load_state(Module& module, const std::string& path, bool strict) {
  const SafetensorsFile file(path);
  NamedTensors state = module.named_parameters();
  for (auto& entry : module.named_buffers()) state.push_back(entry);
  LoadedState loaded;
  NamedTensors present;
  std::set<std::string> expected;
  for (const auto& [name, t] : state) {
    if (const ParameterOwner* owner = ParameterOwner::of(t))
      fail("load_state: parameter '", name, "' lives in the flat buffers of ", owner->describe(), ", whose master weights "
           "would overwrite what is loaded at the next step; load before building that (or resume with "
           "ShardedModel::load or optim::load_checkpoint)");
    expected.insert(name);
    if (!file.contains(name)) {
      ZG_CHECK(!strict, "load_state: ", path, " has no tensor '", name, "'");
      loaded.missing.push_back(name);
      continue;
    }
    file.check_readable_into(name, t);  // all checked before anything is overwritten
    present.emplace_back(name, t);
  }
  for (const std::string& name : file.names()) {
    if (expected.contains(name)) continue;
    ZG_CHECK(!strict, "load_state: ", path, " has a tensor '", name, "' the module does not have");
    loaded.unexpected.push_back(name);
  }
  for (const auto& [name, t] : present) file.read_into(name, t);
  loaded.metadata = file.metadata();
  return loaded;
}

}  // namespace zg::nn
