#include "tensor/memory_figure.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "tensor/error.h"
#include "tensor/svg.h"

namespace zg {

namespace {

using Kind = TimelineEvent::Kind;

bool is_memory(const TimelineEvent& e) { return e.kind != Kind::begin && e.kind != Kind::end; }

// A signed change of the category's (or reserved) bytes.
int64_t delta(const TimelineEvent& e) { return e.kind == Kind::free ? -e.bytes : e.bytes; }

std::string allocator_name(const TimelineEvent& e) { return e.host_pool ? "host pool" : e.device.str(); }

// The last part of a range's path: its own name.
std::string leaf(const std::string& path) {
  const size_t at = path.rfind(" > ");
  return at == std::string::npos ? path : path.substr(at + 3);
}

// A top-level range as a step phase: the backward pass, the optimizer step (a ShardedModel's,
// or AdamW's own), a collective or a unit's communication ("" : no phase of its own), else
// the forward (a module's range: "h.0 (Block)", "Linear").
std::string phase_of(const std::string& name) {
  if (name == "backward" || name == "optimizer") return name;
  if (name == "adamw") return "optimizer";
  for (const char* collective : {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"})
    if (name == collective) return "";
  for (const char* unit_range : {"gather ", "reduce_gradients ", "after_step "})
    if (name.starts_with(unit_range)) return "";
  return "forward";
}

}  // namespace

std::string chrome_trace_json(const MemoryTimeline& timeline, const std::vector<MemoryLevel>& levels) {
  using nlohmann::json;
  const bool dry = timeline.dry_run();
  json events = json::array();
  std::map<int, std::map<int, bool>> threads;  // rank -> threads with ranges
  std::map<int, int64_t> noted;                // rank -> memory events so far (a dry run's clock)
  // Each counter's value, by (rank, allocator, category or reserved).
  std::map<std::tuple<int, std::string, std::string>, int64_t> counters;
  for (const TimelineEvent& e : timeline.events()) {
    int64_t& count = noted[e.rank];
    const double ts = dry ? static_cast<double>(count) : static_cast<double>(e.time_ns) / 1e3;
    if (is_memory(e)) {
      ++count;
      const std::string what = e.kind == Kind::reserve ? "reserved" : name(e.category);
      int64_t& value = counters[{e.rank, allocator_name(e), what}];
      value += delta(e);
      events.push_back({{"ph", "C"}, {"name", allocator_name(e) + " " + what}, {"pid", e.rank}, {"ts", ts},
                        {"args", {{"bytes", value}}}});
      continue;
    }
    threads[e.rank][e.thread] = true;
    json slice = {{"ph", e.kind == Kind::begin ? "B" : "E"}, {"pid", e.rank}, {"tid", e.thread}, {"ts", ts}};
    if (e.kind == Kind::begin) {
      slice["name"] = leaf(timeline.path(e.path));
      slice["args"] = {{"path", timeline.path(e.path)}};
    }
    events.push_back(std::move(slice));
  }
  for (const auto& [rank, count] : noted)
    events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (const auto& [rank, ids] : threads)
    for (const auto& [thread, yes] : ids) {
      const std::string& named = timeline.thread_name(thread);
      events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", rank}, {"tid", thread},
                        {"args", {{"name", named.empty() ? "compute" : named}}}});
    }
  json marked = json::array();
  for (const MemoryLevel& level : levels)
    marked.push_back({{"label", level.label}, {"bytes", level.bytes}, {"host", level.host}});
  json doc = {{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData", {{"dry_run", dry},
                             {"clock", dry ? "memory events of the rank (a dry run on meta: no times)" : "microseconds"},
                             {"dropped_events", timeline.dropped()},
                             {"levels", std::move(marked)}}}};
  return doc.dump(1) + "\n";
}

int64_t MemorySeries::total(size_t i) const {
  int64_t sum = 0;
  for (int64_t b : bytes[i]) sum += b;
  return sum;
}

int64_t MemorySeries::peak() const {
  int64_t most = 0;
  for (size_t i = 0; i < bytes.size(); ++i) most = std::max(most, total(i));
  return most;
}

int64_t MemorySeries::peak_of(MemoryCategory category) const {
  int64_t most = 0;
  for (const auto& b : bytes) most = std::max(most, b[static_cast<int>(category)]);
  return most;
}

namespace {
nlohmann::json parse_trace(const std::string& trace_json) {
  nlohmann::json doc = nlohmann::json::parse(trace_json, nullptr, false);
  ZG_CHECK(!doc.is_discarded() && doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array(),
           "memory_series: not a trace (a JSON object with a traceEvents array, as chrome_trace_json writes)");
  return doc;
}

int category_index(const std::string& what) {
  for (int c = 0; c < kMemoryCategories; ++c)
    if (what == name(static_cast<MemoryCategory>(c))) return c;
  return -1;
}
}  // namespace

MemorySeries memory_series(const std::string& trace_json, int rank, const std::string& allocator) {
  const nlohmann::json doc = parse_trace(trace_json);
  MemorySeries s;
  s.dry_run = doc.value("otherData", nlohmann::json::object()).value("dry_run", false);
  std::array<int64_t, kMemoryCategories> now{}, host{};
  int64_t reserved = 0;
  std::map<int, std::vector<std::pair<double, std::string>>> open;  // per thread: each open range's begin, name
  try {
    for (const nlohmann::json& e : doc["traceEvents"]) {
      if (!e.contains("pid") || e["pid"] != rank || !e.contains("ts")) continue;
      const std::string ph = e.at("ph");
      // Milliseconds (the trace's microseconds), or a dry run's count of memory events.
      const double x = s.dry_run ? e["ts"].get<double>() : e["ts"].get<double>() / 1e3;
      if (ph == "B") {
        open[e.at("tid")].emplace_back(x, e.at("name"));
      } else if (ph == "E") {
        auto& stack = open[e.at("tid")];
        if (stack.empty()) continue;
        const auto [begin, range] = stack.back();
        stack.pop_back();
        if (!stack.empty()) continue;
        if (std::string phase = phase_of(range); !phase.empty()) s.phases.push_back({phase, begin, x});
      } else if (ph == "C") {
        const std::string track = e.at("name");
        const int64_t bytes = e.at("args").at("bytes");
        const bool in_host_pool = track.starts_with("host pool ");
        if (!in_host_pool && !track.starts_with(allocator + " ")) continue;
        const std::string what = track.substr(in_host_pool ? 10 : allocator.size() + 1);
        const int c = category_index(what);
        if (in_host_pool && c >= 0) host[c] = bytes;
        else if (in_host_pool) continue;
        else if (what == "reserved") reserved = bytes;
        else if (c >= 0) now[c] = bytes;
        int64_t host_total = 0;
        for (int64_t b : host) host_total += b;
        s.x.push_back(x), s.bytes.push_back(now), s.reserved.push_back(reserved), s.host.push_back(host_total);
      }
    }
  } catch (const nlohmann::json::exception& error) {
    fail("memory_series: a trace event is not as chrome_trace_json writes it: ", error.what());
  }
  return s;
}

MemorySeries memory_series(const MemoryTimeline& timeline, int rank, Device device) {
  return memory_series(chrome_trace_json(timeline), rank, device.str());
}

std::vector<MemoryLevel> trace_levels(const std::string& trace_json) {
  const nlohmann::json doc = parse_trace(trace_json);
  std::vector<MemoryLevel> levels;
  if (doc.contains("otherData") && doc["otherData"].contains("levels"))
    for (const nlohmann::json& level : doc["otherData"]["levels"])
      levels.push_back({level.value("label", ""), level.value("bytes", int64_t{0}), level.value("host", false)});
  return levels;
}

namespace {

// Tableau 10: one colour per category, in MemoryCategory's order.
constexpr const char* kCategoryColour[kMemoryCategories] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759",
                                                            "#76b7b2", "#edc948", "#bab0ac"};
const char* phase_colour(const std::string& phase) {
  return phase == "forward" ? "#9ecae1" : phase == "backward" ? "#fdae6b" : "#a1d99b";
}
// The lines: the host pool wide and light, its formula dash-dotted on top of it (they
// coincide when the pool holds exactly the formula), the device's formula dashed.
constexpr const char* kHostPoolStyle = "stroke=\"#b07aa1\" stroke-width=\"4\" stroke-opacity=\"0.6\"";
constexpr const char* kHostLevelStyle = "stroke=\"#6b3d8f\" stroke-width=\"1.2\" stroke-dasharray=\"8,3,2,3\"";
constexpr const char* kLevelStyle = "stroke=\"black\" stroke-dasharray=\"5,3\"";
constexpr const char* kReservedStyle = "stroke=\"#555\" stroke-width=\"1.2\"";

// The width of `text` at 11 px in DejaVu Sans (what librsvg draws sans-serif with; most
// other sans fonts are narrower): its advance widths in 1/2048 em, ' ' to '~'.
double text_width(const std::string& text) {
  static constexpr int16_t kAdvance[95] = {
      651,  823,  942,  1716, 1303, 1946, 1597, 563,  799,  799,  1024, 1716, 651,  739,  651,  690,
      1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 690,  690,  1716, 1716, 1716, 1087,
      2048, 1401, 1405, 1430, 1577, 1294, 1178, 1587, 1540, 604,  604,  1343, 1141, 1767, 1532, 1612,
      1235, 1612, 1423, 1300, 1251, 1499, 1401, 2025, 1403, 1251, 1403, 799,  690,  799,  1716, 1024,
      1024, 1255, 1300, 1126, 1300, 1260, 721,  1300, 1298, 569,  569,  1186, 569,  1995, 1298, 1253,
      1300, 1300, 842,  1067, 803,  1298, 1212, 1675, 1212, 1212, 1075, 1303, 690,  1303, 1716};
  double units = 0;
  for (unsigned char c : text) units += c >= ' ' && c <= '~' ? kAdvance[c - ' '] : 1303;
  return units * 11 / 2048;
}

// The axis: `unit` (a power of 1024) and a step of 1, 2, 2.5 or 5 x 10^k units giving
// four or five ticks up to the first one at or above `most`.
struct Axis {
  double unit = 1, step = 1;
  int ticks = 1;
  const char* unit_name = "B";
  double top() const { return step * ticks * unit; }
};
Axis axis_for(int64_t most) {
  static const char* const names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  Axis a;
  int u = 0;
  while (u < 5 && static_cast<double>(most) >= 1024.0 * a.unit) a.unit *= 1024, ++u;
  a.unit_name = names[u];
  const double span = std::max(static_cast<double>(most) / a.unit, 1e-9);
  const double raw = span / 4, magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * magnitude >= raw) {
      a.step = m * magnitude;
      break;
    }
  a.ticks = std::max(1, static_cast<int>(std::ceil(span / a.step - 1e-9)));
  return a;
}

// A series drawn as steps: each value holds from its x to the next one's.
std::vector<std::pair<double, double>> steps(const std::vector<double>& xs, const std::vector<double>& ys) {
  std::vector<std::pair<double, double>> out;
  for (size_t k = 0; k < xs.size(); ++k) {
    out.emplace_back(xs[k], ys[k]);
    if (k + 1 < xs.size()) out.emplace_back(xs[k + 1], ys[k]);
  }
  return out;
}

// " x,y x,y ...", two decimals, leaving out each point between two at the same height
// (a flat run is drawn by its ends): the figures stay small, the shape is the same.
std::string points_of(const std::vector<std::pair<double, double>>& points) {
  std::vector<std::string> ys;
  for (const auto& [x, y] : points) ys.push_back(svg_fmt("%.2f", y));
  std::string out;
  for (size_t i = 0; i < points.size(); ++i) {
    if (i > 0 && i + 1 < points.size() && ys[i - 1] == ys[i] && ys[i] == ys[i + 1]) continue;
    out += svg_fmt(" %.2f,", points[i].first) + ys[i];
  }
  return out;
}

std::string tick_label(double value, const Axis& a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g %s", value, a.unit_name);
  return buf;
}

}  // namespace

std::string memory_figure_svg(const std::vector<MemoryPanel>& panels, const std::string& title) {
  ZG_CHECK(!panels.empty(), "memory_figure_svg: no panels to draw");
  // Two panels to a row, 440 px each; one alone is wider.
  const int columns = panels.size() > 1 ? 2 : 1;
  const int rows = static_cast<int>((panels.size() + columns - 1) / columns);
  constexpr double kPanelH = 250, kLeft = 72, kRight = 18, kTop = 34, kBottom = 40;
  const double panel_w = columns == 1 ? 640 : 440, width = columns * panel_w;
  const double plot_w = panel_w - kLeft - kRight, plot_h = kPanelH - kTop - kBottom;

  // The most bytes a panel draws: its stack, its levels, its lines.
  const auto most_of = [](const MemoryPanel& p) {
    int64_t most = std::max<int64_t>(1, p.series.peak());
    for (const MemoryLevel& level : p.levels) most = std::max(most, level.bytes);
    for (size_t i = 0; i < p.series.x.size(); ++i) {
      most = std::max(most, p.series.host[i]);
      if (p.show_reserved) most = std::max(most, p.series.reserved[i]);
    }
    return most;
  };
  // One vertical scale for every panel but those on their own.
  int64_t shared_most = 1;
  bool used[kMemoryCategories] = {}, any_host = false, any_reserved = false;
  std::map<std::string, bool> phases_seen, levels_seen;  // level label -> of the host pool
  for (const MemoryPanel& p : panels) {
    ZG_CHECK(!p.series.x.empty(), "memory_figure_svg: panel '", p.title, "' has no memory events (was its rank and "
             "device recorded?)");
    if (!p.own_scale) shared_most = std::max(shared_most, most_of(p));
    for (const MemoryLevel& level : p.levels) levels_seen[level.label] = level.host;
    any_reserved = any_reserved || p.show_reserved;
    for (size_t i = 0; i < p.series.x.size(); ++i) {
      any_host = any_host || p.series.host[i] > 0;
      for (int c = 0; c < kMemoryCategories; ++c) used[c] = used[c] || p.series.bytes[i][c] != 0;
    }
    for (const auto& phase : p.series.phases) phases_seen[phase.name] = true;
  }

  // The legend, in rows under the title: categories drawn, phases, lines. Each item's
  // swatch is drawn at (x, y), the top of its row; its label after it, then a gap.
  std::string legend;
  double lx = 12, ly = 38;
  const auto item = [&](const std::function<std::string(double, double)>& swatch, const std::string& label) {
    const double item_w = 16 + text_width(label) + 14;
    if (lx > 12 && lx + item_w - 14 > width - 12) lx = 12, ly += 16;
    legend += swatch(lx, ly) + svg_fmt("<text x=\"%.1f\" y=\"%.1f\">", lx + 16, ly + 9) + svg_escape(label) + "</text>\n";
    lx += item_w;
  };
  const auto line = [](const std::string& style) {
    return [style](double x, double y) {
      return svg_fmt("<line x1=\"%.1f\" y1=\"%.1f\" ", x, y + 6) + svg_fmt("x2=\"%.1f\" y2=\"%.1f\" ", x + 12, y + 6) + style +
             "/>";
    };
  };
  for (int c = 0; c < kMemoryCategories; ++c)
    if (used[c])
      item([c](double x, double y) {
        return svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" ", x, y) + "fill=\"" +
               kCategoryColour[c] + "\"/>";
      }, name(static_cast<MemoryCategory>(c)));
  for (const char* phase : {"forward", "backward", "optimizer"})
    if (phases_seen.contains(phase))
      item([phase](double x, double y) {
        return svg_fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"6\" ", x, y + 3) + "fill=\"" +
               phase_colour(phase) + "\"/>";
      }, phase);
  if (any_host) item(line(kHostPoolStyle), "host pool");
  if (any_reserved) item(line(kReservedStyle), "reserved");
  for (const auto& [label, host] : levels_seen) item(line(host ? kHostLevelStyle : kLevelStyle), label);
  const double header = ly + 26, height = header + rows * kPanelH;

  std::string svg;
  svg += svg_fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" ", width, height) +
         svg_fmt("viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n", width, height);
  svg += svg_fmt("<rect width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", width, height);
  svg += "<text x=\"12\" y=\"20\" font-size=\"14\" font-weight=\"bold\">" + svg_escape(title) + "</text>\n";
  svg += legend;

  for (size_t p = 0; p < panels.size(); ++p) {
    const MemoryPanel& panel = panels[p];
    const MemorySeries& s = panel.series;
    const Axis axis = axis_for(panel.own_scale ? most_of(panel) : shared_most);
    const double bytes_per_px = axis.top() / plot_h;
    const double ox = static_cast<double>(p % columns) * panel_w, oy = header + static_cast<double>(p / columns) * kPanelH;
    const double x_left = ox + kLeft, baseline = oy + kTop + plot_h;
    const double x0 = s.x.front(), x1 = std::max(s.x.back(), x0 + 1e-9);
    const auto px = [&](double x) { return x_left + (x - x0) / (x1 - x0) * plot_w; };
    const auto py = [&](double bytes) { return baseline - bytes / bytes_per_px; };
    const int64_t peak = s.peak();
    svg += "<g class=\"panel\" data-title=\"" + svg_escape(panel.title) + "\" data-peak-bytes=\"" + std::to_string(peak) +
           "\"" + svg_fmt(" data-baseline-y=\"%.2f\"", baseline) + svg_fmt(" data-bytes-per-px=\"%.9g\">\n", bytes_per_px);
    svg += svg_fmt("<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">", x_left, oy + 18) + svg_escape(panel.title) + "</text>\n";
    // The y axis: grid lines and labels.
    for (int t = 0; t <= axis.ticks; ++t) {
      const double y = py(t * axis.step * axis.unit);
      svg += svg_fmt("<line x1=\"%.1f\" y1=\"%.2f\" ", x_left, y) +
             svg_fmt("x2=\"%.1f\" y2=\"%.2f\" stroke=\"#e0e0e0\"/>\n", x_left + plot_w, y);
      svg += svg_fmt("<text x=\"%.1f\" y=\"%.2f\" text-anchor=\"end\">", x_left - 6, y + 4) +
             tick_label(t * axis.step, axis) + "</text>\n";
    }
    // Samples kept: in each pixel column, the one with the most bytes (the envelope, so
    // every peak is drawn at its height), in order.
    std::vector<size_t> kept;
    long last_column = -1;
    for (size_t i = 0; i < s.x.size(); ++i) {
      const long column = std::lround(std::floor((px(s.x[i]) - x_left)));
      if (column != last_column) kept.push_back(i), last_column = column;
      else if (s.total(i) > s.total(kept.back())) kept.back() = i;
    }
    std::vector<double> xs;
    for (size_t i : kept) xs.push_back(px(s.x[i]));
    // The stack: one area per category, from the categories below it to itself.
    std::vector<int64_t> below(kept.size(), 0);
    for (int c = 0; c < kMemoryCategories; ++c) {
      if (!used[c]) continue;
      std::vector<double> top, bottom;
      for (size_t k = 0; k < kept.size(); ++k) {
        bottom.push_back(py(static_cast<double>(below[k])));
        below[k] += s.bytes[kept[k]][c];
        top.push_back(py(static_cast<double>(below[k])));
      }
      // The top edge left to right, the bottom back.
      std::vector<std::pair<double, double>> outline = steps(xs, top), back = steps(xs, bottom);
      outline.insert(outline.end(), back.rbegin(), back.rend());
      svg += std::string("<path class=\"area\" data-category=\"") + name(static_cast<MemoryCategory>(c)) +
             "\" fill=\"" + kCategoryColour[c] + "\" d=\"M" + points_of(outline) + " Z\"/>\n";
    }
    const auto polyline = [&](const std::vector<int64_t>& values, const std::string& style) {
      std::vector<double> ys;
      for (size_t i : kept) ys.push_back(py(static_cast<double>(values[i])));
      svg += "<polyline fill=\"none\" " + style + " points=\"" + points_of(steps(xs, ys)).substr(1) + "\"/>\n";
    };
    if (std::any_of(s.host.begin(), s.host.end(), [](int64_t b) { return b > 0; })) polyline(s.host, kHostPoolStyle);
    if (panel.show_reserved) polyline(s.reserved, kReservedStyle);
    for (const MemoryLevel& level : panel.levels) {
      const double y = py(static_cast<double>(level.bytes));
      svg += svg_fmt("<line x1=\"%.1f\" y1=\"%.2f\" ", x_left, y) + svg_fmt("x2=\"%.1f\" y2=\"%.2f\" ", x_left + plot_w, y) +
             (level.host ? kHostLevelStyle : kLevelStyle) + "/>\n";
      svg += svg_fmt("<text x=\"%.1f\" y=\"%.2f\" text-anchor=\"end\">", x_left + plot_w, y - 3) +
             svg_escape(level.label + " " + format_bytes(level.bytes)) + "</text>\n";
    }
    // The peak, marked where it first happens.
    size_t at = 0;
    for (size_t i = 0; i < s.x.size(); ++i)
      if (s.total(i) > s.total(at)) at = i;
    const double peak_x = px(s.x[at]), peak_y = py(static_cast<double>(peak));
    svg += svg_fmt("<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\"/>\n", peak_x, peak_y);
    svg += svg_fmt("<text x=\"%.2f\" y=\"%.2f\" ", peak_x + (peak_x > x_left + plot_w / 2 ? -5 : 5), peak_y - 5) +
           (peak_x > x_left + plot_w / 2 ? "text-anchor=\"end\"" : "") + ">peak " + format_bytes(peak) + "</text>\n";
    // The x axis, the phases under it, the clock.
    svg += svg_fmt("<line x1=\"%.1f\" y1=\"%.2f\" ", x_left, baseline) +
           svg_fmt("x2=\"%.1f\" y2=\"%.2f\" stroke=\"black\"/>\n", x_left + plot_w, baseline);
    for (const MemorySeries::Phase& phase : s.phases) {
      const double a = std::max(px(phase.begin), x_left), b = std::min(px(phase.end), x_left + plot_w);
      if (b <= a) continue;
      svg += svg_fmt("<rect x=\"%.2f\" y=\"%.2f\" ", a, baseline + 4) + svg_fmt("width=\"%.2f\" height=\"6\" ", b - a) +
             "fill=\"" + phase_colour(phase.name) + "\"><title>" + phase.name + "</title></rect>\n";
    }
    svg += svg_fmt("<text x=\"%.1f\" y=\"%.2f\">0</text>\n", x_left, baseline + 24);
    svg += svg_fmt("<text x=\"%.1f\" y=\"%.2f\" text-anchor=\"end\">", x_left + plot_w, baseline + 24) +
           (s.dry_run ? svg_fmt("event %.0f", x1) : svg_fmt("%.1f ms", x1 - x0)) + "</text>\n";
    svg += "</g>\n";
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace zg
