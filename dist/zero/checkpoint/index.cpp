#include "dist/zero/checkpoint/index.h"

#include <algorithm>

#include "dist/zero/checkpoint/formats.h"

namespace zg::dist::checkpoint {

namespace {

// The model's buffers, whole in the first file of a save that holds them: each of them.
void check_buffers(const Manifest& manifest, const ModelParameters& model) {
  if (!manifest.holds_replicated) return;
  const SafetensorsFile& first = manifest.first();
  for (const auto& [key, t] : model.buffers) {
    ZG_CHECK(first.contains(key), kLoad, ": ", first.path(), " has no '", key, "', which the model has");
    first.check_readable_into(key, t);
  }
}

// A buffer of the file: in the first one of a save that holds buffers, and the model's.
void check_buffer(const Manifest& manifest, const SafetensorsFile& file, const std::string& tensor,
                  const ModelParameters& model) {
  check_held_in_first_file(&file == &manifest.first() && manifest.holds_replicated, file, tensor);
  const bool known = std::any_of(model.buffers.begin(), model.buffers.end(),
                                 [&](const auto& buffer) { return buffer.first == tensor; });
  ZG_CHECK(known, kLoad, ": ", file.path(), " holds '", tensor, "' but the model has no such buffer");
}

// The piece `saved` of `file` checked against the model: its parameter the model's,
// 1-D, of the dtype the parameter is held in (or floating as it is), of a parameter
// of the model's shape, within the parameter's elements.
Piece check_piece(const SafetensorsFile& file, const SavedTensor& saved, const PieceName& piece,
                  const ModelParameters& model) {
  const std::string& tensor = saved.tensor;
  const std::string& parameter = piece.parameter;
  const bool frozen = piece.role == "frozen";
  // A trained parameter's pieces load into a model that has it frozen too (its master
  // weights become the frozen weights; its Adam state goes unused).
  const ModelParameters::Held* held = model.find(parameter, frozen);
  ZG_CHECK(held != nullptr, kLoad, ": ", file.path(), " holds '", tensor, "' but the model has no ",
           frozen ? "frozen " : "", "parameter '", parameter, "'",
           model.trained.contains(parameter) ? " (it trains it: the save has no Adam state for it)" : "");
  ZG_CHECK(saved.shape.size() == 1, kLoad, ": ", file.path(), ": tensor '", tensor, "' is ",
           name(file.entry(tensor).dtype), shape_str(saved.shape), ", expected a 1-D piece");
  check_piece_dtype(file, tensor, held->dtype, "1-D ");
  const auto shape_recorded = file.metadata().find("shape/" + parameter);
  const std::optional<std::string> recorded =
      saved.parameter_shape ? saved.parameter_shape
      : shape_recorded != file.metadata().end() ? std::optional(shape_recorded->second)
                                                : std::nullopt;
  ZG_CHECK(recorded == shape_str(held->shape), kLoad, ": ", file.path(), ": tensor '", tensor,
           "' is a piece of a parameter of shape ", recorded.value_or("(not recorded)"), "; the model's '", parameter,
           "' has shape ", shape_str(held->shape), ": a checkpoint of another model");
  const int64_t size = numel(held->shape), length = numel(saved.shape), begin = piece.begin;
  ZG_CHECK(begin <= size && length <= size - begin, kLoad, ": ", file.path(), ": tensor '", tensor,
           "' holds elements [", begin, ", ", begin + length, ") but the model's '", parameter, "' has ", size,
           " (shape ", shape_str(held->shape), "): a checkpoint of another model");
  return {&file, tensor, begin, length};
}

// A parameter's pieces, in order; a zg::Error where two overlap.
void sort_pieces(const std::string& save, std::vector<Piece>& pieces) {
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < pieces.size(); ++i)
    ZG_CHECK(pieces[i - 1].begin + pieces[i - 1].length <= pieces[i].begin, kLoad, ": ", save, ": pieces '",
             pieces[i - 1].tensor, "' (", pieces[i - 1].file->path(), ") and '", pieces[i].tensor, "' (",
             pieces[i].file->path(), ") overlap");
}

}  // namespace

PieceIndex index_pieces(const Manifest& manifest, const ModelParameters& model) {
  check_buffers(manifest, model);
  PieceIndex index;
  for (const auto& file : manifest.files)
    for (const std::string& tensor : file->names()) {
      const bool first_file = file.get() == &manifest.first();
      const SavedTensor saved = upgrade(*file, tensor, manifest.format, first_file, model);
      if (saved.name.starts_with(kBufferKey)) {
        check_buffer(manifest, *file, tensor, model);
        continue;
      }
      const PieceName piece = parse_piece_name(saved.name, /*frozen_role=*/true, *file, tensor);
      index[piece.role + "/" + piece.parameter].push_back(check_piece(*file, saved, piece, model));
    }
  for (auto& [key, pieces] : index) sort_pieces(manifest.path, pieces);
  for (const auto& [name, held] : model.frozen) {
    const std::string key = std::string(kFrozenKey) + name, master = "master/" + name;
    if (!index.contains(key) && index.contains(master)) index[key] = index[master];
  }
  return index;
}

}  // namespace zg::dist::checkpoint
