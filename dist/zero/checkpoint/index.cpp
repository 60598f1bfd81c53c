#include "dist/zero/checkpoint/index.h"

#include <algorithm>

#include "dist/zero/checkpoint/formats.h"
#include "dist/zero/checkpoint/slice_order.h"

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

bool holds_buffer(const ModelParameters& model, const std::string& key) {
  return std::any_of(model.buffers.begin(), model.buffers.end(), [&](const auto& buffer) { return buffer.first == key; });
}

// A buffer of the file: in the first one of a save that holds buffers, and the model's.
void check_buffer(const Manifest& manifest, const SafetensorsFile& file, const std::string& tensor,
                  const ModelParameters& model) {
  check_held_in_first_file(&file == &manifest.first() && manifest.holds_replicated, file, tensor);
  ZG_CHECK(holds_buffer(model, tensor), kLoad, ": ", file.path(), " holds '", tensor, "' but the model has no such buffer");
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

// How `file` says the save cut `parameter` of `whole` shape: the same as every file before
// it says (`cuts`), or not at all where it is not cut.
void record_cut(const SafetensorsFile& file, const std::string& parameter, const Shape& whole,
                std::map<std::string, nn::TensorSplit>& cuts) {
  const std::string key = "split/" + parameter;
  const auto text = file.metadata().find(key);
  const nn::TensorSplit cut = text == file.metadata().end()
                                  ? nn::TensorSplit{}
                                  : parse_cut(text->second, whole, file.path() + ": metadata '" + key + "'");
  const auto [known, first] = cuts.emplace(parameter, cut);
  ZG_CHECK(first || same_cut(known->second, cut), kLoad, ": ", file.path(), " cuts '", parameter, "' as ",
           cut.parts == 1 ? "nothing" : cut_str(cut), " but an earlier file of the save as ",
           known->second.parts == 1 ? "nothing" : cut_str(known->second), " (<dim>,<chunks>,<parts>)");
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
        if (model.pipeline_stage && !holds_buffer(model, saved.name)) index.elsewhere.insert(saved.name);
        else check_buffer(manifest, *file, tensor, model);
        continue;
      }
      const PieceName piece = parse_piece_name(saved.name, /*frozen_role=*/true, *file, tensor);
      if (model.pipeline_stage && model.find(piece.parameter, piece.role == "frozen") == nullptr) {
        index.elsewhere.insert(piece.parameter);
        continue;
      }
      index.pieces[piece.role + "/" + piece.parameter].push_back(check_piece(*file, saved, piece, model));
      record_cut(*file, piece.parameter, model.find(piece.parameter, piece.role == "frozen")->shape, index.cuts);
    }
  for (auto& [key, pieces] : index.pieces) sort_pieces(manifest.path, pieces);
  for (const auto& [name, held] : model.frozen) {
    const std::string key = std::string(kFrozenKey) + name, master = "master/" + name;
    if (!index.pieces.contains(key) && index.pieces.contains(master)) index.pieces[key] = index.pieces[master];
  }
  return index;
}

const std::vector<Piece>& PieceIndex::of(const std::string& key) const {
  static const std::vector<Piece> none;
  const auto it = pieces.find(key);
  return it == pieces.end() ? none : it->second;
}

}  // namespace zg::dist::checkpoint
