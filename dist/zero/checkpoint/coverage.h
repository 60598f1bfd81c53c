// What a load reads, found before anything changes: each part this rank loads must be
// covered by pieces of the save, and every byte it will read verified (each piece once
// per dtype it is read as, streamed through its checksum). Once every rank has found its
// parts covered, copy_pieces copies each part's overlap with each piece.
#pragma once

#include <string>
#include <vector>

#include "dist/zero/checkpoint/index.h"

namespace zg::dist::checkpoint {

// The parts of `parts` to load, each covered and verified; a zg::Error where one is not
// covered. A save that holds no frozen parameters (formats.h) leaves those of the model
// it has no pieces for as they are: they are not loaded.
std::vector<Part> covered_parts(const Manifest& manifest, const PieceIndex& index, const std::vector<Part>& parts);

// Each part's overlap with each of its pieces, read from the files; a frozen parameter
// held whole that is not contiguous written back from its copy.
void copy_pieces(const std::vector<Part>& parts, const PieceIndex& index);

}  // namespace zg::dist::checkpoint
