// The examples' training data: a text file as byte-level tokens (vocabulary 256), read
// in windows of seq + 1 bytes: batch row b of a step starts at position + b * seq.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zerograd.h"

namespace zg::examples {

struct TextData {
  std::vector<int64_t> tokens;
  int64_t position = 0;
  int64_t windows = 0;  // start positions of a window of seq + 1 bytes

  TextData(const std::string& who, const std::string& path, int64_t seq) {
    ZG_CHECK(std::filesystem::is_regular_file(path), who, ": --data ", path, " is not a readable file");
    std::ifstream in(path, std::ios::binary);
    ZG_CHECK(in.good(), who, ": cannot read ", path);
    for (char c; in.get(c);) tokens.push_back(static_cast<unsigned char>(c));
    windows = static_cast<int64_t>(tokens.size()) - seq - 1;
    ZG_CHECK(windows > 0, who, ": the text has ", tokens.size(), " bytes, fewer than --seq + 2");
  }

  // inputs [B, T] and targets [B, T] (the next byte of each input byte)
  std::pair<Tensor, Tensor> next_batch(int64_t batch, int64_t seq, Device device) {
    std::vector<int64_t> x, y;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t start = (position + b * seq) % windows;
      x.insert(x.end(), tokens.begin() + start, tokens.begin() + start + seq);
      y.insert(y.end(), tokens.begin() + start + 1, tokens.begin() + start + seq + 1);
    }
    position = (position + batch * seq) % windows;
    const TensorOptions ids = TensorOptions(DType::i64).device(device);
    return {tensor(x, {batch, seq}, ids), tensor(y, {batch, seq}, ids)};
  }
};

// Command-line flags, one at a time: `while (flags.next())` then compare flags.name()
// and read its value as text, a real number or a whole number in range.
class FlagReader {
 public:
  FlagReader(std::string who, int argc, char** argv) : who_(std::move(who)), argc_(argc), argv_(argv) {}
  bool next() {
    if (++i_ >= argc_) return false;
    name_ = argv_[i_];
    return true;
  }
  const std::string& name() const { return name_; }
  std::string value() {
    ZG_CHECK(i_ + 1 < argc_, who_, ": ", name_, " needs a value");
    return argv_[++i_];
  }
  double number() {  // a real number: --lr, --dropout
    const std::string v = value();
    double x = 0;
    ZG_CHECK(parse_number(v, x), who_, ": ", name_, " expects a number, got '", v, "'");
    return x;
  }
  template <class T = int64_t>
  T count(std::type_identity_t<T> least) {  // a whole number >= least: sizes, steps, seeds
    const std::string v = value();
    T n = 0;
    ZG_CHECK(parse_number(v, n) && n >= least, who_, ": ", name_, " expects a whole number >= ", least, ", got '", v,
             "'");
    return n;
  }
  [[noreturn]] void unknown() { fail(who_, ": unknown flag ", name_, " (see --help)"); }

 private:
  std::string who_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string name_;
};

}  // namespace zg::examples
