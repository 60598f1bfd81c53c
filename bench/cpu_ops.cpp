// CPU throughput of the primitives the CPU backend runs most, each next to a
// reference measured in the same run: GEMM against a naive triple loop (so the
// ratio shows what Eigen's blocking buys), elementwise add and a strided copy
// against memcpy bandwidth. Usage: cpu_ops [--json] [--repeat N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tensor/safetensors.h"  // parse_number
#include "zerograd.h"

using namespace zg;

namespace {

// Best-of-N wall time in seconds: the least disturbed run.
double best_seconds(int repeat, const std::function<void()>& fn) {
  double best = 1e30;
  for (int i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

struct Row {
  std::string name, unit;
  double value, reference;
  std::string reference_name;
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int repeat = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) json = true;
    else if (int64_t n = 0; std::strcmp(argv[i], "--repeat") == 0 && i + 1 < argc) {
      if (!parse_number(argv[++i], n) || n < 1 || n > 1000000) {
        std::fprintf(stderr, "cpu_ops: --repeat needs a whole number in [1, 1000000], got '%s'\n", argv[i]);
        return 2;
      }
      repeat = static_cast<int>(n);
    }
    else {
      std::printf("usage: cpu_ops [--json] [--repeat N]\n");
      return std::strcmp(argv[i], "--help") == 0 ? 0 : 2;
    }
  }
  std::vector<Row> rows;

  for (int64_t n : {128, 256, 512}) {
    const Tensor a = randn({n, n}), b = randn({n, n});
    const double flops = 2.0 * n * n * n;
    const double t = best_seconds(repeat, [&] { matmul(a, b); });
    const float* pa = a.data<float>();
    const float* pb = b.data<float>();
    std::vector<float> c(n * n);
    const double t_naive = best_seconds(std::max(1, repeat / 2), [&] {
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) {
          float acc = 0;
          for (int64_t k = 0; k < n; ++k) acc += pa[i * n + k] * pb[k * n + j];
          c[i * n + j] = acc;
        }
    });
    rows.push_back({"matmul f32 " + std::to_string(n) + "^3", "GFLOP/s", flops / t / 1e9, flops / t_naive / 1e9,
                    "naive loop"});
  }

  const int64_t elements = 1 << 22;  // 16 MiB of f32
  const Tensor x = randn({elements}), y = randn({elements});
  std::vector<float> dst(elements);
  const double bytes = 3.0 * elements * sizeof(float);
  const double t_memcpy = best_seconds(repeat, [&] { std::memcpy(dst.data(), x.data<float>(), elements * 4); });
  const double memcpy_bw = 2.0 * elements * 4 / t_memcpy / 1e9;
  const double t_add = best_seconds(repeat, [&] { add(x, y); });
  rows.push_back({"add f32 4M", "GB/s", bytes / t_add / 1e9, memcpy_bw, "memcpy"});
  const Tensor square = x.view({2048, 2048});
  const double t_transpose = best_seconds(repeat, [&] { square.t().contiguous(); });
  rows.push_back({"transpose copy f32 2048^2", "GB/s", 2.0 * elements * 4 / t_transpose / 1e9, memcpy_bw, "memcpy"});

  if (json) {
    std::printf("[\n");
    for (size_t i = 0; i < rows.size(); ++i)
      std::printf("  {\"name\": \"%s\", \"unit\": \"%s\", \"value\": %.3f, \"reference\": \"%s\", "
                  "\"reference_value\": %.3f, \"ratio\": %.3f}%s\n",
                  rows[i].name.c_str(), rows[i].unit.c_str(), rows[i].value, rows[i].reference_name.c_str(),
                  rows[i].reference, rows[i].value / rows[i].reference, i + 1 < rows.size() ? "," : "");
    std::printf("]\n");
  } else {
    std::printf("%-28s %12s %10s %14s %8s\n", "op", "zerograd", "unit", "reference", "ratio");
    for (const Row& r : rows)
      std::printf("%-28s %12.2f %10s %8.2f (%s) %6.2fx\n", r.name.c_str(), r.value, r.unit.c_str(), r.reference,
                  r.reference_name.c_str(), r.value / r.reference);
  }
  return 0;
}
