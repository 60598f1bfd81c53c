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

Metadata load_state(Module& module, const std::string& path, bool strict) {
  const SafetensorsFile file(path);
  NamedTensors state = module.named_parameters();
  for (auto& entry : module.named_buffers()) state.push_back(entry);
  std::set<std::string> expected;
  for (const auto& [name, t] : state) {
    if (const ParameterOwner* owner = ParameterOwner::of(t))
      fail("load_state: parameter '", name, "' lives in the flat buffers of ", owner->describe(), ", whose master weights "
           "would overwrite what is loaded at the next step; load before building that (or resume with "
           "ShardedModel::load or optim::load_checkpoint)");
    ZG_CHECK(file.contains(name), "load_state: ", path, " has no tensor '", name, "'");
    file.check_readable_into(name, t);  // all checked before anything is overwritten
    expected.insert(name);
  }
  if (strict)
    for (const std::string& name : file.names())
      ZG_CHECK(expected.count(name), "load_state: ", path, " has a tensor '", name, "' the module does not have");
  for (const auto& [name, t] : state) file.read_into(name, t);
  return file.metadata();
}

}  // namespace zg::nn
