#include "nn/sequence_pieces.h"

#include "tensor/error.h"

namespace zg::nn {

int64_t SequencePieces::whole_length(int64_t length) const {
  const auto count = static_cast<int64_t>(held.size());
  ZG_CHECK(count > 0 && length % count == 0, "SequencePieces: ", length, " rows do not divide into the ", count,
           " pieces this rank holds of ", parts);
  return length / count * parts;
}

SequencePieces SequencePieces::refine(int count, int index) const {
  const int have = static_cast<int>(held.size());
  ZG_CHECK(count >= 1 && index >= 0 && index < count && (have % count == 0 || count % have == 0),
           "SequencePieces: part ", index, " of ", count, " does not cut the ", have, " pieces a rank holds evenly");
  if (count == 1) return *this;
  if (have % count == 0) {  // whole pieces: the index-th run of have / count of them
    const int per = have / count;
    return {parts, std::vector<int>(held.begin() + index * per, held.begin() + (index + 1) * per)};
  }
  const int sub = count / have;  // each piece cut into `sub`: piece held[i]'s j-th sub-piece
  return {parts * sub, {held[static_cast<size_t>(index / sub)] * sub + index % sub}};
}

SequencePieces load_balanced_pieces(int rank, int ranks) {
  ZG_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "load_balanced_pieces: rank ", rank, " of ", ranks);
  if (ranks == 1) return {};
  return {2 * ranks, {rank, 2 * ranks - 1 - rank}};
}

}  // namespace zg::nn
