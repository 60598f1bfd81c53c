// collectives: how long all_reduce, reduce_scatter and all_gather take on this machine's
// process groups, next to the alpha-beta model (Hockney; Thakur, Rabenseifner and Gropp
// 2005) and the bytes each rank sends:
//
//   time = steps x alpha + bytes sent / beta
//   ring    all_reduce     2(N-1) steps, 2(N-1)/N x the buffer sent a rank
//           reduce_scatter  (N-1) steps,  (N-1)/N x the full buffer
//           all_gather      (N-1) steps,  (N-1)/N x the full buffer
//
// Each row is one size: the median of --iters calls on rank 0 (a barrier before each, so
// the ranks start together), the group's own count of the bytes sent in one call
// (ProcessGroup::bytes_sent) beside the formula, and the model's time with alpha and beta
// fitted to that collective's rows by least squares on relative error. A fourth row set,
// reduce_scatter+all_gather, is an all-reduce made of the two halves; before timing, both
// all-reduces are checked against the exact sum on every rank.
//
// --figure FILE draws no measurement: all-reduce time by the model for a ring, a binomial
// tree and a pipelined tree at N = 8 (NVLink) and N = 64 (InfiniBand), with the rates of
// dist::Machine (dist/comm/step_model.h), and prints where the ring overtakes the tree.
//
//   build/bench/collectives --ranks 4 --sizes 4K,64K,1M,4M
//   mpirun -n 4 build/bench/collectives --json
//   build/bench/collectives --figure docs/figures/collectives.svg
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/args.h"
#include "dist/comm/launch.h"
#include "dist/comm/local_group.h"
#include "dist/comm/step_model.h"
#include "zerograd.h"

using namespace zg;
using Json = nlohmann::ordered_json;

namespace {

constexpr int kWarmup = 3;  // untimed calls a row: scratch buffers cached, threads awake

enum class Op { all_reduce, reduce_scatter, all_gather, halves };
constexpr Op kOps[] = {Op::all_reduce, Op::reduce_scatter, Op::all_gather, Op::halves};

const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::halves: return "reduce_scatter+all_gather";
  }
  return "?";
}
bool reduces_whole(Op op) { return op == Op::all_reduce || op == Op::halves; }

// A ring's latency steps: each of N-1 steps waits for a neighbour; an all-reduce takes two rounds.
int ring_steps(Op op, int n) { return (reduces_whole(op) ? 2 : 1) * (n - 1); }
// The ring's bytes sent a rank for a full buffer of `bytes` (a multiple of N): the
// formula the group's own count is printed against.
int64_t ring_formula(Op op, int n, int64_t bytes) { return (reduces_whole(op) ? 2 : 1) * (n - 1) * bytes / n; }

// An all-reduce as a ring does it: a reduce-scatter leaves rank r the sum of slice r,
// then an all-gather hands every rank every slice. In place; numel a multiple of N.
void all_reduce_by_halves(dist::ProcessGroup& group, const Tensor& buffer) {
  const int64_t slice = buffer.numel() / group.size();
  const Tensor mine = buffer.narrow(0, group.rank() * slice, slice);
  group.reduce_scatter(buffer, mine);
  group.all_gather(mine, buffer);
}

// Both all-reduces give every rank the exact sum: rank r contributes r + 1 + (i % 7) at
// element i, small integers that f32 adds without rounding.
void check_all_reduces(dist::ProcessGroup& group, int64_t numel) {
  const int n = group.size();
  for (Op op : {Op::all_reduce, Op::halves}) {
    std::vector<float> values(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) values[static_cast<size_t>(i)] = static_cast<float>(group.rank() + 1 + i % 7);
    const Tensor buffer = tensor(values);
    if (op == Op::all_reduce) group.all_reduce(buffer);
    else all_reduce_by_halves(group, buffer);
    const float* sum = buffer.data<float>();
    for (int64_t i = 0; i < numel; ++i)
      ZG_CHECK(sum[i] == static_cast<float>(n * (n + 1) / 2 + n * (i % 7)), "collectives: ", op_name(op),
               " on rank ", group.rank(), " gave ", sum[i], " at element ", i, ", expected ",
               n * (n + 1) / 2 + n * (i % 7));
  }
}

struct Row {
  Op op;
  int64_t bytes;        // the full buffer: all-reduced, reduce-scattered from, all-gathered into
  double seconds = 0;   // median of the timed calls, rank 0
  int64_t sent = 0;     // bytes_sent() over one call
  double predicted = 0;  // the fitted model's time
};

struct Fit {
  double alpha = 0, beta = 0;  // seconds a step, bytes a second (infinite: no bandwidth term fitted; JSON null)
};

// Least squares on relative error over one collective's rows: minimise
// sum ((t - steps a - sent g) / t)^2 over a, g >= 0; alpha = a, beta = 1 / g.
Fit fit(const std::vector<Row>& rows, int steps) {
  double saa = 0, sag = 0, sgg = 0, sa = 0, sg = 0;  // the normal equations' sums
  for (const Row& r : rows) {
    const double a = steps / r.seconds, g = static_cast<double>(r.sent) / r.seconds;
    saa += a * a, sag += a * g, sgg += g * g, sa += a, sg += g;
  }
  const double det = saa * sgg - sag * sag;
  double a = (sa * sgg - sg * sag) / det, g = (sg * saa - sa * sag) / det;
  if (a < 0) a = 0, g = sg / sgg;  // the best fit with the other term alone
  if (g < 0) g = 0, a = sa / saa;
  return {a, g > 0 ? 1 / g : INFINITY};
}

struct Options {
  int ranks = 4;
  bool ranks_given = false, json = false;
  std::vector<int64_t> sizes = {int64_t(4) << 10, int64_t(16) << 10, int64_t(64) << 10,
                                int64_t(256) << 10, int64_t(1) << 20, int64_t(4) << 20};
  int64_t iters = 20;
  std::string figure;
};

// The bytes of the f32 buffer timed for --sizes `size`: rounded down to a multiple of N
// elements (at least N), so that it splits into N equal slices.
int64_t buffer_bytes(int64_t size, int n) { return std::max<int64_t>(size / 4 / n, 1) * n * 4; }

// Every row of one rank's measurement (rank 0's are printed).
std::vector<Row> measure(dist::ProcessGroup& group, const Options& o) {
  const int n = group.size();
  std::vector<Row> rows;
  for (Op op : kOps) {
    for (int64_t size : o.sizes) {
      const int64_t numel = buffer_bytes(size, n) / 4;
      const Tensor full = zeros({numel}), slice = zeros({numel / n});
      const auto call = [&] {
        switch (op) {
          case Op::all_reduce: group.all_reduce(full); break;
          case Op::reduce_scatter: group.reduce_scatter(full, slice); break;
          case Op::all_gather: group.all_gather(slice, full); break;
          case Op::halves: all_reduce_by_halves(group, full); break;
        }
      };
      Row row{op, numel * 4};
      for (int i = 0; i < kWarmup; ++i) call();
      group.reset_bytes_sent();
      call();
      row.sent = group.bytes_sent();
      std::vector<double> times;
      for (int64_t i = 0; i < o.iters; ++i) {
        group.barrier();
        const auto start = std::chrono::steady_clock::now();
        call();
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
      row.seconds = times[times.size() / 2];
      rows.push_back(row);
    }
  }
  return rows;
}

// "4 KiB", "1 MiB", else bytes.
std::string size_label(int64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

void report(const std::string& kind, int n, const Options& o, std::vector<Row> rows) {
  Json records = Json::array();
  if (!o.json) {
    std::printf("%s group, %d ranks%s, f32 buffers; each time the median of %lld calls on rank 0\n", kind.c_str(), n,
                kind == "local" ? " (threads of this process)" : " (processes)", (long long)o.iters);
    std::printf("model: time = steps x alpha + bytes sent / beta, alpha and beta fitted to each collective's rows\n");
  }
  for (Op op : kOps) {
    std::vector<Row> mine;
    for (const Row& r : rows)
      if (r.op == op) mine.push_back(r);
    const int steps = ring_steps(op, n);
    const Fit f = mine.size() >= 2 ? fit(mine, steps) : Fit{};
    if (!o.json)
      std::printf("\n%s: steps %s = %d, sent %s x the buffer; alpha %.2f us, beta %.3f GB/s\n%10s %12s %12s %12s %12s\n",
                  op_name(op), reduces_whole(op) ? "2(N-1)" : "N-1", steps, reduces_whole(op) ? "2(N-1)/N" : "(N-1)/N",
                  f.alpha * 1e6, f.beta / 1e9,
                  "size", "measured", "predicted", "sent/rank", "formula");
    for (Row& r : mine) {
      r.predicted = steps * f.alpha + static_cast<double>(r.sent) / f.beta;
      const int64_t formula = ring_formula(op, n, r.bytes);
      if (o.json) {
        records.push_back({{"group", kind}, {"ranks", n}, {"op", op_name(op)}, {"bytes", r.bytes},
                           {"iters", o.iters}, {"seconds", r.seconds}, {"predicted_seconds", r.predicted},
                           {"steps", steps}, {"alpha_seconds", f.alpha}, {"beta_bytes_per_second", f.beta},
                           {"sent", r.sent}, {"formula_sent", formula}});
        continue;
      }
      std::printf("%10s %9.1f us %9.1f us %12lld %12lld\n", size_label(r.bytes).c_str(), r.seconds * 1e6,
                  r.predicted * 1e6, (long long)r.sent, (long long)formula);
    }
  }
  if (o.json) std::printf("%s\n", records.dump(1).c_str());
}

// ---- --figure: the model's all-reduce time, ring against trees -----------------------

struct Link {
  int n;
  const char* name;
  double alpha, beta;
};

// All-reduce of `bytes` in seconds (the alpha-beta model; L = ceil(log2 N)):
//   ring              2(N-1) alpha + 2(N-1)/N bytes / beta
//   binomial tree     2L (alpha + bytes / beta): reduce up L levels, broadcast down, whole buffer each hop
//   pipelined tree    2L alpha + 2(N-1)/N bytes / beta: NCCL's double binary tree, chunked; what
//                     dist::predict assumes (the fewer steps, the ring's bytes)
double ring_time(const Link& l, double bytes) { return 2.0 * (l.n - 1) * l.alpha + 2.0 * (l.n - 1) / l.n * bytes / l.beta; }
double levels(const Link& l) { return std::ceil(std::log2(l.n)); }
double tree_time(const Link& l, double bytes) { return 2 * levels(l) * (l.alpha + bytes / l.beta); }
double pipelined_time(const Link& l, double bytes) { return 2 * levels(l) * l.alpha + 2.0 * (l.n - 1) / l.n * bytes / l.beta; }
// Where ring_time = tree_time.
double crossover(const Link& l) {
  return (l.n - 1 - levels(l)) * l.alpha * l.beta / (levels(l) - (l.n - 1.0) / l.n);
}

std::string fmt(const char* format, double a, double b = 0, double c = 0, double d = 0) {
  char text[256];
  std::snprintf(text, sizeof text, format, a, b, c, d);
  return text;
}

void draw_figure(const std::string& path, const std::vector<Link>& links) {
  constexpr double kWidth = 880, kHeight = 372, kPanelW = 360, kPanelH = 230, kTop = 78, kLeft[] = {70, 500};
  constexpr double kMinLog2 = 10, kMaxLog2 = 30, kMinLog10 = -6, kMaxLog10 = 0;  // 1 KiB..1 GiB, 1 us..1 s
  struct Curve {
    const char* label;
    const char* colour;
    const char* dash;
    double (*time)(const Link&, double);
  };
  const Curve curves[] = {{"ring", "#4e79a7", "", ring_time},
                          {"binomial tree", "#e15759", " stroke-dasharray=\"6,3\"", tree_time},
                          {"pipelined tree (NCCL; dist::predict)", "#59a14f", " stroke-dasharray=\"2,2\"", pipelined_time}};
  std::string svg = fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                        "font-family=\"sans-serif\" font-size=\"11\">\n", kWidth, kHeight, kWidth, kHeight);
  svg += fmt("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", kWidth, kHeight);
  svg += "<text x=\"12\" y=\"20\" font-size=\"14\" font-weight=\"bold\">All-reduce time by the alpha-beta model: "
         "steps x alpha + bytes / beta</text>\n";
  double lx = 12;
  for (const Curve& c : curves) {
    svg += fmt("<line x1=\"%.1f\" y1=\"44\" x2=\"%.1f\" y2=\"44\" stroke-width=\"2\" ", lx, lx + 20) + "stroke=\"" +
           c.colour + "\"" + c.dash + "/>" + fmt("<text x=\"%.1f\" y=\"48\">", lx + 25) + c.label + "</text>\n";
    lx += 40 + 5.6 * static_cast<double>(std::string(c.label).size());
  }
  svg += fmt("<line x1=\"%.1f\" y1=\"44\" x2=\"%.1f\" y2=\"44\" stroke=\"#999\" stroke-dasharray=\"3,3\"/>", lx, lx + 20) +
         fmt("<text x=\"%.1f\" y=\"48\">ring = binomial tree</text>\n", lx + 25);
  for (size_t p = 0; p < links.size(); ++p) {
    const Link& l = links[p];
    const double x0 = kLeft[p], y0 = kTop + kPanelH;
    const auto x_of = [&](double bytes) { return x0 + (std::log2(bytes) - kMinLog2) / (kMaxLog2 - kMinLog2) * kPanelW; };
    const auto y_of = [&](double s) {
      const double y = (std::log10(s) - kMinLog10) / (kMaxLog10 - kMinLog10);
      return y0 - std::clamp(y, 0.0, 1.0) * kPanelH;
    };
    svg += fmt("<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">", x0, kTop - 8) + "N = " + std::to_string(l.n) +
           ", " + l.name + fmt(": alpha %.0f us, beta %.0f GB/s</text>\n", l.alpha * 1e6, l.beta / 1e9);
    for (int e = static_cast<int>(kMinLog10); e <= static_cast<int>(kMaxLog10); ++e) {
      static const char* kTimes[] = {"1 us", "10 us", "100 us", "1 ms", "10 ms", "100 ms", "1 s"};
      const double y = y_of(std::pow(10.0, e));
      svg += fmt("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e0e0e0\"/>", x0, y, x0 + kPanelW, y) +
             fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", x0 - 6, y + 4) + kTimes[e - static_cast<int>(kMinLog10)] + "</text>\n";
    }
    for (int b = static_cast<int>(kMinLog2); b <= static_cast<int>(kMaxLog2); b += 5) {
      static const char* kSizes[] = {"1 KiB", "32 KiB", "1 MiB", "32 MiB", "1 GiB"};
      const double x = x_of(std::ldexp(1.0, b));
      svg += fmt("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e0e0e0\"/>", x, kTop, x, y0) +
             fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", x, y0 + 16) + kSizes[(b - 10) / 5] + "</text>\n";
    }
    svg += fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"black\"/>\n", x0, kTop,
               kPanelW, kPanelH);
    svg += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">all-reduced buffer (bytes)</text>\n",
               x0 + kPanelW / 2, y0 + 32);
    const double cross = x_of(crossover(l));
    svg += fmt("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#999\" stroke-dasharray=\"3,3\"/>", cross,
               kTop, cross, y0) +
           fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", cross - 3, kTop + 14) +
           fmt("%.2f MB</text>\n", crossover(l) / 1e6);
    for (const Curve& c : curves) {
      std::string points;
      for (double b = kMinLog2; b <= kMaxLog2 + 1e-9; b += 0.25) {
        const double bytes = std::ldexp(1.0, static_cast<int>(std::floor(b))) * std::pow(2.0, b - std::floor(b));
        points += fmt(" %.1f,%.1f", x_of(bytes), y_of(c.time(l, bytes)));
      }
      svg += std::string("<polyline fill=\"none\" stroke-width=\"2\" stroke=\"") + c.colour + "\"" + c.dash +
             " points=\"" + points.substr(1) + "\"/>\n";
    }
  }
  svg += fmt("<text x=\"12\" y=\"%.0f\" fill=\"#555\">", kHeight - 8) +
         "Rates: dist::Machine (dist/comm/step_model.h), achieved NVLink 4 within a node and 400 Gb/s InfiniBand "
         "per GPU across nodes. Log-log axes.</text>\n</svg>\n";
  std::ofstream out(path);
  ZG_CHECK(out.good(), "collectives: cannot write --figure ", path);
  out << svg;
  ZG_CHECK(out.good(), "collectives: writing --figure ", path, " failed");
}

int figure(const Options& o) {
  const dist::Machine m;
  const std::vector<Link> links = {{8, "NVLink", m.intra_latency_seconds, m.intra_bytes_per_second},
                                   {64, "InfiniBand", m.inter_latency_seconds, m.inter_bytes_per_second}};
  draw_figure(o.figure, links);
  std::printf("all-reduce by the alpha-beta model, dist::Machine's rates\n");
  std::printf("%4s %-11s %8s %10s %6s %6s %16s %18s\n", "N", "link", "alpha", "beta", "ring", "tree",
              "ring = tree at", "latency share, ring");
  std::printf("%4s %-11s %8s %10s %6s %6s %16s %9s %8s\n", "", "", "", "", "steps", "steps", "", "1 MiB", "25 MiB");
  for (const Link& l : links) {
    const auto latency_share = [&](double bytes) { return 100 * 2.0 * (l.n - 1) * l.alpha / ring_time(l, bytes); };
    std::printf("%4d %-11s %5.0f us %5.0f GB/s %6d %6.0f %13.2f MB %8.0f%% %7.0f%%\n", l.n, l.name, l.alpha * 1e6,
                l.beta / 1e9, 2 * (l.n - 1), 2 * levels(l), crossover(l) / 1e6, latency_share(1 << 20),
                latency_share(25 << 20));
  }
  std::printf("wrote %s\n", o.figure.c_str());
  return 0;
}

void usage() {
  std::printf(
      "usage: collectives [--ranks 4] [--sizes 4K,16K,64K,256K,1M,4M] [--iters 20] [--json]\n"
      "       mpirun -n N collectives [--sizes ...] [--iters ...] [--json]\n"
      "       collectives --figure FILE\n"
      "Times all_reduce, reduce_scatter, all_gather and an all-reduce made of the last two on the local\n"
      "group (--ranks threads) or, under mpirun, the mpi group (one rank a process), f32 buffers of\n"
      "--sizes bytes (K, M, G: KiB, MiB, GiB; rounded down to N equal slices). Prints each row's median\n"
      "time, the alpha-beta model's (time = steps x alpha + bytes sent / beta, fitted per collective)\n"
      "and the bytes sent a rank as the group counts them, beside the ring's formula.\n"
      "--figure FILE: measures nothing; draws the model's all-reduce time, ring against trees, at\n"
      "N = 8 and 64 with dist::Machine's rates, and prints where the two cross.\n");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o;
    bench::Args args("collectives", argc, argv);
    while (!args.done()) {
      const std::string flag = args.next();
      if (flag == "--ranks") {
        const int64_t ranks = args.count(flag);
        ZG_CHECK(ranks >= 2 && ranks <= 1024, "collectives: --ranks must be 2 to 1024 (threads), got ", ranks);
        o.ranks = static_cast<int>(ranks);
        o.ranks_given = true;
      } else if (flag == "--sizes") o.sizes = args.byte_sizes(flag);
      else if (flag == "--iters") o.iters = args.count(flag);
      else if (flag == "--json") o.json = true;
      else if (flag == "--figure") o.figure = args.value(flag);
      else if (flag == "--help") {
        usage();
        return 0;
      } else {
        fail("collectives: unknown flag '", flag, "' (--help lists them)");
      }
    }
    if (!o.figure.empty()) return figure(o);
    const auto run = [&](dist::ProcessGroup& group) {
      ZG_CHECK(group.size() >= 2, "collectives: a group of one rank sends nothing; start 2 or more");
      std::vector<int64_t> buffers;
      for (int64_t size : o.sizes) buffers.push_back(buffer_bytes(size, group.size()));
      std::sort(buffers.begin(), buffers.end());
      ZG_CHECK(std::unique(buffers.begin(), buffers.end()) - buffers.begin() >= 2, "collectives: --sizes gives ",
               "fewer than two distinct buffers at N = ", group.size(), " (each is rounded down to N f32 slices); ",
               "two are needed to fit alpha and beta");
      check_all_reduces(group, 7 * group.size());
      std::vector<Row> rows = measure(group, o);
      if (group.rank() == 0) report(group.kind(), group.size(), o, rows);
    };
    if (dist::launched_as_rank()) {
#if ZG_HAVE_MPI
      ZG_CHECK(!o.ranks_given, "collectives: under mpirun the ranks are its processes; leave --ranks out");
      return dist::run_mpi(run);
#else
      fail("collectives: launched by mpirun, but this build has no mpi group (install libopenmpi-dev and rebuild)");
#endif
    }
    dist::run_local(o.ranks, run);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
