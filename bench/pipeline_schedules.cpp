// Every pipeline schedule at one size, run on simulate()'s idealised machine: the bubble
// it leaves next to its formula, the step's length and the activations each rank holds
// at most (dist/pipeline/schedule.h). With --svg, the figure of them all.
//
//   pipeline_schedules --pp 4 --micro-batches 8 [--chunks 2] [--times F,I,W] [--orders] [--svg FILE]
#include <cstdio>

#include "args.h"
#include "dist/pipeline/schedule.h"
#include "dist/pipeline/schedule_figure.h"
#include "tensor/atomic_file.h"

using namespace zg;

int main(int argc, char** argv) try {
  bench::Args args("pipeline_schedules", argc, argv);
  int p = 4, m = 8, v = 2;
  dist::ActionTimes times;
  bool orders = false;
  std::string svg;
  while (!args.done()) {
    const std::string flag = args.next();
    if (flag == "--pp") p = static_cast<int>(args.count(flag));
    else if (flag == "--micro-batches") m = static_cast<int>(args.count(flag));
    else if (flag == "--chunks") v = static_cast<int>(args.count(flag));
    else if (flag == "--times") {
      const std::string text = args.value(flag);
      ZG_CHECK(std::sscanf(text.c_str(), "%lf,%lf,%lf", &times.forward, &times.backward_input,
                           &times.backward_weight) == 3 && times.forward > 0 && times.backward_input > 0 &&
                   times.backward_weight > 0,
               "pipeline_schedules: --times takes F,I,W, a stage's positive forward, input- and weight-gradient "
               "times, got '", text, "'");
    } else if (flag == "--orders") orders = true;
    else if (flag == "--svg") svg = args.value(flag);
    else fail("pipeline_schedules: unknown flag '", flag, "'; the flags are --pp P --micro-batches M --chunks V "
              "--times F,I,W --orders --svg FILE");
  }
  std::vector<dist::Schedule> schedules;
  for (dist::ScheduleKind kind : {dist::ScheduleKind::gpipe, dist::ScheduleKind::one_f_one_b,
                                  dist::ScheduleKind::interleaved, dist::ScheduleKind::zb_h1, dist::ScheduleKind::zb_h2})
    if (kind != dist::ScheduleKind::interleaved || m % p == 0)
      schedules.push_back(dist::make_schedule(kind, p, m, kind == dist::ScheduleKind::interleaved ? v : 1));
  std::printf("pipeline schedules at p = %d, m = %d (interleaved: v = %d chunks a rank); a stage's F = %g, I = %g, "
              "W = %g\n", p, m, v, times.forward, times.backward_input, times.backward_weight);
  std::printf("%-12s %7s %8s %6s  %s\n", "schedule", "bubble", "formula", "step", "activations held per rank");
  for (const dist::Schedule& s : schedules) {
    const dist::ActionTimes chunk = times.per_chunk(s.chunks);
    const dist::Timeline t = dist::simulate(s, chunk);
    std::string peaks;
    for (int held : t.peak_activations()) peaks += (peaks.empty() ? "" : " ") + std::to_string(held);
    std::printf("%-12s %6.1f%% %7.1f%% %6.1f  %s%s\n", dist::name(s.kind), 100 * t.bubble_fraction(),
                100 * dist::formula_bubble_fraction(s, chunk), t.makespan, peaks.c_str(),
                s.chunks > 1 ? " (chunks of 1/v of a stage)" : "");
    if (orders) std::printf("%s", s.str().c_str());
  }
  if (!svg.empty())
    write_file_atomically(svg, dist::schedule_svg(schedules, "Pipeline schedules, p = " + std::to_string(p) + ", m = " +
                                                                 std::to_string(m) + ": ranks in rows, time to the right",
                                                  times),
                          "figure");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
