#include "nn/serialize.h"

#include <cstring>
#include <map>
#include <set>

#include "autograd/graph.h"

namespace zg::nn {

void save_state(const Module& module, const std::string& path, const Metadata& metadata) {
  NamedTensors state = module.named_parameters();
  for (const auto& [name, p] : state)
    ZG_CHECK(!p.storage()->is_released(), "save_state: parameter '", name, "' is not materialized (ZeRO-3 keeps only "
             "a shard per rank): save through the ShardedModel, while it lives, with save or export_consolidated");
  for (auto& entry : module.named_buffers()) state.push_back(entry);
  save_safetensors(path, state, metadata);
}

namespace {

// Which of a module tensor's `names` (several for a shared parameter: torch's state_dict
// lists a tied weight under each) the file holds. Those must hold the same bytes, so
// which one is loaded does not matter.
std::vector<std::string> names_in_file(const SafetensorsFile& file, const std::vector<std::string>& names) {
  std::vector<std::string> found;
  for (const std::string& name : names)
    if (file.contains(name)) found.push_back(name);
  for (size_t i = 1; i < found.size(); ++i) {
    const Tensor first = file.read(found[0]), other = file.read(found[i]);
    const bool same = first.dtype() == other.dtype() && first.shape() == other.shape() &&
                      (first.nbytes() == 0 ||
                       std::memcmp(first.data_ptr(), other.data_ptr(), static_cast<size_t>(first.nbytes())) == 0);
    ZG_CHECK(same, "load_state: ", file.path(), " has different values for '", found[0], "' and '", found[i],
             "', two names of one shared parameter (a tied weight); a file may hold it under both only with the "
             "same values");
  }
  return found;
}

}  // namespace

LoadedState load_state(Module& module, const std::string& path, bool strict) {
  const SafetensorsFile file(path);
  NamedTensors state = module.named_parameters();
  for (auto& entry : module.named_buffers()) state.push_back(entry);
  // Every name of each parameter: a shared one is in `state` once, under its first.
  std::map<const TensorImpl*, std::vector<std::string>> names_of;
  for (const auto& [name, p] : module.named_parameters(/*remove_duplicates=*/false))
    names_of[&p.impl()].push_back(name);
  LoadedState loaded;
  NamedTensors present;
  std::set<std::string> expected;
  for (const auto& [name, t] : state) {
    if (const ParameterOwner* owner = ParameterOwner::of(t))
      fail("load_state: parameter '", name, "' lives in the flat buffers of ", owner->describe(), ", whose master weights "
           "would overwrite what is loaded at the next step; load before building that (or resume with "
           "ShardedModel::load)");
    const auto aliases = names_of.find(&t.impl());
    const std::vector<std::string> names = aliases != names_of.end() ? aliases->second : std::vector{name};
    expected.insert(names.begin(), names.end());
    const std::vector<std::string> found = names_in_file(file, names);
    if (found.empty()) {
      ZG_CHECK(!strict, "load_state: ", path, " has no tensor '", name, "'");
      loaded.missing.push_back(name);
      continue;
    }
    // All checked before anything is overwritten.
    for (const std::string& stored : found) file.check_readable_into(stored, t);
    present.emplace_back(found[0], t);
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
