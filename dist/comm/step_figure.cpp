#include "dist/comm/step_figure.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string_view>

#include "dist/comm/process_group.h"
#include "tensor/error.h"
#include "tensor/svg.h"

namespace zg::dist {

namespace {

// The memory figures' phase colours (tensor/memory_figure.cpp), and one per collective.
const char* phase_colour(const std::string& phase) {
  return phase == "forward"     ? "#9ecae1"
         : phase == "backward"  ? "#fdae6b"
         : phase == "optimizer" ? "#a1d99b"
                                : "#d9d9d9";
}
const char* collective_colour(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::all_gather: return "#76b7b2";
    case CollectiveOp::reduce_scatter: return "#9c755f";
    case CollectiveOp::all_reduce: return "#b07aa1";
    default: return "#bab0ac";
  }
}
constexpr const char* kWaitColour = "#eea3a4";
// Offload's work, wherever it runs: the CPU AdamW, copies over the host link, the disk.
const char* offload_colour(StepEvent::Kind kind) {
  return kind == StepEvent::Kind::host ? "#e7ba52" : kind == StepEvent::Kind::link ? "#8c6d31" : "#843c39";
}

// The phase an event belongs to: the last mark at or before it ("" before the first).
std::string phase_of(const StepLog& log, size_t event) {
  std::string phase;
  for (const StepMark& mark : log.marks)
    if (mark.event <= event) phase = mark.name;
  return phase;
}

// A time axis in ms: a step of 1, 2, 2.5 or 5 x 10^k giving four to eight ticks.
double tick_step(double most_ms) {
  const double raw = most_ms / 5, magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0})
    if (m * magnitude >= raw) return m * magnitude;
  return 10 * magnitude;
}

constexpr double kWidth = 960, kLeft = 110, kRight = 20, kRowH = 22, kRowGap = 6, kLegendH = 52;

// The time axis every panel shares: seconds to x, and its ticks in ms.
struct TimeAxis {
  double seconds = 0, ms_step = 0;  // the axis' length, a tick's step
  double plot_w = kWidth - kLeft - kRight;
  double x(double at) const { return kLeft + plot_w * at / seconds; }
};

std::string rect(double x, double y, double w, const std::string& fill, const std::string& extra = "") {
  return svg_fmt("<rect x=\"%.2f\" y=\"%.1f\" ", x, y) + svg_fmt("width=\"%.2f\" height=\"%.1f\" fill=\"", w, kRowH) + fill +
         "\"" + extra + "/>\n";
}
std::string row_label(double y, const std::string& label) {
  return svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", kLeft - 8, y + 15) + label + "</text>\n";
}

// Spans drawn in a row, touching ones of one colour as one.
std::string spans_row(const std::vector<StepSpan>& spans, const std::function<const char*(const StepSpan&)>& colour,
                      const TimeAxis& axis, double y) {
  std::string out;
  for (size_t i = 0; i < spans.size();) {
    const char* fill = colour(spans[i]);
    const double start = spans[i].start;
    double end = spans[i].end;
    for (++i; i < spans.size() && spans[i].start <= end && std::string_view(colour(spans[i])) == fill; ++i) end = spans[i].end;
    out += rect(axis.x(start), y, axis.x(end) - axis.x(start), fill);
  }
  return out;
}

// The compute row: the wait behind it (the whole step), then the kernels on top, coloured by
// phase, and offload's work done on the training thread by its kind.
std::string compute_row(const SchedulePanel& p, const TimeAxis& axis, double y) {
  const auto colour = [&](const StepSpan& s) {
    const StepEvent& e = p.log.events.at(s.event);
    return e.offload() ? offload_colour(e.kind) : phase_colour(phase_of(p.log, s.event));
  };
  return row_label(y, "compute") + rect(kLeft, y, axis.x(p.time.step) - kLeft, kWaitColour) +
         spans_row(p.time.compute_spans, colour, axis, y);
}

// The host thread's row (UpdateWorker's tasks), where it ran any; `y` moves past it.
std::string host_thread_row(const SchedulePanel& p, const TimeAxis& axis, double& y) {
  if (p.time.task_spans.empty()) return "";
  const auto colour = [&](const StepSpan& s) {
    const StepEvent& e = p.log.tasks.at(static_cast<size_t>(s.task))->events.at(s.event);
    return e.offload() ? offload_colour(e.kind) : phase_colour("optimizer");
  };
  std::string out = row_label(y, "host thread") + rect(kLeft, y, axis.plot_w, "#f4f4f4") +
                    spans_row(p.time.task_spans, colour, axis, y);
  y += kRowH + kRowGap;
  return out;
}

// A row per group that sent, its collectives in time; `y` moves past them.
std::string communication_rows(const SchedulePanel& p, const TimeAxis& axis, double& y) {
  std::vector<int> groups;  // the log's groups with a collective, in order
  for (const StepSpan& s : p.time.collective_spans) {
    const int g = p.log.events.at(s.event).group;
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  }
  std::sort(groups.begin(), groups.end());
  std::string out;
  for (int g : groups) {
    const StepGroup& group = p.log.groups.at(static_cast<size_t>(g));
    // Hybrid sharding's two: "8 ranks" (a node's block) and "8 ranks, stride 8" (across).
    const std::string label = groups.size() == 1 ? "communication"
                              : std::to_string(group.size) + " ranks" +
                                    (group.stride > 1 ? ", stride " + std::to_string(group.stride) : "");
    out += row_label(y, label) + rect(kLeft, y, axis.plot_w, "#f4f4f4");
    for (const StepSpan& s : p.time.collective_spans) {
      const StepEvent& e = p.log.events.at(s.event);
      if (e.group != g || s.end <= s.start) continue;
      out += rect(axis.x(s.start), y, axis.x(s.end) - axis.x(s.start), collective_colour(static_cast<CollectiveOp>(e.op)),
                  " stroke=\"white\" stroke-width=\"0.4\"");
    }
    y += kRowH + kRowGap;
  }
  return out;
}

// The axis under a panel, in ms.
std::string axis_line(const TimeAxis& axis, double y) {
  std::string out = svg_fmt("<line x1=\"%.1f\" y1=\"%.1f\" ", kLeft, y) +
                    svg_fmt("x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", kLeft + axis.plot_w, y);
  for (double ms = 0; ms <= axis.seconds * 1e3 + 1e-9; ms += axis.ms_step) {
    const double x = axis.x(ms / 1e3);
    out += svg_fmt("<line x1=\"%.2f\" y1=\"%.1f\" ", x, y) + svg_fmt("x2=\"%.2f\" y2=\"%.1f\" stroke=\"black\"/>\n", x, y + 4);
    out += svg_fmt("<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\">", x, y + 16) + svg_fmt("%g", ms) + "</text>\n";
  }
  return out + svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">ms</text>\n", kLeft - 8, y + 16);
}

// One panel: its title with the step's sum, the compute row, the communication rows, the
// axis; `y` moves past it.
std::string panel(const SchedulePanel& p, const TimeAxis& axis, double& y) {
  const StepTime& t = p.time;
  char summary[240], held[64] = "";
  if (t.offload_held > 0) std::snprintf(held, sizeof held, " + offload %.2f ms", t.offload_held * 1e3);
  std::snprintf(summary, sizeof summary, ": step %.2f ms = compute %.2f ms%s + exposed %.2f ms (%.1f%%)", t.step * 1e3,
                t.compute * 1e3, held, t.exposed * 1e3, 100 * t.exposed / t.step);
  std::string out = svg_fmt("<g class=\"panel\" data-step-seconds=\"%.9g\" ", t.step) +
                    svg_fmt("data-compute-seconds=\"%.9g\" data-exposed-seconds=\"%.9g\">\n", t.compute, t.exposed);
  out += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">", 12, y + 12) + svg_escape(p.title) +
         "<tspan font-weight=\"normal\">" + summary + "</tspan></text>\n";
  y += 20;
  out += compute_row(p, axis, y);
  y += kRowH + kRowGap;
  out += host_thread_row(p, axis, y);
  out += communication_rows(p, axis, y);
  out += axis_line(axis, y) + "</g>\n";
  y += 34;
  return out;
}

// The legend under the title: the phases, the wait, the collectives (and offload's work
// where a panel has any).
std::string legend(bool offload) {
  std::string out;
  double x = 12;
  const auto item = [&](const char* colour, const std::string& label) {
    out += svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"", x, 44) + colour + "\"/>" +
           svg_fmt("<text x=\"%.1f\" y=\"%.1f\">", x + 16, 54) + label + "</text>\n";
    x += 22 + 6.2 * static_cast<double>(label.size());
  };
  item(phase_colour("forward"), "forward");
  item(phase_colour("backward"), "backward");
  item(phase_colour("optimizer"), "optimizer");
  item(kWaitColour, "compute waits (exposed)");
  item(collective_colour(CollectiveOp::all_gather), "all-gather");
  item(collective_colour(CollectiveOp::reduce_scatter), "reduce-scatter");
  item(collective_colour(CollectiveOp::all_reduce), "all-reduce");
  if (offload) {
    item(offload_colour(StepEvent::Kind::host), "CPU (AdamW, copies)");
    item(offload_colour(StepEvent::Kind::link), "host link");
    item(offload_colour(StepEvent::Kind::disk), "disk");
  }
  return out;
}

}  // namespace

std::string step_schedule_svg(const std::vector<SchedulePanel>& panels, const std::string& title,
                              const std::string& subtitle) {
  ZG_CHECK(!panels.empty(), "step_schedule_svg: no panels to draw");
  double most = 0;
  bool offload = false;
  for (const SchedulePanel& p : panels) most = std::max(most, p.time.step), offload |= p.time.offload() > 0;
  ZG_CHECK(most > 0, "step_schedule_svg: every panel's step takes no time");
  TimeAxis axis;
  axis.ms_step = tick_step(most * 1e3);
  axis.seconds = std::ceil(most * 1e3 / axis.ms_step - 1e-9) * axis.ms_step / 1e3;
  std::string body;
  double y = 22 + kLegendH;
  for (const SchedulePanel& p : panels) body += panel(p, axis, y);
  std::string svg = svg_fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" ", kWidth, y) +
                    svg_fmt("viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n", kWidth, y);
  svg += svg_fmt("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", kWidth, y);
  svg += "<text x=\"12\" y=\"20\" font-size=\"14\" font-weight=\"bold\">" + svg_escape(title) + "</text>\n";
  svg += "<text x=\"12\" y=\"36\">" + svg_escape(subtitle) + "</text>\n";
  return svg + legend(offload) + body + "</svg>\n";
}

}  // namespace zg::dist
