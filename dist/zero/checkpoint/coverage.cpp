#include "dist/zero/checkpoint/coverage.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "dist/zero/checkpoint/slice_order.h"

namespace zg::dist::checkpoint {

std::vector<Part> covered_parts(const Manifest& manifest, const PieceIndex& index, const std::vector<Part>& parts) {
  std::vector<Part> loaded;  // each in the save's order: one run of it
  std::set<std::tuple<const SafetensorsFile*, std::string, DType>> verified;  // and checked as that dtype
  for (const Part& part : parts) {
    if (!manifest.holds_replicated && part.key.starts_with(kFrozenKey) && !index.pieces.contains(part.key)) continue;
    const auto saved = index.cuts.find(part.parameter());
    for (Part& run : in_saved_order(part, saved == index.cuts.end() ? nn::TensorSplit{} : saved->second)) {
      const int64_t a = run.begin, b = run.begin + run.data.numel();
      int64_t covered = 0;
      for (const Piece& p : index.of(run.key)) {
        const int64_t overlap = std::min(b, p.begin + p.length) - std::max(a, p.begin);
        if (overlap <= 0) continue;
        covered += overlap;
        if (verified.emplace(p.file, p.tensor, run.data.dtype()).second)
          p.file->check_readable_as(p.tensor, run.data.dtype());
      }
      ZG_CHECK(covered == b - a, kLoad, ": ", manifest.path, " does not cover ", run.key, " elements [", a, ", ", b,
               ") (", covered, " of ", b - a, " found", run.cut.parts > 1 ? ", in its order of tp slices" : "", ")");
      loaded.push_back(std::move(run));
    }
  }
  return loaded;
}

void copy_pieces(const std::vector<Part>& parts, const PieceIndex& index) {
  for (const Part& part : parts) {
    const int64_t a = part.begin, b = part.begin + part.data.numel();
    for (const Piece& p : index.of(part.key)) {
      const int64_t lo = std::max(a, p.begin), hi = std::min(b, p.begin + p.length);
      if (hi <= lo) continue;
      const Tensor data = p.file->read(p.tensor).reshape({-1});
      Tensor(part.data.narrow(0, lo - a, hi - lo)).copy_(data.narrow(0, lo - p.begin, hi - lo));
    }
    if (part.whole.defined()) Tensor(part.whole).copy_(part.data.view(part.whole.shape()));
  }
}

}  // namespace zg::dist::checkpoint
