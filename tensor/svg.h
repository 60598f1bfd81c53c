// What the figures (tensor/memory_figure.cpp, dist/comm/step_figure.cpp,
// dist/pipeline/schedule_figure.cpp) write SVG with. Internal: not installed.
#pragma once

#include <string>

namespace zg {

// snprintf of up to two numbers into a drawing command; one that does not fit is a zg::Error.
std::string svg_fmt(const char* format, double a, double b = 0);
// Text made safe inside an element or an attribute: & < > " escaped.
std::string svg_escape(const std::string& text);

}  // namespace zg
