// Tensor::str(): the format of PyTorch's repr, so printed values read the same
// in both: tensor([[1.0000, 2.5000], ...]) with dtype and device suffixes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace zg {

namespace {

constexpr int64_t kSummarizeThreshold = 1000;  // elements; as torch.set_printoptions
constexpr int64_t kEdgeItems = 3;

// How every element of one tensor is written: one shared style and width.
struct Formatter {
  enum class Style { integer, fixed, scientific, whole_float, boolean } style = Style::fixed;
  int width = 1;

  std::string operator()(double v) const {
    char buf[64];
    if (std::isnan(v)) std::snprintf(buf, sizeof buf, "nan");
    else if (std::isinf(v)) std::snprintf(buf, sizeof buf, v > 0 ? "inf" : "-inf");
    else switch (style) {
        case Style::boolean: std::snprintf(buf, sizeof buf, "%s", v != 0 ? "True" : "False"); break;
        case Style::integer: std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v)); break;
        case Style::whole_float: std::snprintf(buf, sizeof buf, "%.0f.", v); break;
        case Style::fixed: std::snprintf(buf, sizeof buf, "%.4f", v); break;
        case Style::scientific: std::snprintf(buf, sizeof buf, "%.4e", v); break;
      }
    return buf;
  }
};

// PyTorch's choice: integers as integers; floats that are all whole as "1.";
// scientific when the magnitudes span more than 1e3 or leave [1e-4, 1e8]; else 4 decimals.
Formatter make_formatter(const std::vector<double>& values, DType dtype) {
  Formatter f;
  if (dtype == DType::boolean) f.style = Formatter::Style::boolean;
  else if (!is_floating(dtype)) f.style = Formatter::Style::integer;
  else {
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
    if (hi == 0) f.style = Formatter::Style::whole_float;
    else if (whole) f.style = hi > 1e8 ? Formatter::Style::scientific : Formatter::Style::whole_float;
    else if (hi / lo > 1e3 || hi > 1e8 || lo < 1e-4) f.style = Formatter::Style::scientific;
  }
  // As PyTorch: the width comes from the finite values (non-zero ones for floats), so nan/inf don't pad.
  for (double v : values)
    if (std::isfinite(v) && (v != 0 || !is_floating(dtype)))
      f.width = std::max<int>(f.width, static_cast<int>(f(v).size()));
  return f;
}

// Renders nested brackets. `values` holds only the shown part (row-major, with
// `strides`); `shape` is the full shape, which decides where "..." goes.
struct Printer {
  const std::vector<double>& values;
  const Shape& shape;
  const Shape strides;
  const Formatter& format;
  bool summarize;

  std::string element(int64_t index) const {
    const std::string s = format(values[index]);
    return std::string(std::max<int>(format.width - static_cast<int>(s.size()), 0), ' ') + s;
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

  std::string render(size_t dim, int64_t base, size_t indent) const {
    const int64_t remaining = static_cast<int64_t>(shape.size() - dim);
    const std::string separator =
        remaining == 1 ? ", " : "," + std::string(remaining - 1, '\n') + std::string(indent + 1, ' ');
    std::string s = "[";
    bool first = true;
    for (int64_t i : shown(shape[dim])) {
      if (!first) s += separator;
      first = false;
      if (i < 0) s += remaining == 1 ? " ..." : "...";
      else if (remaining == 1) s += element(base + i * strides[dim]);
      else s += render(dim + 1, base + i * strides[dim], indent + 1);
    }
    return s + "]";
  }
};

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::vector<std::string> suffixes;
  if (device().type != DeviceType::cpu) suffixes.push_back("device='" + device().str() + "'");
  std::string body;
  const bool empty_data = numel() == 0 || device().type == DeviceType::meta;
  if (empty_data) {
    body = device().type == DeviceType::meta ? "..." : "[]";
    if (dim() != 1 || device().type == DeviceType::meta) {
      std::string size = "size=(";
      for (int64_t d = 0; d < dim(); ++d) size += (d ? ", " : "") + std::to_string(shape()[d]);
      suffixes.push_back(size + (dim() == 1 ? ",)" : ")"));
    }
  } else {
    // Only what is shown is read: a long dim keeps its first and last kEdgeItems.
    const bool summarize = numel() > kSummarizeThreshold;
    Tensor part = *this;
    for (int64_t d = 0; summarize && d < dim(); ++d)
      if (shape()[d] > 2 * kEdgeItems)
        part = cat({part.narrow(d, 0, kEdgeItems), part.narrow(d, shape()[d] - kEdgeItems, kEdgeItems)}, d);
    const std::vector<double> values = part.to_vector<double>();
    const Formatter format = make_formatter(values, dtype());
    const Printer printer{values, shape(), contiguous_strides(part.shape()), format, summarize};
    body = dim() == 0 ? printer.element(0) : printer.render(0, 0, 7);  // 7 = strlen("tensor(")
    if (dim() == 0) body.erase(0, body.find_first_not_of(' '));
  }
  if (dtype() != DType::f32 && dtype() != DType::i64 && dtype() != DType::boolean)
    suffixes.push_back(std::string("dtype=") + name(dtype()));
  std::string s = "tensor(" + body;
  for (const auto& suffix : suffixes) s += ", " + suffix;
  return s + ")";
}

}  // namespace zg
