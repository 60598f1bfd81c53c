// The unit of a checkpoint. A rank saves and loads Parts: a range of one role of one
// parameter ("<role>/<parameter>") that it holds in its buffers. In a file each saved
// part is a Piece, flat, named <role>/<parameter>/<first element>, its parameter's shape
// recorded apart (metadata "shape/<parameter>"): a parameter of another shape but as many
// elements must not load. Loading at another world size or stage reads, for each part
// this rank holds now, the pieces that overlap it.
//
// Roles: master, exp_avg, exp_avg_sq (the trained parameters'), and frozen. At ZeRO-3 each
// rank saves its slice of each unit's frozen buffer; the frozen parameters every rank
// holds whole (stages 0-2) rank 0 saves, each as one piece.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/zero/checkpoint/roles.h"
#include "nn/module.h"
#include "tensor/safetensors.h"

namespace zg::dist::checkpoint {

inline constexpr const char* kLoad = "ShardedModel::load";  // who refuses a load, in its errors

// Elements [begin, begin + data.numel()) of a flattened parameter's role, in `data`, a
// 1-D view of the rank's buffer; with tensor parallelism, positions of the checkpoint's
// order of the parameter (slice_order.h), and `shape` the whole one.
struct Part {
  std::string key;  // "<role>/<parameter name>"
  Shape shape;      // the parameter's
  int64_t begin;
  Tensor data;
  Tensor whole;  // a frozen parameter held whole that is not contiguous: `data` is a copy, written back after a load
  nn::TensorSplit cut;  // how the order `begin` counts in cuts the parameter (slice_order.h); parts = 1: not cut
  std::string parameter() const { return key.substr(key.find('/') + 1); }
};

// A saved piece: elements [begin, begin + length) of the flattened parameter.
struct Piece {
  const SafetensorsFile* file;
  std::string tensor;
  int64_t begin, length;
};

// What rank r saves (`saving`) or loads of the units: its slice of every trained
// parameter's master weights and Adam state -- with the optimizer state full (DDP), it
// saves slice r of its full buffers, so the ranks share the writing, and loads all of
// them -- and, at ZeRO-3, its slice of each unit's frozen buffer. Of the frozen
// parameters held whole on every rank (`replicated`, "frozen/<name>"), all of each:
// rank 0 saves them, every rank loads them.
std::vector<Part> parts_of(const std::vector<UnitRoles>& units, const nn::NamedTensors& replicated, int r,
                           bool full_state, bool saving);

// A part's piece's name in a file: <role>/<parameter>/<first element>.
std::string piece_name(const Part& part);

struct PieceName {
  std::string role, parameter;
  int64_t begin = 0;
};
// Reads a piece's name; a zg::Error naming `tensor` of `file` when it is not one, or its
// role is none of master, exp_avg, exp_avg_sq and (where `frozen_role`) frozen.
PieceName parse_piece_name(const std::string& name, bool frozen_role, const SafetensorsFile& file,
                           const std::string& tensor);

}  // namespace zg::dist::checkpoint
