// Reading back what memory_figure.h writes, as a person or a tool would: a trace's
// counters summed over time, and an SVG panel's drawn areas measured against its axis.
#pragma once

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace zg::test {

// The largest sum of one rank's counters named "<allocator> <category>" (reserved left
// out) over the trace: the allocator's peak as the trace tells it.
inline int64_t trace_peak(const nlohmann::json& trace, int rank, const std::string& allocator) {
  std::map<std::string, int64_t> now;
  int64_t most = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "C" || e.at("pid") != rank) continue;
    const std::string name = e.at("name");
    if (!name.starts_with(allocator + " ") || name.ends_with(" reserved")) continue;
    now[name] = e.at("args").at("bytes").get<int64_t>();
    int64_t sum = 0;
    for (const auto& [track, bytes] : now) sum += bytes;
    most = std::max(most, sum);
  }
  return most;
}

struct DrawnPanel {
  std::string title;
  int64_t peak_attribute = 0;  // data-peak-bytes
  double baseline = 0, bytes_per_px = 0;
  double highest_y = 1e300;  // the smallest y of any area's outline: the top of the stack
  int areas = 0;
  double drawn_peak() const { return (baseline - highest_y) * bytes_per_px; }  // bytes, as drawn
};

// Every panel of a figure, with what its areas reach (none unless it is an <svg> element).
inline std::vector<DrawnPanel> drawn_panels(const std::string& svg) {
  std::vector<DrawnPanel> panels;
  if (!svg.starts_with("<svg ") || svg.find("</svg>") == std::string::npos) return panels;
  const std::regex panel(R"re(<g class="panel" data-title="([^"]*)" data-peak-bytes="(\d+)" data-baseline-y="([0-9.]+)" data-bytes-per-px="([0-9.e+-]+)">)re");
  const std::regex area(R"re(<path class="area" data-category="[a-z_]+" fill="#[0-9a-f]+" d="M([^"]*) Z"/>)re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), panel); it != std::sregex_iterator(); ++it) {
    DrawnPanel p{(*it)[1], std::stoll((*it)[2]), std::stod((*it)[3]), std::stod((*it)[4])};
    const size_t begin = static_cast<size_t>(it->position() + it->length());
    const std::string body = svg.substr(begin, svg.find("</g>", begin) - begin);
    for (auto a = std::sregex_iterator(body.begin(), body.end(), area); a != std::sregex_iterator(); ++a, ++p.areas) {
      std::istringstream points((*a)[1].str());
      for (std::string point; points >> point;)
        p.highest_y = std::min(p.highest_y, std::stod(point.substr(point.find(',') + 1)));
    }
    panels.push_back(p);
  }
  return panels;
}

}  // namespace zg::test
