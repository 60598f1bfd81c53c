// The order in which a checkpoint holds a parameter's elements. A parameter cut across T
// tensor-parallel ranks (nn::TensorSplit) is held as its T slices one after another, each
// flattened -- "slice-major" order -- so that each rank's slice is one range of it and a
// save at tp = T writes no more pieces than at tp = 1; a parameter not cut, in its own
// flattened order (tensor/slice_index.h). A save records each cut ("split/<parameter>");
// a load at another cut (tp = 1 included) maps each range of its own order to runs of the
// save's, through the whole tensor's element index.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "dist/zero/checkpoint/pieces.h"
#include "nn/parallel_plan.h"
#include "tensor/slice_index.h"

namespace zg::dist::checkpoint {

using Cuts = std::unordered_map<std::string, nn::TensorSplit>;  // by parameter name: the cut ones

// A cut parameter's whole shape: the slice's, `dim` times `parts`.
Shape whole_shape(Shape slice, const nn::TensorSplit& cut);

// The positions of a parameter of `whole` shape cut as `cut` (parts = 1: not cut).
SliceIndex slice_index(const Shape& whole, const nn::TensorSplit& cut);

// Whether two cuts order a parameter alike (the part a rank holds aside).
bool same_cut(const nn::TensorSplit& a, const nn::TensorSplit& b);

// The metadata value of a cut, "<dim>,<chunks>,<parts>", and its reading: a zg::Error naming
// `where` unless it is one that fits a parameter of `whole` shape.
std::string cut_str(const nn::TensorSplit& cut);
nn::TensorSplit parse_cut(const std::string& text, const Shape& whole, const std::string& where);

// This rank's parts in the checkpoint's order: a cut parameter's at its slice's place
// (part t of T from t * numel / T), with the whole tensor's shape and its cut. Saving on a
// tp rank other than 0, the parameters every tp rank holds alike are left to rank 0.
std::vector<Part> in_checkpoint_order(std::vector<Part> parts, const Cuts& cuts, int tp_rank, bool saving);

// `part` (a range of its own order) as parts of the order of a save that cut its
// parameter as `saved`: one per run of positions consecutive in both (the part itself
// where the two cuts are the same).
std::vector<Part> in_saved_order(const Part& part, const nn::TensorSplit& saved);

}  // namespace zg::dist::checkpoint
