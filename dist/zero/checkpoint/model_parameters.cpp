#include "dist/zero/checkpoint/model_parameters.h"

#include "dist/zero/checkpoint/pieces.h"

namespace zg::dist::checkpoint {

const ModelParameters::Held* ModelParameters::find(const std::string& parameter, bool frozen_role) const {
  if (const auto it = frozen.find(parameter); it != frozen.end()) return &it->second;
  if (const auto it = trained.find(parameter); !frozen_role && it != trained.end()) return &it->second;
  return nullptr;
}

ModelParameters model_parameters(const std::vector<UnitRoles>& units, const nn::NamedTensors& replicated,
                                 const Cuts& cuts) {
  const auto whole = [&](const std::string& name, const Shape& shape) {
    const auto cut = cuts.find(name);
    return cut == cuts.end() ? shape : whole_shape(shape, cut->second);
  };
  ModelParameters model;
  for (const UnitRoles& unit : units) {
    for (const ParamSlot& e : unit.entries) model.trained[e.name] = {whole(e.name, e.shape), unit.master.dtype()};
    for (const ParamSlot& e : unit.frozen_entries) model.frozen[e.name] = {whole(e.name, e.shape), unit.frozen.dtype()};
  }
  for (const auto& [key, t] : replicated) {
    if (!key.starts_with(kFrozenKey)) {
      model.buffers.emplace_back(key, t);
      continue;
    }
    const std::string name = key.substr(kFrozenKey.size());
    model.frozen[name] = {whole(name, t.shape()), t.dtype()};
  }
  return model;
}

void check_piece_dtype(const SafetensorsFile& file, const std::string& tensor, DType held, const char* kind) {
  const SafetensorsFile::Entry& entry = file.entry(tensor);
  ZG_CHECK(entry.dtype == held || (is_floating(entry.dtype) && is_floating(held)), kLoad, ": ", file.path(),
           ": tensor '", tensor, "' is ", name(entry.dtype), shape_str(entry.shape), ", expected a ", kind,
           is_floating(held) ? "floating" : name(held), " piece");
}

}  // namespace zg::dist::checkpoint
