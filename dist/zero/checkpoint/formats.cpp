#include "dist/zero/checkpoint/formats.h"

#include <utility>

#include "dist/zero/checkpoint/pieces.h"

namespace zg::dist::checkpoint {

namespace {

constexpr const char* kFormats[kFormatVersion] = {"zerograd-sharded-checkpoint-1", "zerograd-sharded-checkpoint-2",
                                                  "zerograd-sharded-checkpoint-3", "zerograd-sharded-checkpoint-4",
                                                  "zerograd-sharded-checkpoint-5"};

// The role and parameter of a tensor of the single file.
std::pair<std::string, std::string> single_file_name(const std::string& tensor) {
  for (const std::string role : {"exp_avg", "exp_avg_sq"})
    if (const std::string prefix = "optimizer." + role + "."; tensor.starts_with(prefix))
      return {role, tensor.substr(prefix.size())};
  return {"master", tensor};
}

// The single file's tensor: its parameter's piece from element 0, once it fits the
// parameter whole (one the model lacks is the index's to refuse).
SavedTensor upgrade_single_file(const SafetensorsFile& file, const std::string& tensor, const ModelParameters& model) {
  const auto [role, parameter] = single_file_name(tensor);
  const Shape& shape = file.entry(tensor).shape;
  SavedTensor saved{tensor, role + "/" + parameter + "/0", shape, std::nullopt};
  const ModelParameters::Held* held = model.find(parameter, /*frozen_role=*/false);
  if (held == nullptr) return saved;
  ZG_CHECK(shape == held->shape, kLoad, ": ", file.path(), ": tensor '", tensor, "' has shape ", shape_str(shape),
           "; the model's '", parameter, "' has shape ", shape_str(held->shape), ": a checkpoint of another model");
  check_piece_dtype(file, tensor, held->dtype, "");
  saved.shape = {numel(shape)};
  saved.parameter_shape = shape_str(shape);
  return saved;
}

// Format 3's frozen/<name>, whole in the first file: the frozen parameter's piece from
// element 0, once it fits that parameter whole.
SavedTensor upgrade_whole_frozen(const SafetensorsFile& file, const std::string& tensor, bool first_file,
                                 const ModelParameters& model) {
  check_held_in_first_file(first_file, file, tensor);
  const std::string name = tensor.substr(kFrozenKey.size());
  const auto known = model.frozen.find(name);
  ZG_CHECK(known != model.frozen.end(), kLoad, ": ", file.path(), " holds '", tensor,
           "' but the model has no such frozen parameter");
  const Shape& shape = file.entry(tensor).shape;
  ZG_CHECK(shape == known->second.shape, kLoad, ": ", file.path(), ": tensor '", tensor, "' has shape ",
           shape_str(shape), "; the model's '", name, "' has shape ", shape_str(known->second.shape));
  check_piece_dtype(file, tensor, known->second.dtype, "");
  return {tensor, tensor + "/0", {numel(shape)}, shape_str(shape)};
}

}  // namespace

const char* format_name(int version) { return kFormats[version - 1]; }

int format_of(const Metadata& meta) {
  const auto it = meta.find("format");
  for (int version = 1; version <= kFormatVersion; ++version)
    if (it != meta.end() && it->second == format_name(version)) return version;
  return 0;
}

bool holds_replicated(int format) { return format >= 3; }

SavedTensor upgrade(const SafetensorsFile& file, const std::string& tensor, int format, bool first_file,
                    const ModelParameters& model) {
  SavedTensor saved{tensor, tensor, file.entry(tensor).shape, std::nullopt};
  // Buffers are named as they always were (formats before 3 hold none: the index refuses them).
  if (format >= 4 || tensor.starts_with(kBufferKey)) return saved;
  if (format == 0) return upgrade_single_file(file, tensor, model);
  if (format == 3 && tensor.starts_with(kFrozenKey)) return upgrade_whole_frozen(file, tensor, first_file, model);
  const PieceName piece = parse_piece_name(tensor, /*frozen_role=*/false, file, tensor);
  if (const ModelParameters::Held* held = model.find(piece.parameter, /*frozen_role=*/false); format == 1 && held)
    saved.parameter_shape = shape_str(held->shape);
  return saved;
}

void check_held_in_first_file(bool held_there, const SafetensorsFile& file, const std::string& tensor) {
  ZG_CHECK(held_there, kLoad, ": ", file.path(), " holds '", tensor,
           "', but only the first file of a save holds buffers (and, in format 3, frozen parameters)");
}

}  // namespace zg::dist::checkpoint
