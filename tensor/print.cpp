// Tensor::str(): the format of PyTorch's repr, so printed values read the same
// in both: tensor([[1.0000, 2.5000], ...]) with dtype and device suffixes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "tensor/deferred.h"
#include "tensor/tensor.h"

namespace zg {

namespace {

constexpr int64_t kSummarizeThreshold = 1000;  // elements; as torch.set_printoptions
constexpr int64_t kEdgeItems = 3;
constexpr int64_t kLineWidth = 80;  // characters; a longer row wraps

// Every shown element as text, and the width they are padded to.
struct Cells {
  std::vector<std::string> text;
  int width = 1;
};

// Floats, as PyTorch chooses: scientific when the magnitudes span more than 1e3 or pass
// 1e8 (or, unless all are whole, fall below 1e-4); else all whole as "1.", or 4
// decimals. The width comes from the finite non-zero values, so nan, inf and 0 don't pad.
Cells format_floats(const std::vector<double>& values) {
  bool whole = true;
  double lo = INFINITY, hi = 0;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    whole = whole && v == std::nearbyint(v);
    if (v != 0) {
      lo = std::min(lo, std::fabs(v));
      hi = std::max(hi, std::fabs(v));
    }
  }
  const char* style = "%.4f";
  if (hi == 0) style = "%.0f.";
  else if (hi / lo > 1e3 || hi > 1e8 || (!whole && lo < 1e-4)) style = "%.4e";
  else if (whole) style = "%.0f.";
  Cells cells;
  for (double v : values) {
    char buf[64];
    if (std::isnan(v)) std::snprintf(buf, sizeof buf, "nan");
    else if (std::isinf(v)) std::snprintf(buf, sizeof buf, v > 0 ? "inf" : "-inf");
    else std::snprintf(buf, sizeof buf, style, v);
    cells.text.emplace_back(buf);
    if (std::isfinite(v) && v != 0) cells.width = std::max<int>(cells.width, static_cast<int>(cells.text.back().size()));
  }
  return cells;
}

// Integers exactly (read as int64: through a double, INT64_MAX printed as 2^63), bools
// as True/False; every value counts for the width.
Cells format_exact(const Tensor& part) {
  Cells cells;
  for (int64_t v : part.to_vector<int64_t>()) {
    cells.text.push_back(part.dtype() == DType::boolean ? (v != 0 ? "True" : "False") : std::to_string(v));
    cells.width = std::max<int>(cells.width, static_cast<int>(cells.text.back().size()));
  }
  return cells;
}

// Renders nested brackets. `cells` holds only the shown part (row-major, with
// `strides`); `shape` is the full shape, which decides where "..." goes.
struct Printer {
  const Cells& cells;
  const Shape& shape;
  const Shape strides;
  bool summarize;

  std::string element(int64_t index) const {
    const std::string& s = cells.text[index];
    return std::string(std::max<int>(cells.width - static_cast<int>(s.size()), 0), ' ') + s;
  }

  // Positions (in the shown part) along a dim of full `size`: all of them, or the
  // first and last kEdgeItems with -1 marking "..." between.
  std::vector<int64_t> shown(int64_t size) const {
    std::vector<int64_t> idx;
    const bool cut = summarize && size > 2 * kEdgeItems;
    for (int64_t i = 0; i < (cut ? 2 * kEdgeItems : size); ++i) {
      if (cut && i == kEdgeItems) idx.push_back(-1);
      idx.push_back(i);
    }
    return idx;
  }

  // A row puts as many elements on a line as fit in kLineWidth after the indent (", "
  // after each), at least one; the "..." of a summary counts as one.
  std::string render(size_t dim, int64_t base, size_t indent) const {
    const int64_t remaining = static_cast<int64_t>(shape.size() - dim);
    const std::string new_line =
        "," + std::string(std::max<int64_t>(remaining - 1, 1), '\n') + std::string(indent + 1, ' ');
    const int64_t per_line =
        std::max<int64_t>(1, (kLineWidth - static_cast<int64_t>(indent)) / (cells.width + 2));
    std::string s = "[";
    int64_t count = 0;
    for (int64_t i : shown(shape[dim])) {
      if (count > 0) s += remaining > 1 || count % per_line == 0 ? new_line : ", ";
      ++count;
      if (i < 0) s += remaining == 1 ? " ..." : "...";
      else if (remaining == 1) s += element(base + i * strides[dim]);
      else s += render(dim + 1, base + i * strides[dim], indent + 1);
    }
    return s + "]";
  }
};

// The first and last kEdgeItems of `t` along `dim`, side by side in a new tensor.
Tensor edges(const Tensor& t, int64_t dim) {
  Shape shape = t.shape();
  shape[dim] = 2 * kEdgeItems;
  Tensor joined = empty(shape, TensorOptions(t.dtype()).device(t.device()));
  joined.narrow(dim, 0, kEdgeItems).copy_(t.narrow(dim, 0, kEdgeItems));
  joined.narrow(dim, kEdgeItems, kEdgeItems).copy_(t.narrow(dim, t.size(dim) - kEdgeItems, kEdgeItems));
  return joined;
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::vector<std::string> suffixes;
  if (device().type != DeviceType::cpu) suffixes.push_back("device='" + device().str() + "'");
  std::string body;
  const bool no_data = device().type == DeviceType::meta || is_deferred(*this);
  if (numel() == 0 || no_data) {
    body = no_data ? "..." : "[]";
    if (dim() != 1 || no_data) {
      std::string size = "size=(";
      for (int64_t d = 0; d < dim(); ++d) size += (d ? ", " : "") + std::to_string(shape()[d]);
      suffixes.push_back(size + (dim() == 1 ? ",)" : ")"));
    }
  } else {
    // Only what is shown is read: a long dim keeps its first and last kEdgeItems.
    const bool summarize = numel() > kSummarizeThreshold;
    Tensor part = detach();  // printing records no graph
    for (int64_t d = 0; summarize && d < dim(); ++d)
      if (shape()[d] > 2 * kEdgeItems) part = edges(part, d);
    const Cells cells = is_floating(dtype()) ? format_floats(part.to_vector<double>()) : format_exact(part);
    const Printer printer{cells, shape(), contiguous_strides(part.shape()), summarize};
    body = dim() == 0 ? printer.element(0) : printer.render(0, 0, 7);  // 7 = strlen("tensor(")
    if (dim() == 0) body.erase(0, body.find_first_not_of(' '));
  }
  if (dtype() != DType::f32 && dtype() != DType::i64 && dtype() != DType::boolean)
    suffixes.push_back(std::string("dtype=") + name(dtype()));
  if (is_deferred(*this)) suffixes.push_back("deferred");
  std::string s = "tensor(" + body;
  for (const auto& suffix : suffixes) s += ", " + suffix;
  return s + ")";
}

}  // namespace zg
