// Command-line flags for the benches: `--flag value` pairs and switches, read in
// order. Every misuse is a zg::Error that names the program and the flag.
//
//   Args args("gemm", argc, argv);
//   while (!args.done()) {
//     const std::string flag = args.next();
//     if (flag == "--iters") iters = args.count(flag);
//     ...
//   }
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tensor/error.h"

namespace zg::bench {

class Args {
 public:
  Args(std::string program, int argc, char** argv) : program_(std::move(program)), argc_(argc), argv_(argv) {}

  bool done() const { return next_ >= argc_; }
  std::string next() { return argv_[next_++]; }

  // The word after `flag`.
  std::string value(const std::string& flag) {
    ZG_CHECK(!done(), program_, ": ", flag, " needs a value");
    return next();
  }

  // A finite real number, e.g. "--lr 6e-4".
  double number(const std::string& flag) {
    const std::string word = value(flag);
    size_t used = 0;
    double x = NAN;
    try {
      x = std::stod(word, &used);
    } catch (const std::exception&) {
    }
    ZG_CHECK(!word.empty() && used == word.size() && std::isfinite(x), program_, ": ", flag,
             " needs a number, got '", word, "'");
    return x;
  }

  // A whole number >= 1, e.g. "--iters 20".
  int64_t count(const std::string& flag) { return parse_count(flag, value(flag)); }

  // Comma-separated whole numbers >= 1, e.g. "--sizes 1024,2048".
  std::vector<int64_t> counts(const std::string& flag) {
    std::vector<int64_t> out;
    for (const std::string& word : split(flag, value(flag))) out.push_back(parse_count(flag, word));
    return out;
  }

  // Comma-separated byte sizes with an optional K, M or G suffix (KiB, MiB, GiB), e.g. "4K,1M,64M".
  std::vector<int64_t> byte_sizes(const std::string& flag) {
    std::vector<int64_t> out;
    for (const std::string& word : split(flag, value(flag))) {
      int shift = 0;
      switch (word.back()) {
        case 'K': shift = 10; break;
        case 'M': shift = 20; break;
        case 'G': shift = 30; break;
        default: break;
      }
      const int64_t n = parse_count(flag, shift > 0 ? word.substr(0, word.size() - 1) : word, word);
      ZG_CHECK(n <= (int64_t{1} << (62 - shift)), program_, ": ", flag, " size '", word, "' is too large");
      out.push_back(n << shift);
    }
    return out;
  }

 private:
  std::vector<std::string> split(const std::string& flag, const std::string& text) const {
    std::vector<std::string> words;
    size_t start = 0;
    while (true) {
      const size_t comma = text.find(',', start);
      words.push_back(text.substr(start, comma - start));
      ZG_CHECK(!words.back().empty(), program_, ": ", flag, " needs a comma-separated list, got '", text, "'");
      if (comma == std::string::npos) return words;
      start = comma + 1;
    }
  }

  // `word` as a whole number >= 1; `shown` is the text an error quotes (by default `word`).
  int64_t parse_count(const std::string& flag, const std::string& word, const std::string& shown = "") const {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(word, &used);
    } catch (const std::exception&) {
    }
    ZG_CHECK(!word.empty() && used == word.size() && n >= 1, program_, ": ", flag,
             " needs whole numbers of at least 1, got '", shown.empty() ? word : shown, "'");
    return n;
  }

  std::string program_;
  int argc_;
  char** argv_;
  int next_ = 1;
};

}  // namespace zg::bench
