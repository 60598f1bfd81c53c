// The pieces of a save, indexed by role and parameter: every tensor of its files, as
// upgrade() names it in the current format, is a piece of one role of one parameter of
// the model -- its name read, its dtype, its parameter's recorded shape and its range
// checked against the model -- or, in the first file, one of the model's buffers, whole.
// A parameter's pieces are sorted by first element and must not overlap; where the save
// cut it across tensor-parallel ranks, every file says alike how (slice_order.h). Nothing
// in the files may be unknown to the model (to a pipeline stage: to the whole pipeline,
// which ShardedModel::load checks across the stages).
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "dist/zero/checkpoint/manifest.h"
#include "dist/zero/checkpoint/model_parameters.h"
#include "dist/zero/checkpoint/pieces.h"

namespace zg::dist::checkpoint {

struct PieceIndex {
  std::map<std::string, std::vector<Piece>> pieces;  // by <role>/<parameter>, sorted by begin
  std::map<std::string, nn::TensorSplit> cuts;       // by parameter: the save's cut (parts = 1: none)
  std::set<std::string> elsewhere;  // a pipeline stage's: the save's parameters and buffers other stages hold
  const std::vector<Piece>& of(const std::string& key) const;  // none where the save has none
};

// A parameter frozen in the model that the save trained takes its master weights' pieces.
PieceIndex index_pieces(const Manifest& manifest, const ModelParameters& model);

}  // namespace zg::dist::checkpoint
