// The planner's search, ranking and report (bench/plan.h); the dry runs are zero_memory's.
#include "bench/plan.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "tensor/error.h"
#include "tensor/svg.h"

namespace zg::bench {

std::string Candidate::setting() const {
  std::string out = stage == 0 ? "DDP" : "ZeRO-" + std::to_string(stage);
  if (stage >= 2 && shard_group != dp) out += " S=" + std::to_string(shard_group);
  if (offload != dist::Offload::none) out += std::string(" offload ") + dist::name(offload);
  if (cp > 1) out += std::string(" ") + dist::name(cp_variant);
  return out;
}

std::string Candidate::mesh() const {
  return concat(dp / shard_group, "x", shard_group, "x", tp, "x", pp, cp > 1 ? concat(" cp", cp) : "");
}

namespace {

std::vector<int> powers_of_two_dividing(int64_t n, int64_t most) {
  std::vector<int> out;
  for (int64_t k = 1; k <= most && n % k == 0; k *= 2) out.push_back(static_cast<int>(k));
  return out;
}

// Whether tp ranks can cut the model: its heads, key/value heads and MLP features.
bool cuts(const ModelShape& model, int tp) {
  const int64_t features = model.is_gpt() ? 4 * model.width() : nn::intermediate_size(std::get<nn::LlamaConfig>(model.config));
  return model.heads() % tp == 0 && model.kv_heads() % tp == 0 && features % tp == 0 && model.vocab() % tp == 0;
}

// What to try where `c` did not fit: the next rung of a ladder of memory savers, cheapest
// first. Each level -- none, activation checkpointing, the optimizer's state on the host
// (with and without checkpointing; at stage 3 then the parameters' master too) -- from the
// largest micro-batch down to one row (with a pipeline, its micro-batch stays). The first
// rung that fits ends the ladder: what follows saves more memory, and costs more time.
std::optional<Candidate> next_saver(const Candidate& c) {
  Candidate next = c;
  if (c.rows > 1 && c.pp == 1) {
    next.rows /= 2, next.micro_batches *= 2;
    return next;
  }
  const int64_t per_rank = c.rows * c.micro_batches;
  if (c.pp == 1) next.rows = powers_of_two_dividing(per_rank, 8).back(), next.micro_batches = static_cast<int>(per_rank / next.rows);
  if (!c.checkpointing) {
    next.checkpointing = true;
    return next;
  }
  // Offload's levels: a CPU optimizer beside a pipeline is refused (dist/zero/zero_config.h).
  next.checkpointing = false;
  if (c.stage == 0 || c.pp > 1 || c.offload == dist::Offload::optimizer_and_params) return std::nullopt;
  if (c.offload == dist::Offload::optimizer && c.stage != 3) return std::nullopt;
  next.offload = c.offload == dist::Offload::none ? dist::Offload::optimizer : dist::Offload::optimizer_and_params;
  return next;
}

std::string key(const Candidate& c) {
  return concat(c.setting(), c.mesh(), c.rows, "x", c.micro_batches, c.checkpointing);
}

// Evaluates every candidate on `threads` threads (each call owns its Context).
std::vector<PlannedSetting> evaluate_all(const std::vector<Candidate>& candidates, const Evaluate& evaluate, int threads) {
  std::vector<PlannedSetting> out(candidates.size());
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t i; (i = next++) < candidates.size();) {
      out[i].candidate = candidates[i];
      try {
        out[i].evaluation = evaluate(candidates[i]);
      } catch (const std::exception& e) {
        out[i].evaluation.error = e.what();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::max(threads, 1); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  return out;
}

// Bytes in GB (1e9), or in MB on GPUs of less than a GB (a toy cluster for a toy model).
struct ByteUnit {
  double scale;
  const char* name;
  explicit ByteUnit(int64_t limit) : scale(limit >= 1'000'000'000 ? 1e9 : 1e6), name(scale == 1e9 ? "GB" : "MB") {}
  explicit ByteUnit(const Cluster& c) : ByteUnit(c.gpu_memory) {}
  double operator()(int64_t bytes) const { return static_cast<double>(bytes) / scale; }
  int digits() const { return scale == 1e9 ? 1 : 3; }
  std::string text(int64_t bytes) const { return svg_fmt("%.3g ", (*this)(bytes)) + name; }
};
std::string ms(double seconds) { return svg_fmt(std::abs(seconds) >= 0.1 ? "%.0f" : "%.3g", seconds * 1e3); }
// "ZeRO-3 on 1x64x1x1 (micro-batch 1 x 2, checkpointing)"
std::string described(const Candidate& c) {
  return concat(c.setting(), " on ", c.mesh(), " (micro-batch ", c.rows, " x ", c.micro_batches,
                c.checkpointing ? ", checkpointing" : "", ")");
}

}  // namespace

// The context-parallel splits worth trying for tp ranks of a sequence: none, and C ranks of
// each variant wherever a rank keeps at least 8,192 tokens (fewer, and the keys' and values'
// traffic outweighs the attention it spreads) and Ulysses' where the heads divide.
std::vector<std::pair<int, dist::ContextVariant>> context_splits(const ModelShape& model, int64_t seq, int tp, int ranks) {
  std::vector<std::pair<int, dist::ContextVariant>> out = {{1, dist::ContextVariant::ring}};
  for (int cp = 2; cp <= ranks && ranks % cp == 0 && seq % (2 * cp) == 0 && seq / cp >= 8192; cp *= 2)
    for (dist::ContextVariant v : {dist::ContextVariant::ring, dist::ContextVariant::all_gather, dist::ContextVariant::ulysses})
      if (v != dist::ContextVariant::ulysses || (model.heads() / tp % cp == 0 && model.kv_heads() / tp % cp == 0))
        out.emplace_back(cp, v);
  return out;
}

std::vector<Candidate> plan_candidates(const PlanRequest& r) {
  const ModelShape& model = r.model;
  const int n = r.cluster.gpus;
  std::vector<Candidate> out;
  for (int tp : powers_of_two_dividing(n, r.cluster.gpus_per_node)) {
    if (!cuts(model, tp)) continue;
    for (int pp : powers_of_two_dividing(n / tp, model.layers())) {
      if (model.layers() % pp != 0) continue;
      for (const auto& [cp, variant] : context_splits(model, r.seq, tp, n / tp / pp)) {
        const int dp = n / tp / pp / cp;
        if (r.sequences % dp != 0) continue;
        const int64_t per_rank = r.sequences / dp;
        std::vector<int> groups = {dp};
        const int node = r.cluster.gpus_per_node / tp / cp;  // one node's data-parallel ranks (tp, cp innermost)
        if (node > 1 && node < dp && dp % node == 0) groups.push_back(node);
        for (int stage = 0; stage <= 3; ++stage)
          for (int s : groups) {
            if (s != dp && stage < 2) continue;  // hybrid sharding: stages 2, 3
            // Without a pipeline the largest micro-batch first (fewer, larger products: the model's
            // fastest), smaller ones as memory savers; a pipeline's bubble shrinks with more, so all.
            const std::vector<int> all_rows = powers_of_two_dividing(per_rank, 8);
            for (int rows : pp == 1 ? std::vector<int>{all_rows.back()} : all_rows) {
              const int64_t micro_batches = per_rank / rows;
              if (pp > 1 && micro_batches < pp) continue;  // 1F1B needs M >= P to fill the pipeline
              out.push_back({.tp = tp, .pp = pp, .dp = dp, .shard_group = s, .cp = cp, .cp_variant = variant,
                             .stage = stage, .rows = rows, .micro_batches = static_cast<int>(micro_batches)});
            }
          }
      }
    }
  }
  return out;
}

std::vector<PlannedSetting> plan(const PlanRequest& request, const Evaluate& evaluate, int threads, int* refused) {
  // Rounds: the candidates, then each one that did not fit with one more memory saver, and so on.
  std::vector<PlannedSetting> all;
  std::vector<Candidate> round = plan_candidates(request);
  std::set<std::string> tried;
  for (const Candidate& c : round) tried.insert(key(c));
  while (!round.empty()) {
    const size_t first = all.size();
    for (PlannedSetting& s : evaluate_all(round, evaluate, threads)) all.push_back(std::move(s));
    round.clear();
    for (size_t i = first; i < all.size(); ++i)
      if (all[i].evaluation.error.empty() && !all[i].evaluation.fits)
        if (const std::optional<Candidate> c = next_saver(all[i].candidate); c && tried.insert(key(*c)).second)
          round.push_back(*c);
  }
  const auto bad = std::stable_partition(all.begin(), all.end(),
                                         [](const PlannedSetting& s) { return s.evaluation.error.empty(); });
  if (refused) *refused = static_cast<int>(all.end() - bad);
  all.erase(bad, all.end());
  std::stable_sort(all.begin(), all.end(), [](const PlannedSetting& a, const PlannedSetting& b) {
    const Evaluation &x = a.evaluation, &y = b.evaluation;
    if (x.fits != y.fits) return x.fits;
    return x.fits ? x.tokens_per_second > y.tokens_per_second : x.peak < y.peak;
  });
  return all;
}

std::string why_it_wins(const PlanRequest& request, const std::vector<PlannedSetting>& ranked) {
  if (ranked.empty() || !ranked.front().evaluation.fits)
    return concat("No setting fits ", ByteUnit(request.cluster).text(request.cluster.gpu_memory), " a GPU",
                  request.cluster.host_memory ? " and " + ByteUnit(request.cluster.host_memory).text(request.cluster.host_memory) +
                                                    " of host memory a node" : "",
                  ": the smallest device peak is ",
                  ranked.empty() ? "-" : ByteUnit(request.cluster).text(ranked.front().evaluation.peak),
                  ranked.empty() || ranked.front().evaluation.host_fits ? "" : concat(", whose node's host pools need ",
                      ByteUnit(request.cluster.host_memory).text(ranked.front().evaluation.host_peak *
                                                                 request.cluster.gpus_per_node)),
                  ". Add GPUs or memory.\n");
  const ByteUnit unit(request.cluster);
  const PlannedSetting& top = ranked.front();
  const auto kind = [](const Candidate& c) { return concat(c.setting(), " ", c.mesh()); };
  const auto next = std::find_if(ranked.begin() + 1, ranked.end(), [&](const PlannedSetting& s) {
    return s.evaluation.fits && kind(s.candidate) != kind(top.candidate);
  });
  const auto per_gpu = [&](const Evaluation& e) { return e.tokens_per_second / request.cluster.gpus; };
  std::string out = concat(described(top.candidate), " wins: ", static_cast<int64_t>(per_gpu(top.evaluation)), " tokens/s a GPU, MFU ",
                           static_cast<int>(100 * top.evaluation.mfu + 0.5), "%, peak ", unit.text(top.evaluation.peak), " of ",
                           unit.text(request.cluster.gpu_memory), ".");
  if (next != ranked.end()) {
    const Evaluation &a = top.evaluation, &b = next->evaluation;
    // The step's parts, the next setting's minus the winner's, largest change first.
    std::vector<std::pair<const char*, double>> parts = {{"compute", b.time.compute - a.time.compute},
                                                         {"exposed communication", b.time.exposed - a.time.exposed},
                                                         {"pipeline idle", b.idle - a.idle},
                                                         {"offload", b.time.offload() - a.time.offload()}};
    std::stable_sort(parts.begin(), parts.end(),
                     [](const auto& x, const auto& y) { return std::abs(x.second) > std::abs(y.second); });
    out += concat(" The next setting of another kind, ", described(next->candidate), ", is ",
                  static_cast<int>(100 * (1 - per_gpu(b) / per_gpu(a)) + 0.5), "% slower: its step takes ",
                  ms(b.time.step - a.time.step), " ms longer (");
    for (size_t i = 0; i < parts.size() && std::abs(parts[i].second) >= 1e-3 * std::abs(parts[0].second); ++i)
      out += concat(i ? ", " : "", parts[i].first, " ", parts[i].second > 0 ? "+" : "", ms(parts[i].second), " ms");
    out += ").";
  }
  const auto faster = std::find_if(ranked.begin(), ranked.end(), [&](const PlannedSetting& s) {
    return !s.evaluation.fits && s.evaluation.tokens_per_second > top.evaluation.tokens_per_second;
  });
  if (faster != ranked.end())
    out += concat(" ", described(faster->candidate), " would be faster (",
                  static_cast<int64_t>(per_gpu(faster->evaluation)), " tokens/s a GPU) but needs ",
                  faster->evaluation.host_fits
                      ? unit.text(faster->evaluation.peak)
                      : ByteUnit(request.cluster.host_memory)
                                .text(faster->evaluation.host_peak * request.cluster.gpus_per_node) +
                            " of host memory a node",
                  ".");
  return out + "\n";
}

void print_plan(const PlanRequest& request, const dist::Machine& machine, const std::vector<PlannedSetting>& ranked,
                int top, int refused, double seconds) {
  const Cluster& c = request.cluster;
  const ByteUnit unit(c);
  std::printf("%s on %d GPUs (%d a node, %s each), global batch %lld x %lld tokens; the step-time model on\n%s\n"
              "%zu settings evaluated by dry runs in %.1f s (%d refused by the code), ranked: fitting by tokens/s; mesh =\n"
              "dp_replicate x dp_shard x tp x pp, b x M = rows a micro-batch x micro-batches a step, AC = activation\n"
              "checkpointing, host = a rank's host pool at its peak (offload), within / across = %s rank 0\n"
              "sends a step within its node / across nodes\n\n",
              request.model.title().c_str(), c.gpus, c.gpus_per_node, unit.text(c.gpu_memory).c_str(),
              static_cast<long long>(request.sequences), static_cast<long long>(request.seq), machine.describe().c_str(),
              ranked.size(), seconds, refused, unit.name);
  std::printf("%4s  %-32s %-12s %-6s %-3s %8s %8s %-4s %9s %10s %6s %10s %10s %8s\n", "rank", "setting", "mesh",
              "b x M", "AC", concat("peak ", unit.name).c_str(), concat("host ", unit.name).c_str(), "fits", "step ms", "tok/s/GPU", "MFU",
              concat("within ", unit.name).c_str(), concat("across ", unit.name).c_str(), "exposed");
  for (size_t i = 0; i < ranked.size() && static_cast<int>(i) < top; ++i) {
    const Candidate& k = ranked[i].candidate;
    const Evaluation& e = ranked[i].evaluation;
    std::printf("%4zu  %-32s %-12s %-6s %-3s %8.*f %8.*f %-4s %9.1f %10.0f %5.1f%% %10.2f %10.2f %7.1f%%\n", i + 1,
                k.setting().c_str(), k.mesh().c_str(), concat(k.rows, "x", k.micro_batches).c_str(),
                k.checkpointing ? "on" : "-", unit.digits(), unit(e.peak), unit.digits(), unit(e.host_peak),
                e.fits ? "yes" : "no", 1e3 * e.time.step,
                e.tokens_per_second / c.gpus, 100 * e.mfu, unit(e.sent_within), unit(e.sent_across),
                100 * e.time.exposed / e.time.step);
  }
  std::printf("\n%s", why_it_wins(request, ranked).c_str());
}

std::string plan_json(const PlanRequest& request, const std::vector<PlannedSetting>& ranked) {
  std::string out = "[\n";
  const auto number = [](double x) { return svg_fmt("%.9g", x); };
  for (size_t i = 0; i < ranked.size(); ++i) {
    const Candidate& k = ranked[i].candidate;
    const Evaluation& e = ranked[i].evaluation;
    out += concat(i ? ",\n" : "", "  {\"rank\": ", i + 1, ", \"model\": \"", request.model.name, "\", \"setting\": \"",
                  k.setting(), "\", \"stage\": ", k.stage, ", \"offload\": \"", dist::name(k.offload),
                  "\", \"dp_replicate\": ", k.dp / k.shard_group, ", \"dp_shard\": ", k.shard_group, ", \"tp\": ", k.tp,
                  ", \"pp\": ", k.pp, ", \"cp\": ", k.cp, ", \"cp_variant\": \"", dist::name(k.cp_variant),
                  "\", \"micro_batch_rows\": ", k.rows, ", \"micro_batches\": ", k.micro_batches,
                  ", \"activation_checkpointing\": ", k.checkpointing ? "true" : "false", ", \"peak_bytes\": ", e.peak,
                  ", \"host_peak_bytes\": ", e.host_peak, ", \"gpu_memory_bytes\": ", request.cluster.gpu_memory,
                  ", \"fits\": ", e.fits ? "true" : "false", ", \"step_seconds\": ", number(e.time.step),
                  ", \"compute_seconds\": ", number(e.time.compute), ", \"exposed_seconds\": ", number(e.time.exposed),
                  ", \"pipeline_idle_seconds\": ", number(e.idle), ", \"offload_seconds\": ", number(e.time.offload()),
                  ", \"tokens_per_second\": ", number(e.tokens_per_second), ", \"tokens_per_second_per_gpu\": ",
                  number(e.tokens_per_second / request.cluster.gpus), ", \"mfu\": ", number(e.mfu), ", \"sent_within_node_bytes\": ",
                  e.sent_within, ", \"sent_across_nodes_bytes\": ", e.sent_across, "}");
  }
  return out + "\n]\n";
}

std::string plan_svg(const PlanRequest& request, const std::vector<PlannedSetting>& ranked) {
  constexpr double kWidth = 900, kHeight = 560, kLeft = 80, kRight = 30, kTop = 60, kBottom = 60;
  ZG_CHECK(!ranked.empty(), "plan_svg: no settings to draw");
  const ByteUnit gb(request.cluster);  // GB, or MB
  double most_gb = gb(request.cluster.gpu_memory), most_tps = 0;
  for (const PlannedSetting& s : ranked) {
    most_gb = std::max(most_gb, gb(s.evaluation.peak));
    most_tps = std::max(most_tps, s.evaluation.tokens_per_second / request.cluster.gpus);
  }
  most_gb *= 1.05, most_tps *= 1.1;
  const double w = kWidth - kLeft - kRight, h = kHeight - kTop - kBottom;
  const auto x = [&](double g) { return kLeft + w * g / most_gb; };
  const auto y = [&](double t) { return kTop + h * (1 - t / most_tps); };
  std::string svg = svg_fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" ", kWidth, kHeight) +
                    svg_fmt("viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n", kWidth, kHeight) +
                    svg_fmt("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", kWidth, kHeight);
  svg += "<text x=\"12\" y=\"22\" font-size=\"14\" font-weight=\"bold\">" +
         svg_escape(concat(request.model.title(), " on ", request.cluster.gpus, " GPUs, ", request.sequences, " x ",
                           request.seq, " tokens a step: every setting's peak against its predicted speed")) +
         "</text>\n";
  const auto legend = [&](double at, const char* colour, const char* text) {
    return svg_fmt("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"", at, 40) + colour + "\"/>" +
           svg_fmt("<text x=\"%.1f\" y=\"%.1f\">", at + 8, 44) + text + "</text>\n";
  };
  svg += legend(kLeft, "#59a14f", "the planner's choice") + legend(kLeft + 150, "#4e79a7", "fits") +
         legend(kLeft + 210, "#bab0ac", "does not fit (its peak is past the line)");
  svg += svg_fmt("<line x1=\"%.1f\" y1=\"%.1f\" ", kLeft, kTop + h) + svg_fmt("x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", kLeft + w, kTop + h);
  svg += svg_fmt("<line x1=\"%.1f\" y1=\"%.1f\" ", kLeft, kTop) + svg_fmt("x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", kLeft, kTop + h);
  const double limit = x(gb(request.cluster.gpu_memory));
  svg += svg_fmt("<line class=\"limit\" x1=\"%.1f\" y1=\"%.1f\" ", limit, kTop) +
         svg_fmt("x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e15759\" stroke-dasharray=\"6 4\"/>\n", limit, kTop + h) +
         svg_fmt("<text x=\"%.1f\" y=\"%.1f\" fill=\"#e15759\">", limit + 4, kTop + 12) +
         svg_escape(gb.text(request.cluster.gpu_memory)) + " a GPU</text>\n";
  svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">peak bytes a GPU (", kLeft + w / 2, kHeight - 20) +
         gb.name + ", the dry runs')</text>\n";
  svg += svg_fmt("<text x=\"16\" y=\"%.1f\" transform=\"rotate(-90 16 %.1f)\" text-anchor=\"middle\">", kTop + h / 2,
                 kTop + h / 2) + "predicted tokens/s a GPU</text>\n";
  for (int i = 0; i <= 4; ++i) {
    const double g = most_gb * i / 4, t = most_tps * i / 4;
    svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", x(g), kTop + h + 16) + svg_fmt("%.0f</text>\n", g);
    svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", kLeft - 6, y(t) + 4) + svg_fmt("%.0f</text>\n", t);
  }
  for (size_t i = ranked.size(); i-- > 0;) {  // the best drawn last, on top
    const Evaluation& e = ranked[i].evaluation;
    const double px = x(gb(e.peak)), py = y(e.tokens_per_second / request.cluster.gpus);
    svg += svg_fmt("<circle class=\"setting\" cx=\"%.1f\" cy=\"%.1f\" r=\"", px, py) + (i == 0 ? "6" : "3.5") +
           "\" fill=\"" + (e.fits ? (i == 0 ? "#59a14f" : "#4e79a7") : "#bab0ac") + "\"><title>" +
           svg_escape(concat(ranked[i].candidate.setting(), " ", ranked[i].candidate.mesh())) + "</title></circle>\n";
    if (i == 0)
      svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">", px + 8, py - 8) +
             svg_escape(concat("best: ", ranked[i].candidate.setting(), ", ", ranked[i].candidate.mesh())) + "</text>\n";
  }
  return svg + "</svg>\n";
}

}  // namespace zg::bench
