// The course's and the README's quoted output, checked like code. A ```console block
// holds commands (lines starting "$ ") each followed by what it prints. The suite runs
// each command with bash in a folder where build/ is the build under test and every
// other name is the source tree's, and compares stdout with the quote:
//   - line by line, trailing spaces aside;
//   - a line "..." stands for any number of lines, "..." inside a line for any text;
//   - a number followed by a unit of time or speed (s, ms, us, tok/s, GB/s, GiB/s,
//     MB/s, TFLOP/s) is a timing and stands for any number (or inf, nan).
// A block after the comment "<!-- unchecked: REASON -->" is listed, not run (it needs a
// GPU). Each command runs with the CPU's widest kernels and again with ZG_CPU_ISA=portable
// (unless it sets ZG_CPU_ISA itself), so a quote holds on every x86 machine.
#pragma once

#include <optional>
#include <regex>
#include <string>
#include <vector>

namespace zg::test {

struct Quote {
  int line = 0;                       // of the "$ " line, 1-based
  std::string command;
  std::vector<std::string> expected;  // the lines quoted under it
  std::string unchecked;              // the reason, for a block that is not run
};

// Whether a shell command stops inside a quoted string or after a backslash, so that it
// goes on on the next line (python3 -c "..." over several lines).
inline bool continues(const std::string& command) {
  char open = 0;  // the quote we are inside: ', " or none
  for (size_t i = 0; i < command.size(); ++i) {
    const char c = command[i];
    if (open != '\'' && c == '\\') {
      if (++i == command.size()) return true;
    } else if (open == 0 && (c == '\'' || c == '"')) {
      open = c;
    } else if (c == open) {
      open = 0;
    }
  }
  return open != 0;
}

inline std::vector<Quote> quotes_in(const std::string& markdown) {
  std::vector<Quote> quotes;
  std::vector<std::string> lines;
  for (size_t at = 0; at <= markdown.size();) {
    const size_t end = std::min(markdown.find('\n', at), markdown.size());
    lines.push_back(markdown.substr(at, end - at));
    at = end + 1;
  }
  const std::regex unchecked(R"(^<!-- unchecked: (.*) -->\s*$)");
  std::string reason;  // of the last "unchecked" comment, for the next block
  for (size_t i = 0; i < lines.size(); ++i) {
    std::smatch m;
    if (std::regex_match(lines[i], m, unchecked)) {
      reason = m[1];
      continue;
    }
    if (lines[i].rfind("```", 0) != 0) continue;
    const bool console = lines[i] == "```console";
    size_t j = i + 1;
    for (; j < lines.size() && lines[j].rfind("```", 0) != 0; ++j)
      if (console && lines[j].rfind("$ ", 0) == 0) {
        quotes.push_back({static_cast<int>(j + 1), lines[j].substr(2), {}, reason});
        while (continues(quotes.back().command) && j + 1 < lines.size()) quotes.back().command += "\n" + lines[++j];
      } else if (console && !quotes.empty() && quotes.back().line > static_cast<int>(i)) {
        quotes.back().expected.push_back(lines[j]);
      }
    reason.clear();
    i = j;
  }
  return quotes;
}

// One quoted line as a pattern: inline "..." is any text; a timing any number.
inline std::regex line_pattern(const std::string& quoted) {
  static const std::regex timing(R"( *[0-9]+(\.[0-9]+)?(e[-+]?[0-9]+)? ?(s|ms|us|tok/s|GB/s|GiB/s|MB/s|TFLOP/s)\b)");
  static const std::regex special(R"([.^$|()\[\]{}*+?\\])");
  std::string pattern;
  std::string rest = quoted;
  std::smatch m;
  const auto literal = [&](const std::string& text) {
    for (size_t at = 0;;) {  // "..." is any text
      const size_t dots = text.find("...", at);
      pattern += std::regex_replace(text.substr(at, dots - at), special, "\\$&");
      if (dots == std::string::npos) break;
      pattern += ".*";
      at = dots + 3;
    }
  };
  while (std::regex_search(rest, m, timing)) {
    literal(m.prefix());
    pattern += " *([0-9.e+-]+|inf|nan) ?" + m[3].str() + "\\b";
    rest = m.suffix();
  }
  literal(rest);
  return std::regex(pattern);
}

inline std::string trim_right(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

// Where `output` first departs from the quote, or nothing when it matches.
inline std::optional<std::string> quote_mismatch(const std::vector<std::string>& expected, const std::string& output) {
  std::vector<std::string> got;
  for (size_t at = 0; at < output.size();) {
    const size_t end = std::min(output.find('\n', at), output.size());
    got.push_back(trim_right(output.substr(at, end - at)));
    at = end + 1;
  }
  std::vector<std::optional<std::regex>> patterns;  // nothing: a "..." line
  for (const std::string& e : expected)
    patterns.push_back(trim_right(e) == "..." ? std::nullopt : std::optional(line_pattern(trim_right(e))));
  // matches[i][j]: quote lines i.. match output lines j.. (memoised; "..." may take any run).
  std::vector<std::vector<int8_t>> memo(patterns.size() + 1, std::vector<int8_t>(got.size() + 1, -1));
  size_t furthest = 0, furthest_got = 0;  // the deepest quote line reached, for the message
  const auto match = [&](auto& self, size_t i, size_t j) -> bool {
    int8_t& known = memo[i][j];
    if (known >= 0) return known;
    if (i > furthest || (i == furthest && j > furthest_got)) furthest = i, furthest_got = j;
    bool ok;
    if (i == patterns.size())
      ok = j == got.size();
    else if (!patterns[i])
      ok = self(self, i + 1, j) || (j < got.size() && self(self, i, j + 1));
    else
      ok = j < got.size() && std::regex_match(got[j], *patterns[i]) && self(self, i + 1, j + 1);
    known = ok;
    return ok;
  };
  if (match(match, 0, 0)) return std::nullopt;
  std::string message = "quoted line " + std::to_string(furthest + 1) + ": '" +
                        (furthest < expected.size() ? expected[furthest] : std::string("(end of quote)")) + "'\n  printed: '" +
                        (furthest_got < got.size() ? got[furthest_got] : std::string("(end of output)")) + "'\n  whole output:\n";
  for (const std::string& line : got) message += "    " + line + "\n";
  return message;
}

}  // namespace zg::test
