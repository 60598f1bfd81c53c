#include "tensor/svg.h"

#include <cstdio>

#include "tensor/error.h"

namespace zg {

std::string svg_fmt(const char* format, double a, double b) {
  char buf[160];
  const int n = std::snprintf(buf, sizeof buf, format, a, b);
  ZG_CHECK(n >= 0 && n < static_cast<int>(sizeof buf), "svg: the drawing command '", format, "' did not fit its buffer");
  return buf;
}

std::string svg_escape(const std::string& text) {
  std::string out;
  for (char c : text) out += c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '"' ? "&quot;" : std::string(1, c);
  return out;
}

}  // namespace zg
