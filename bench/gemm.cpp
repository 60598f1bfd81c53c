// gemm: TFLOP/s of zg::matmul for square sizes and, with --gpt2, the products of a
// GPT-2 124M training step. What is timed is the public op on device tensors -- what
// a model's linear layers get: the output and cuBLAS workspace from the caching
// allocator, then the cuBLAS call.
//
//   flops = 2 * M * N * K per product (M * N outputs, each a sum of K multiply-adds)
//
// cuda: kWarmup products, then --iters products between two CUDA events on the
// rank's compute stream (where matmul issues its work), with no host synchronisation
// in between; ms = elapsed / iters. cpu: the same loop timed with std::chrono
// (Eigen; f16 and bf16 are computed in f32). --reference FILE reads the JSON that
// bench/torch_gemm.py --json FILE writes (the same rows with torch.matmul) and adds
// "vs torch" = our TFLOP/s / torch's (above 1: faster than torch).
//
//   build/bench/gemm --dtype bf16 --sizes 1024,2048,4096,8192 --gpt2 --reference torch_gemm.json
//   build/bench/gemm --device cpu --sizes 64,128 --iters 2 --json
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/args.h"
#include "bench/device.h"
#include "bench/timing.h"
#include "zerograd.h"

using namespace zg;
using Json = nlohmann::ordered_json;

namespace {

constexpr int kWarmup = 3;  // untimed products per row: cuBLAS picks its kernel, the allocator caches the blocks

// C [M, N] = op(A) op(B), with A stored [K, M] when trans_a (else [M, K]) and B stored
// [N, K] when trans_b (else [K, N]): matmul reads the transposes in place.
struct Product {
  std::string name, formula;
  int64_t m, n, k;
  bool trans_a = false, trans_b = false;
};

Product square(int64_t n) { return {"square " + std::to_string(n), "A B", n, n, n}; }

// GPT-2 124M (n_embd 768, vocabulary padded to 50304 as llm.c does), `tokens` = B * T
// rows. Each linear layer y = x W^T, W [out, in], takes three products per step, in
// the layouts autograd/functions/linalg.cpp's backward uses:
//   forward       y    = x W^T    [T, out] = [T, in] [out, in]^T    M = T,  N = out, K = in
//   input grad    dx   = dy W     [T, in]  = [T, out] [out, in]     M = T,  N = in,  K = out
//   weight grad   dW^T = x^T dy   [in, out] = [T, in]^T [T, out]    M = in, N = out, K = T
// (Attention's own products, per head, are not among them.)
std::vector<Product> gpt2_products(int64_t tokens) {
  struct Linear {
    const char* name;
    int64_t in, out;
  };
  const Linear layers[] = {{"qkv", 768, 2304}, {"attn proj", 768, 768}, {"fc", 768, 3072},
                           {"mlp proj", 3072, 768}, {"lm head", 768, 50304}};
  std::vector<Product> products;
  for (const Linear& l : layers) {
    const std::string name = std::string("gpt2 ") + l.name;
    products.push_back({name + " fwd", "x W^T", tokens, l.out, l.in, false, true});
    products.push_back({name + " dx", "dy W", tokens, l.in, l.out, false, false});
    products.push_back({name + " dW", "x^T dy", l.in, l.out, tokens, true, false});
  }
  return products;
}

// Milliseconds per product of `p` in `dtype` on `device`, N(0, 1) operands.
double time_product(const Product& p, DType dtype, Device device, int64_t iters) {
  const TensorOptions options = TensorOptions(dtype).device(device);
  const Tensor a = randn(p.trans_a ? Shape{p.k, p.m} : Shape{p.m, p.k}, options);
  const Tensor b = randn(p.trans_b ? Shape{p.n, p.k} : Shape{p.k, p.n}, options);
  auto product = [&] { matmul(a, b, p.trans_a, p.trans_b); };  // the output goes back to the allocator at once
  {
    const Tensor c = matmul(a, b, p.trans_a, p.trans_b);  // the first warm-up product
    ZG_CHECK(c.shape() == Shape({p.m, p.n}), "gemm: ", p.name, " gave ", describe(c), ", expected [", p.m, ", ",
             p.n, "]");
  }
  for (int i = 1; i < kWarmup; ++i) product();
  return bench::ms_per_call(product, iters, device);
}

std::string row_key(const std::string& name, const std::string& dtype) { return name + " / " + dtype; }

// TFLOP/s of bench/torch_gemm.py's rows, by row_key; checks they were measured on `device`.
std::map<std::string, double> read_reference(const std::string& path, const std::string& device, std::string& library) {
  std::ifstream file(path);
  ZG_CHECK(std::filesystem::is_regular_file(path) && file.good(), "gemm: cannot open --reference ", path);
  Json records;
  try {
    records = Json::parse(file);
  } catch (const Json::exception& e) {
    fail("gemm: --reference ", path, " is not JSON: ", e.what());
  }
  ZG_CHECK(records.is_array(), "gemm: --reference ", path,
           " should hold a list of records (bench/torch_gemm.py --json)");
  std::map<std::string, double> tflops;
  for (const Json& r : records) {
    try {
      ZG_CHECK(r.at("device").get<std::string>() == device, "gemm: --reference ", path, " was measured on ",
               r.at("device").get<std::string>(), ", this run is on ", device);
      tflops[row_key(r.at("name").get<std::string>(), r.at("dtype").get<std::string>())] = r.at("tflops").get<double>();
      library = r.at("library").get<std::string>();
    } catch (const Json::exception& e) {
      fail("gemm: --reference ", path, ": a record lacks a field: ", e.what());
    }
  }
  return tflops;
}

std::vector<DType> parse_dtypes(const std::string& arg) {
  if (arg == "all") return {DType::bf16, DType::f16, DType::f32};
  for (DType d : {DType::bf16, DType::f16, DType::f32})
    if (arg == name(d)) return {d};
  fail("gemm: --dtype must be bf16, f16, f32 or all, got '", arg, "'");
}

void usage() {
  std::printf(
      "usage: gemm [--device cuda|cpu] [--dtype bf16|f16|f32|all] [--sizes 1024,2048,4096,8192] [--gpt2]\n"
      "            [--tokens 16384] [--iters 20] [--json] [--reference torch.json]\n"
      "TFLOP/s of zg::matmul (flops = 2 M N K) for square M = N = K sizes and, with --gpt2, the\n"
      "forward and backward products of GPT-2 124M's linear layers at --tokens rows (B * T).\n"
      "Defaults: --device cuda, --dtype bf16, --sizes 1024,2048,4096,8192 (128,256,512 on the cpu).\n"
      "--reference: the JSON of bench/torch_gemm.py --json FILE; adds vs torch = ours / torch's.\n");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string device_arg = "cuda", dtype_arg = "bf16", reference_path;
    std::vector<int64_t> sizes;
    int64_t tokens = 16384, iters = 20;
    bool gpt2 = false, json = false;
    bench::Args args("gemm", argc, argv);
    while (!args.done()) {
      const std::string flag = args.next();
      if (flag == "--device") device_arg = args.value(flag);
      else if (flag == "--dtype") dtype_arg = args.value(flag);
      else if (flag == "--sizes") sizes = args.counts(flag);
      else if (flag == "--gpt2") gpt2 = true;
      else if (flag == "--tokens") tokens = args.count(flag);
      else if (flag == "--iters") iters = args.count(flag);
      else if (flag == "--json") json = true;
      else if (flag == "--reference") reference_path = args.value(flag);
      else if (flag == "--help") {
        usage();
        return 0;
      } else {
        fail("gemm: unknown flag '", flag, "' (--help lists them)");
      }
    }
    const Device device = bench::parse_device("gemm", device_arg);
    const std::vector<DType> dtypes = parse_dtypes(dtype_arg);
    if (sizes.empty()) sizes = device.type == DeviceType::cpu ? std::vector<int64_t>{128, 256, 512}
                                                              : std::vector<int64_t>{1024, 2048, 4096, 8192};
    std::vector<Product> products;
    for (int64_t n : sizes) products.push_back(square(n));
    if (gpt2)
      for (const Product& p : gpt2_products(tokens)) products.push_back(p);
    std::string torch_library;
    std::map<std::string, double> torch_tflops;
    if (!reference_path.empty()) torch_tflops = read_reference(reference_path, device.str(), torch_library);

    if (!json) {
      std::printf("zg::matmul on %s: %lld timed products per row after %d untimed; flops = 2 M N K\n",
                  bench::describe_device(device).c_str(), (long long)iters, kWarmup);
      if (!reference_path.empty())
        std::printf("vs torch = ours / %s's TFLOP/s, from %s\n", torch_library.c_str(), reference_path.c_str());
      std::printf("\n%-22s %-7s %6s %6s %6s %5s %10s %9s%s\n", "shape", "product", "M", "N", "K", "dtype", "ms",
                  "TFLOP/s", reference_path.empty() ? "" : "  vs torch");
    }
    Json records = Json::array();
    for (DType dtype : dtypes) {
      for (const Product& p : products) {
        const double ms = time_product(p, dtype, device, iters);
        const double tflops = 2.0 * p.m * p.n * p.k / (ms * 1e-3) / 1e12;
        const auto torch = torch_tflops.find(row_key(p.name, name(dtype)));
        const bool compared = torch != torch_tflops.end();
        Json r = {{"name", p.name}, {"product", p.formula}, {"m", p.m},           {"n", p.n},
                  {"k", p.k},       {"dtype", name(dtype)}, {"device", device.str()}, {"library", "zerograd"},
                  {"iters", iters}, {"ms", ms},             {"tflops", tflops}};
        if (!reference_path.empty()) r["vs_torch"] = compared ? Json(tflops / torch->second) : Json(nullptr);
        records.push_back(r);
        if (json) continue;
        std::printf("%-22s %-7s %6lld %6lld %6lld %5s %10.4f %9.3f", p.name.c_str(), p.formula.c_str(), (long long)p.m,
                    (long long)p.n, (long long)p.k, name(dtype), ms, tflops);
        if (!reference_path.empty()) {
          if (compared) std::printf("  %8.2f", tflops / torch->second);
          else std::printf("  %8s", "-");
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }
    if (json) {
      std::printf("[\n");
      for (size_t i = 0; i < records.size(); ++i)
        std::printf("  %s%s\n", records[i].dump().c_str(), i + 1 < records.size() ? "," : "");
      std::printf("]\n");
    }
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
