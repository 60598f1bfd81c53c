// The ZeRO++ figure (zero_memory --zeropp-svg, docs chapter 18): for each technique, the
// bytes a rank sends in one step within its node and across nodes, two bars a row on one
// scale, each labelled with its GB and the cross-node bytes in the paper's M a node.
#pragma once

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "tensor/error.h"
#include "tensor/svg.h"

namespace zg::bench {

struct TrafficBar {
  std::string label;              // "ZeRO-3", "qwZ", ...
  double within = 0, across = 0;  // bytes a rank sends a step: within its node, its share across
  double across_m = 0;            // a node's bytes across, in M (the model's 16-bit bytes)
};

inline std::string traffic_svg(const std::string& title, const std::vector<TrafficBar>& bars) {
  constexpr double kWidth = 960, kLeft = 150, kRight = 200, kBarH = 16, kRowH = 48, kTop = 64;
  const char *within_colour = "#4e79a7", *across_colour = "#e15759";
  double most = 0;
  for (const TrafficBar& b : bars) most = std::max({most, b.within, b.across});
  ZG_CHECK(most > 0, "traffic_svg: no bytes to draw");
  const double plot_w = kWidth - kLeft - kRight, height = kTop + kRowH * static_cast<double>(bars.size()) + 24;
  const auto x = [&](double bytes) { return kLeft + plot_w * bytes / most; };
  std::string svg = svg_fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" ", kWidth, height) +
                    svg_fmt("viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n", kWidth, height);
  svg += svg_fmt("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", kWidth, height);
  svg += "<text x=\"12\" y=\"20\" font-size=\"14\" font-weight=\"bold\">" + svg_escape(title) + "</text>\n";
  const auto legend = [&](double at, const char* colour, const char* text) {
    return svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"", at, 32) + colour + "\"/>" +
           svg_fmt("<text x=\"%.1f\" y=\"%.1f\">", at + 16, 42) + text + "</text>\n";
  };
  svg += legend(kLeft, within_colour, "sent within the node (GB a rank)");
  svg += legend(kLeft + 260, across_colour, "sent across nodes (GB a rank: its share of the node's)");
  for (size_t i = 0; i < bars.size(); ++i) {
    const TrafficBar& b = bars[i];
    const double y = kTop + kRowH * static_cast<double>(i);
    svg += svg_fmt("<g class=\"technique\" data-within-bytes=\"%.0f\" data-across-bytes=\"%.0f\">\n", b.within, b.across);
    svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" font-weight=\"bold\">", kLeft - 8, y + 20) +
           svg_escape(b.label) + "</text>\n";
    for (const auto& [bytes, colour, row] : {std::tuple{b.within, within_colour, 0.0}, {b.across, across_colour, 1.0}}) {
      const double top = y + row * (kBarH + 2);
      svg += svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" ", kLeft, top) +
             svg_fmt("width=\"%.2f\" height=\"%.1f\" fill=\"", x(bytes) - kLeft, kBarH) + colour + "\"/>\n";
      svg += svg_fmt("<text x=\"%.2f\" y=\"%.1f\">", x(bytes) + 4, top + 12) + svg_fmt("%.2f GB", bytes / 1e9) +
             (row == 1.0 ? svg_fmt(" (%.2f M a node)", b.across_m) : std::string()) + "</text>\n";
    }
    svg += "</g>\n";
  }
  return svg + "</svg>\n";
}

}  // namespace zg::bench
