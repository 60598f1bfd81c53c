#include "dist/zero/checkpoint/coverage.h"

#include <algorithm>
#include <set>
#include <tuple>

namespace zg::dist::checkpoint {

namespace {

const std::vector<Piece>& pieces_of(const PieceIndex& index, const std::string& key) {
  static const std::vector<Piece> none;
  const auto it = index.find(key);
  return it == index.end() ? none : it->second;
}

}  // namespace

std::vector<Part> covered_parts(const Manifest& manifest, const PieceIndex& index, const std::vector<Part>& parts) {
  std::vector<Part> loaded;
  std::set<std::tuple<const SafetensorsFile*, std::string, DType>> verified;  // and checked as that dtype
  for (const Part& part : parts) {
    if (!manifest.holds_replicated && part.key.starts_with(kFrozenKey) && !index.contains(part.key)) continue;
    const int64_t a = part.begin, b = part.begin + part.data.numel();
    int64_t covered = 0;
    for (const Piece& p : pieces_of(index, part.key)) {
      const int64_t overlap = std::min(b, p.begin + p.length) - std::max(a, p.begin);
      if (overlap <= 0) continue;
      covered += overlap;
      if (verified.emplace(p.file, p.tensor, part.data.dtype()).second)
        p.file->check_readable_as(p.tensor, part.data.dtype());
    }
    ZG_CHECK(covered == b - a, kLoad, ": ", manifest.path, " does not cover ", part.key, " elements [", a, ", ", b,
             ") (", covered, " of ", b - a, " found)");
    loaded.push_back(part);
  }
  return loaded;
}

void copy_pieces(const std::vector<Part>& parts, const PieceIndex& index) {
  for (const Part& part : parts) {
    const int64_t a = part.begin, b = part.begin + part.data.numel();
    for (const Piece& p : pieces_of(index, part.key)) {
      const int64_t lo = std::max(a, p.begin), hi = std::min(b, p.begin + p.length);
      if (hi <= lo) continue;
      const Tensor data = p.file->read(p.tensor).reshape({-1});
      Tensor(part.data.narrow(0, lo - a, hi - lo)).copy_(data.narrow(0, lo - p.begin, hi - lo));
    }
    if (part.whole.defined()) Tensor(part.whole).copy_(part.data.view(part.whole.shape()));
  }
}

}  // namespace zg::dist::checkpoint
