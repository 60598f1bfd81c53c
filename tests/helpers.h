// Shared test helpers: a plain row-major host tensor of doubles for naive
// reference implementations, and closeness checks against it.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "tensor/storage.h"
#include "zerograd.h"

namespace zg::test {

struct Host {
  Shape shape;
  std::vector<double> data;

  static Host of(const Tensor& t) { return {t.shape(), t.to_vector<double>()}; }
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
};

// Multi-index of flat position i in a row-major `shape`.
inline Shape unravel(int64_t i, const Shape& shape) {
  Shape index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] ? i % shape[d] : 0;
    i = shape[d] ? i / shape[d] : 0;
  }
  return index;
}

// Flat position in `shape` of a multi-index aligned to the right, size-1 dims broadcast.
inline int64_t broadcast_position(const Shape& index, const Shape& shape) {
  int64_t pos = 0;
  const size_t lead = index.size() - shape.size();
  for (size_t d = 0; d < shape.size(); ++d) pos = pos * shape[d] + (shape[d] == 1 ? 0 : index[lead + d]);
  return pos;
}

inline void check_close(const Tensor& got, const Host& want, double rtol, double atol, const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape);
  const std::vector<double> g = got.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    const double w = want.data[i];
    const bool ok = (std::isnan(w) && std::isnan(g[i])) || (std::isinf(w) && g[i] == w) ||
                    std::fabs(g[i] - w) <= atol + rtol * std::fabs(w);
    if (!ok) {
      FAIL_CHECK("element " << i << ": got " << g[i] << ", expected " << w);
      return;
    }
  }
}

// Exact equality of two tensors' values (compared as f64: exact for every dtype but large i64).
inline void check_identical(const Tensor& got, const Tensor& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    if (!(g[i] == w[i] || (std::isnan(g[i]) && std::isnan(w[i])))) {
      FAIL_CHECK("element " << i << ": got " << g[i] << ", expected " << w[i]);
      return;
    }
  }
}

// The largest |a_i - b_i| (1e300 when their sizes differ).
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double most = x.size() == y.size() ? 0 : 1e300;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) most = std::max(most, std::fabs(x[i] - y[i]));
  return most;
}

// Runs a shell command; returns its standard output and sets `status` to its exit status.
inline std::string run_command(const std::string& command, int& status) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  status = ::pclose(pipe);
  return out;
}

// A contiguous f32 tensor over a new storage of `allocator` (one no context owns, e.g. an
// allocator on a fake device).
inline Tensor tensor_over(const std::shared_ptr<Allocator>& allocator, int64_t elements,
                          MemoryCategory category = MemoryCategory::other) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(allocator, elements * 4, category);
  impl->shape = {elements};
  impl->strides = {1};
  return Tensor(impl);
}

inline bool has_cuda() {
  try {
    zeros({1}, kCUDA);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The devices every op test runs on: the CPU always, cuda:0 when one is usable.
inline std::vector<Device> devices() {
  std::vector<Device> list{kCPU};
  if (has_cuda()) list.push_back(kCUDA);
  return list;
}

}  // namespace zg::test
