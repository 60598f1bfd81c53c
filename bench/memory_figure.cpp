// memory_figure: traces side by side on one scale, as one SVG -- the traces that
// zero_memory --timeline, train_gpt --trace and train_zero --trace write. Each panel is
// one rank's allocator through its trace (the device whose bytes peak highest, unless
// --device names one), with the levels the trace carries (zero_memory's formula).
//
//   build/bench/memory_figure --out cmp.svg --title "Checkpointing" a/stage-0.json "kept" b/stage-0.json "recomputed"
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"
#include "tensor/atomic_file.h"
#include "zerograd.h"

using namespace zg;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ZG_CHECK(in.good(), "memory_figure: cannot read ", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The allocator (a counter's name less its last word) of `rank` whose bytes reach highest.
std::string busiest_allocator(const std::string& trace, int rank, const std::string& path) {
  const nlohmann::json doc = nlohmann::json::parse(trace, nullptr, false);
  ZG_CHECK(!doc.is_discarded() && doc.contains("traceEvents"), "memory_figure: ", path, " is not a trace");
  std::map<std::string, int64_t> most;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("ph", "") != "C" || e.value("pid", -1) != rank) continue;
    const std::string name = e.value("name", "");
    const size_t space = name.rfind(' ');
    if (space == std::string::npos || name.starts_with("host pool ") || name.ends_with(" reserved")) continue;
    const int64_t bytes = e["args"].value("bytes", int64_t{0});
    int64_t& m = most[name.substr(0, space)];
    m = std::max(m, bytes);
  }
  ZG_CHECK(!most.empty(), "memory_figure: ", path, " has no memory counters of rank ", rank);
  std::string best = most.begin()->first;
  for (const auto& [allocator, bytes] : most)
    if (bytes > most[best]) best = allocator;
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    bench::Args args("memory_figure", argc, argv);
    std::string out, title = "Bytes by category", device;
    int rank = 0;
    bool reserved = false;
    std::vector<std::pair<std::string, std::string>> traces;  // path, label
    while (!args.done()) {
      const std::string word = args.next();
      if (word == "--out") out = args.value(word);
      else if (word == "--title") title = args.value(word);
      else if (word == "--device") device = args.value(word);
      else if (word == "--rank") {
        const double r = args.number(word);
        ZG_CHECK(r >= 0 && r == std::floor(r) && r < 1e6, "memory_figure: --rank needs a whole number >= 0, got ", r);
        rank = static_cast<int>(r);
      }
      else if (word == "--reserved") reserved = true;
      else if (word == "--help" || word.starts_with("--")) {
        std::printf("usage: memory_figure --out FILE.svg [--title T] [--device D] [--rank R] [--reserved] "
                    "TRACE LABEL [TRACE LABEL ...]\n"
                    "Draws each trace's rank R (default 0) as a panel, all on one scale; --reserved adds the\n"
                    "allocator's reserved bytes as a line.\n");
        return word == "--help" ? 0 : 2;
      } else {
        ZG_CHECK(!args.done(), "memory_figure: trace ", word, " needs a label after it");
        traces.emplace_back(word, args.next());
      }
    }
    ZG_CHECK(!out.empty() && !traces.empty(), "memory_figure: give --out FILE.svg and at least one TRACE LABEL pair");
    std::vector<MemoryPanel> panels;
    for (const auto& [path, label] : traces) {
      const std::string trace = read_file(path);
      const std::string allocator = device.empty() ? busiest_allocator(trace, rank, path) : device;
      panels.push_back({label, memory_series(trace, rank, allocator), trace_levels(trace), reserved});
    }
    write_file_atomically(out, memory_figure_svg(panels, title), "memory_figure");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
