#include "dist/zero/checkpoint/slice_order.h"

#include <algorithm>
#include <sstream>

namespace zg::dist::checkpoint {

namespace {

// The whole tensor as [outer, chunks, T, m, inner] along the cut dim (D = chunks T m); a
// slice is [outer, chunks, m, inner], part t's. Both orders keep (m - i) inner - e
// elements consecutive from row i, element e of a block of m rows.
struct Blocks {
  int64_t outer, dim, chunks, parts, m, inner, slice;
};
Blocks blocks_of(const SliceOrder& order) {
  const nn::TensorSplit& c = order.cut;
  Blocks b{1, order.whole.at(c.dim), c.chunks, c.parts, 0, 1, 0};
  for (int64_t i = 0; i < c.dim; ++i) b.outer *= order.whole[i];
  for (size_t i = c.dim + 1; i < order.whole.size(); ++i) b.inner *= order.whole[i];
  b.m = b.dim / (b.chunks * b.parts);
  b.slice = numel(order.whole) / b.parts;
  return b;
}

}  // namespace

bool same_cut(const nn::TensorSplit& a, const nn::TensorSplit& b) {
  return a.parts == b.parts && (a.parts == 1 || (a.dim == b.dim && a.chunks == b.chunks));
}

Shape whole_shape(Shape slice, const nn::TensorSplit& cut) {
  if (cut.parts > 1) slice.at(cut.dim) *= cut.parts;
  return slice;
}

int64_t SliceOrder::element(int64_t p, int64_t& run) const {
  if (cut.parts == 1) return run = numel(whole) - p, p;
  const Blocks b = blocks_of(*this);
  const int64_t t = p / b.slice, q = p % b.slice;
  const int64_t o = q / (b.chunks * b.m * b.inner), j = q / b.inner % (b.chunks * b.m), e = q % b.inner;
  const int64_t k = j / b.m, i = j % b.m;
  run = (b.m - i) * b.inner - e;
  return ((o * b.chunks + k) * b.parts * b.m + t * b.m + i) * b.inner + e;
}

int64_t SliceOrder::position(int64_t w, int64_t& run) const {
  if (cut.parts == 1) return run = numel(whole) - w, w;
  const Blocks b = blocks_of(*this);
  const int64_t o = w / (b.dim * b.inner), d = w / b.inner % b.dim, e = w % b.inner;
  const int64_t k = d / (b.parts * b.m), t = d % (b.parts * b.m) / b.m, i = d % b.m;
  run = (b.m - i) * b.inner - e;
  return t * b.slice + ((o * b.chunks + k) * b.m + i) * b.inner + e;
}

std::string cut_str(const nn::TensorSplit& cut) {
  return std::to_string(cut.dim) + "," + std::to_string(cut.chunks) + "," + std::to_string(cut.parts);
}

nn::TensorSplit parse_cut(const std::string& text, const Shape& whole, const std::string& where) {
  std::istringstream in(text);
  nn::TensorSplit cut;
  char comma1 = 0, comma2 = 0;
  const bool read = static_cast<bool>(in >> cut.dim >> comma1 >> cut.chunks >> comma2 >> cut.parts) && in.peek() == EOF;
  ZG_CHECK(read && comma1 == ',' && comma2 == ',' && cut.dim >= 0 && cut.dim < static_cast<int64_t>(whole.size()) &&
               cut.chunks >= 1 && cut.parts >= 1 && whole[cut.dim] % (cut.chunks * cut.parts) == 0,
           kLoad, ": ", where, " is '", text, "', not <dim>,<chunks>,<parts> of a cut that fits shape ",
           shape_str(whole));
  return cut;
}

std::vector<Part> in_checkpoint_order(std::vector<Part> parts, const Cuts& cuts, int tp_rank, bool saving) {
  std::vector<Part> out;
  for (Part& part : parts) {
    const auto cut = cuts.find(part.parameter());
    if (cut == cuts.end()) {
      if (!saving || tp_rank == 0) out.push_back(std::move(part));
      continue;
    }
    part.begin += cut->second.part * numel(part.shape);
    part.shape = whole_shape(part.shape, cut->second);
    part.cut = cut->second;
    out.push_back(std::move(part));
  }
  return out;
}

std::vector<Part> in_saved_order(const Part& part, const nn::TensorSplit& saved) {
  if (same_cut(part.cut, saved)) return {part};
  const SliceOrder mine{part.shape, part.cut}, theirs{part.shape, saved};
  std::vector<Part> runs;
  int64_t run_start = 0;  // the last run's first position in `part`
  const int64_t end = part.begin + part.data.numel();
  for (int64_t p = part.begin; p < end;) {
    int64_t run_mine = 0, run_theirs = 0;
    const int64_t q = theirs.position(mine.element(p, run_mine), run_theirs);
    const int64_t n = std::min({run_mine, run_theirs, end - p});
    if (!runs.empty() && runs.back().begin + runs.back().data.numel() == q) {  // consecutive in both: one run
      runs.back().data = part.data.narrow(0, run_start, runs.back().data.numel() + n);
    } else {
      run_start = p - part.begin;
      runs.push_back({part.key, part.shape, q, part.data.narrow(0, run_start, n), {}, saved});
    }
    p += n;
  }
  if (part.whole.defined()) runs.back().whole = part.whole;  // written back once every run is read
  return runs;
}

}  // namespace zg::dist::checkpoint
