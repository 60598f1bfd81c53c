#include "dist/zero/checkpoint/slice_order.h"

#include <algorithm>
#include <sstream>

namespace zg::dist::checkpoint {

bool same_cut(const nn::TensorSplit& a, const nn::TensorSplit& b) {
  return a.parts == b.parts && (a.parts == 1 || (a.dim == b.dim && a.chunks == b.chunks));
}

Shape whole_shape(Shape slice, const nn::TensorSplit& cut) {
  if (cut.parts > 1) slice.at(cut.dim) *= cut.parts;
  return slice;
}

SliceIndex slice_index(const Shape& whole, const nn::TensorSplit& cut) {
  return {.whole = whole, .dim = cut.dim, .chunks = cut.chunks, .parts = cut.parts};
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
               cut.chunks >= 1 && cut.parts >= 1 && cut.chunks <= whole[cut.dim] && cut.parts <= whole[cut.dim] &&
               whole[cut.dim] % (cut.chunks * cut.parts) == 0,
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
  const SliceIndex mine = slice_index(part.shape, part.cut), theirs = slice_index(part.shape, saved);
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
