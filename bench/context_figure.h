// The context-parallel figure (zero_memory --cp-svg, docs chapter 21). Above: the three
// variants at C = 4, who sends what to whom -- the ring's hops to the next rank, the
// all-gather's every piece to every rank, Ulysses' all-to-all of heads. Below: for one long
// sequence at C = 1, 2, 4, 8, a rank's activation peak and the bytes its cp group sends a
// step, per variant, each bar labelled with its GB (the dry runs' figures).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tensor/svg.h"

namespace zg::bench {

struct ContextBars {
  int cp = 1;
  double activation[3] = {};  // a rank's peak, ring / all_gather / ulysses
  double sent[3] = {};        // bytes a rank sends on the cp group a step, the same order
};

inline std::string context_svg(const std::string& title, const std::vector<ContextBars>& rows) {
  constexpr double kWidth = 980, kLeft = 150, kBarH = 11, kTop = 270;
  const char* names[3] = {"ring", "all_gather", "ulysses"};
  const char* colours[3] = {"#4e79a7", "#f28e2b", "#59a14f"};
  double most_act = 0, most_sent = 0;
  for (const ContextBars& r : rows)
    for (int v = 0; v < 3; ++v) most_act = std::max(most_act, r.activation[v]), most_sent = std::max(most_sent, r.sent[v]);
  ZG_CHECK(most_act > 0 && most_sent > 0, "context_svg: no bytes to draw");
  const double row_h = 3 * (kBarH + 2) + 14, panel_w = (kWidth - 2 * kLeft - 40) / 2;
  const double height = kTop + 40 + row_h * static_cast<double>(rows.size()) + 16;
  std::string svg = svg_fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" ", kWidth, height) +
                    svg_fmt("viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n", kWidth, height);
  svg += svg_fmt("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", kWidth, height);
  svg += "<defs><marker id=\"arrow\" markerWidth=\"8\" markerHeight=\"8\" refX=\"7\" refY=\"4\" orient=\"auto\">"
         "<path d=\"M0,0 L8,4 L0,8 z\" fill=\"#333\"/></marker></defs>\n";
  svg += "<text x=\"12\" y=\"20\" font-size=\"14\" font-weight=\"bold\">" + svg_escape(title) + "</text>\n";
  svg += "<text x=\"12\" y=\"38\" font-size=\"10\">C = 4 drawn: the sequence cut into 8 pieces, rank r holding pieces r "
         "and 7 - r (load-balanced causal attention); bars below coloured by variant</text>\n";
  // The schematic: four ranks a variant, each with its load-balanced pieces (r, 7 - r of 8).
  const char* what[3][2] = {{"K, V pieces to the next rank, C - 1 hops a layer", "backward: again, and dK, dV (f32), C hops"},
                            {"every rank's K, V to every rank, once a layer", "backward: again; dK, dV reduce-scattered"},
                            {"all-to-all: q, k, v from a rank's pieces of all heads", "to all rows of 1/C of the heads; out back"}};
  for (int v = 0; v < 3; ++v) {
    const double y = 48 + 72 * v, box_w = 64, gap = 40;
    svg += svg_fmt("<text x=\"12\" y=\"%.1f\" font-weight=\"bold\" fill=\"", y + 26, 0) + colours[v] + "\">" +
           names[v] + "</text>\n";
    const auto centre = [&](int r) { return kLeft + r * (box_w + gap) + box_w / 2; };
    for (int r = 0; r < 4; ++r) {
      svg += svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"64\" height=\"26\" fill=\"#f4f4f4\" stroke=\"#666\"/>", centre(r) - box_w / 2, y + 8);
      svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", centre(r), y + 20) +
             svg_fmt("rank %.0f", r) + svg_fmt("</text><text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"9\">", centre(r), y + 31) +
             svg_fmt("pieces %.0f, %.0f</text>\n", r, 7 - r);
    }
    const auto arrow = [&](int from, int to, double bend) {
      const double x0 = centre(from), x1 = centre(to), top = y + 8, bottom = y + 34;
      const double y0 = bend < 0 ? top : bottom;
      return svg_fmt("<path d=\"M%.1f,%.1f ", x0, y0) + svg_fmt("Q%.1f,%.1f ", (x0 + x1) / 2, y0 + bend) +
             svg_fmt("%.1f,%.1f\" fill=\"none\" stroke=\"", x1, y0) + colours[v] + "\" marker-end=\"url(#arrow)\"/>\n";
    };
    for (int r = 0; r < 4; ++r) {
      if (v == 0) svg += arrow(r, (r + 1) % 4, r == 3 ? 22 : -8);
      else
        for (int q = r + 1; q < 4; ++q) svg += arrow(r, q, -6 - 4.0 * (q - r)) + arrow(q, r, 6 + 4.0 * (q - r));
    }
    for (int line = 0; line < 2; ++line)
      svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">", kLeft + 4 * (box_w + gap), y + 18 + 13 * line) +
             svg_escape(what[v][line]) + "</text>\n";
  }
  // The bars: a row per C, activations on the left, bytes sent on the right.
  const double right = kLeft + panel_w + 40;
  svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">a rank's activation peak (GB)</text>\n", kLeft, kTop + 12);
  svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">sent a step on the cp group (GB a rank)</text>\n", right,
                 kTop + 12);
  for (size_t i = 0; i < rows.size(); ++i) {
    const ContextBars& r = rows[i];
    const double y = kTop + 30 + row_h * static_cast<double>(i);
    svg += svg_fmt("<g class=\"cp\" data-cp=\"%.0f\">\n", r.cp);
    svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" font-weight=\"bold\">", kLeft - 8, y + 20) +
           svg_fmt("C = %.0f</text>\n", r.cp);
    for (int v = 0; v < 3; ++v) {
      const double top = y + v * (kBarH + 2);
      for (const auto& [x0, bytes, most] : {std::tuple{kLeft, r.activation[v], most_act}, {right, r.sent[v], most_sent}}) {
        const double w = panel_w * bytes / most;
        svg += svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" ", x0, top) + svg_fmt("width=\"%.2f\" height=\"%.1f\" fill=\"", w, kBarH) +
               colours[v] + "\"/>" + svg_fmt("<text x=\"%.2f\" y=\"%.1f\" font-size=\"9\">", x0 + w + 3, top + 9) +
               svg_fmt("%.1f</text>\n", bytes / 1e9);
      }
    }
    svg += "</g>\n";
  }
  return svg + "</svg>\n";
}

}  // namespace zg::bench
