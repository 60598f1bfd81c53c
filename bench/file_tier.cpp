// file_tier: the file tier's write and read rates (tensor/file_tier.h: ZeRO-Infinity's NVMe
// tier) next to dd's with O_DIRECT on the same folder in the same run. --mib MiB of host-pool
// tensors of --tensor-mib each are paged out (all writes in flight, then settled) and paged
// back in, and dd writes and reads a file of the same size, iflag / oflag=direct, in turn,
// --repeats times (the best of each kept), dd in blocks of a tensor's size and of 4 MiB; the
// ratio is to the faster dd. (dd reuses one buffer; the tier reads into the state's own
// memory, host-pool blocks backed by huge pages: tensor/cpu/backend.cpp.) Rates in MB/s (1e6 bytes).
//
//   build/bench/file_tier --dir /tmp --mib 1024
//   build/bench/file_tier --dir /mnt/nvme --mib 4096 --threads 8 --json
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "bench/args.h"
#include "zerograd.h"

namespace {

using namespace zg;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// dd's own figure: the bytes it copied over the seconds it reports ("... copied, 1.2 s, ...").
double dd_rate(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  ZG_CHECK(pipe, "file_tier: cannot run ", command);
  std::string out;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe)) out += buffer;
  const int status = ::pclose(pipe);
  std::smatch m;
  ZG_CHECK(status == 0 && std::regex_search(out, m, std::regex(R"((\d+) bytes.*copied, ([0-9.e+-]+) s)")),
           "file_tier: ", command, " failed: ", out);
  return std::stod(m[1]) / std::stod(m[2]) / 1e6;
}

struct Rates {
  double write = 0, read = 0;
};

// Both rates, the tier's and dd's taken in turn in each repeat, the best of each kept. Each
// repeat writes new files (a new tier, dd's under a new name), so both land on blocks the
// file system hands out alike: a virtual disk's host caches recently used blocks, and dd
// reading back the same blocks every repeat would be timed against that cache. The tier's
// rates: every tensor's write in flight at once, then every read.
struct Measured {
  Rates tier, dd, dd_small;  // dd in blocks of a tensor's size, and of 4 MiB
  bool direct = false;
};
Measured measure(const std::string& dir, int64_t mib, int64_t tensor_mib, int threads, int repeats) {
  std::vector<Tensor> tensors;
  for (int64_t at = 0; at < mib; at += tensor_mib) {
    tensors.push_back(empty({tensor_mib << 18}, TensorOptions(DType::f32).pinned(true)));  // 4 bytes an element
    tensors.back().fill_(static_cast<double>(at));
  }
  const double bytes = static_cast<double>(mib) * (1 << 20);
  Measured best;
  for (int r = 0; r < repeats; ++r) {
    {
      auto tier = std::make_shared<FileTier>(dir, "bench", kCPU, threads);
      std::vector<std::unique_ptr<PagedTensor>> paged;
      for (const Tensor& t : tensors) paged.push_back(std::make_unique<PagedTensor>(tier, t, "bench tensor"));
      auto start = std::chrono::steady_clock::now();
      for (auto& p : paged) p->page_out(true);
      for (auto& p : paged) p->settle(true);
      best.tier.write = std::max(best.tier.write, bytes / seconds_since(start) / 1e6);
      start = std::chrono::steady_clock::now();
      for (auto& p : paged) p->page_in();
      for (auto& p : paged) p->wait();
      best.tier.read = std::max(best.tier.read, bytes / seconds_since(start) / 1e6);
      best.direct = tier->stats().direct;
    }
    for (int64_t block : {tensor_mib, int64_t{4}}) {
      Rates& to = block == 4 ? best.dd_small : best.dd;
      const std::string file = dir + "/zerograd-dd-" + std::to_string(::getpid()) + "-" + std::to_string(r);
      const std::string bs = " bs=" + std::to_string(block) + "M";
      to.write = std::max(to.write, dd_rate("dd if=/dev/zero of=" + file + bs + " count=" +
                                            std::to_string(mib / block) + " oflag=direct"));
      to.read = std::max(to.read, dd_rate("dd if=" + file + " of=/dev/null" + bs + " iflag=direct"));
      std::filesystem::remove(file);
    }
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string dir = std::filesystem::temp_directory_path().string();
    int64_t mib = 1024, tensor_mib = 64;
    int threads = 4, repeats = 3;
    bool json = false;
    bench::Args args("file_tier", argc, argv);
    while (!args.done()) {
      const std::string flag = args.next();
      if (flag == "--dir") dir = args.value(flag);
      else if (flag == "--mib") mib = args.count(flag);
      else if (flag == "--tensor-mib") tensor_mib = args.count(flag);
      else if (flag == "--threads") threads = static_cast<int>(args.count(flag));
      else if (flag == "--repeats") repeats = static_cast<int>(args.count(flag));
      else if (flag == "--json") json = true;
      else fail("file_tier: unknown flag ", flag, "; flags: --dir --mib --tensor-mib --threads --repeats --json");
    }
    ZG_CHECK(mib >= tensor_mib && mib % tensor_mib == 0 && mib % 4 == 0, "file_tier: --mib ", mib,
             " must be a multiple of --tensor-mib ", tensor_mib, " and of 4 (dd's blocks)");
    const Measured m = measure(dir, mib, tensor_mib, threads, repeats);
    const Rates &tier = m.tier, &dd = m.dd, &dd_small = m.dd_small;
    const bool direct = m.direct;
    if (json) {
      std::printf("{\"dir\": \"%s\", \"mib\": %lld, \"threads\": %d, \"direct\": %s, \"tier_write_mbps\": %.1f, "
                  "\"tier_read_mbps\": %.1f, \"dd_write_mbps\": %.1f, \"dd_read_mbps\": %.1f, \"dd_4m_write_mbps\": %.1f, "
                  "\"dd_4m_read_mbps\": %.1f}\n",
                  dir.c_str(), static_cast<long long>(mib), threads, direct ? "true" : "false", tier.write, tier.read,
                  dd.write, dd.read, dd_small.write, dd_small.read);
      return 0;
    }
    std::printf("%s, %lld MiB in %lld MiB tensors, %d I/O threads, %s; best of %d (MB/s)\n", dir.c_str(),
                static_cast<long long>(mib), static_cast<long long>(tensor_mib), threads,
                direct ? "O_DIRECT" : "buffered (the folder refused O_DIRECT)", repeats);
    const std::string dd_title = "dd bs=" + std::to_string(tensor_mib) + "M";
    std::printf("%-6s %12s %12s %12s %8s\n", "", "file tier", dd_title.c_str(), "dd bs=4M", "ratio");
    std::printf("%-6s %12.1f %12.1f %12.1f %8.2f\n", "write", tier.write, dd.write, dd_small.write,
                tier.write / std::max(dd.write, dd_small.write));
    std::printf("%-6s %12.1f %12.1f %12.1f %8.2f\n", "read", tier.read, dd.read, dd_small.read,
                tier.read / std::max(dd.read, dd_small.read));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
