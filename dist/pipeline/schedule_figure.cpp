#include "dist/pipeline/schedule_figure.h"

#include <algorithm>
#include <cmath>

#include "tensor/error.h"
#include "tensor/svg.h"

namespace zg::dist {

namespace {

constexpr double kLeft = 70, kUnit = 24, kRowH = 20, kRowGap = 4, kRight = 20, kLegendH = 30;
constexpr const char* kColours[] = {"#9ecae1", "#fdae6b", "#fdd0a2", "#e6550d"};  // F, B, I, W

// A block labelled with its micro-batch; an interleaved schedule's second chunk and on
// in a lighter shade.
std::string block(const Timeline::Block& b, double y) {
  const double x = kLeft + b.start * kUnit, w = (b.end - b.start) * kUnit;
  const Action& a = b.action;
  std::string out = svg_fmt("<rect x=\"%.2f\" y=\"%.1f\" ", x, y) +
                    svg_fmt("width=\"%.2f\" height=\"%.1f\" fill=\"", w, kRowH) + kColours[a.kind] + "\"" +
                    (a.chunk > 0 ? " fill-opacity=\"0.55\"" : "") + " stroke=\"white\" stroke-width=\"0.8\"/>\n";
  return out + svg_fmt("<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\">", x + w / 2, y + 14) +
         std::to_string(a.micro_batch) + "</text>\n";
}

std::string peaks_text(const std::vector<int>& peaks) {
  std::string text;
  for (int p : peaks) text += (text.empty() ? "" : " ") + std::to_string(p);
  return text;
}

// One panel: its title line, a row per rank, the time axis; `y` moves past it.
std::string panel(const Schedule& s, const ActionTimes& stage_times, double width, double& y) {
  const ActionTimes times = stage_times.per_chunk(s.chunks);
  const Timeline t = simulate(s, times);
  const std::string title = std::string(name(s.kind)) + ", p = " + std::to_string(s.ranks) +
                            ", m = " + std::to_string(s.micro_batches) +
                            (s.chunks > 1 ? ", v = " + std::to_string(s.chunks) : "");
  std::string out = svg_fmt("<g class=\"panel\" data-bubble=\"%.6f\" ", t.bubble_fraction()) +
                    svg_fmt("data-formula=\"%.6f\">\n", formula_bubble_fraction(s, times));
  out += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">", 12, y + 12) + svg_escape(title) +
         svg_fmt("<tspan font-weight=\"normal\">: bubble %.1f%% (formula %.1f%%), ", 100 * t.bubble_fraction(),
                 100 * formula_bubble_fraction(s, times)) +
         "activations held per rank " + peaks_text(t.peak_activations()) + "</tspan></text>\n";
  y += 20;
  for (int r = 0; r < s.ranks; ++r) {
    out += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">rank ", kLeft - 8, y + 14) + std::to_string(r) +
           "</text>\n" + svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" ", kLeft, y) +
           svg_fmt("width=\"%.2f\" height=\"%.1f\" fill=\"#f4f4f4\"/>\n", width - kLeft - kRight, kRowH);
    for (const Timeline::Block& b : t.ranks[r]) out += block(b, y);
    y += kRowH + kRowGap;
  }
  y += 14;
  return out + "</g>\n";
}

}  // namespace

std::string schedule_svg(const std::vector<Schedule>& schedules, const std::string& title, const ActionTimes& times) {
  ZG_CHECK(!schedules.empty(), "schedule_svg: no schedules to draw");
  double longest = 0;
  for (const Schedule& s : schedules) longest = std::max(longest, simulate(s, times.per_chunk(s.chunks)).makespan);
  const double width = kLeft + std::ceil(longest) * kUnit + kRight;
  std::string body;
  double y = 22 + kLegendH;
  for (const Schedule& s : schedules) body += panel(s, times, width, y);
  std::string legend;  // under the title: the four kinds of block
  double x = 12;
  const char* labels[] = {"F forward", "B backward (I + W)", "I input gradient", "W weight gradient"};
  for (int k = 0; k < 4; ++k) {
    legend += svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"", x, 32) + kColours[k] +
              svg_fmt("\"/><text x=\"%.1f\" y=\"%.1f\">", x + 16, 42) + labels[k] + "</text>\n";
    x += 150;
  }
  std::string svg = svg_fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" ", width, y) +
                    svg_fmt("viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n", width, y);
  svg += svg_fmt("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", width, y);
  svg += "<text x=\"12\" y=\"20\" font-size=\"14\" font-weight=\"bold\">" + svg_escape(title) + "</text>\n";
  return svg + legend + body + "</svg>\n";
}

}  // namespace zg::dist
