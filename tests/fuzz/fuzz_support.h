// What the fuzz targets share: a scratch folder of this process's own, files written
// from the fuzzer's bytes, and the tiny model the checkpoint targets load into. Only
// the installed API (zerograd.h): a reader is fuzzed as a user of the library calls it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "zerograd.h"

namespace zg::fuzz {

// A folder under $TMPDIR (or /tmp) that lives as long as the process: inputs run one
// after another, each overwriting what the last one wrote.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "zg_fuzz_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    std::atexit([] { std::filesystem::remove_all(scratch_dir()); });
    return std::filesystem::path(pattern);
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// A GPT at the smallest sizes: one block, so a root unit and a block unit, every
// layer kind, and a rank's file of a few KB (the seed corpus keeps such files).
inline nn::GPTConfig tiny_gpt() {
  nn::GPTConfig c;
  c.n_layer = 1, c.n_head = 1, c.n_embd = 4, c.vocab_size = 8, c.block_size = 4;
  return c;
}

// Runs `load`. A zg::Error is how a reader refuses bad input; any other exception is a
// bug, and ends the process here, where its type is still known (run_local would turn a
// rank's into a zg::Error).
template <class Load>
void expect_only_errors(Load load) {
  try {
    load();
  } catch (const Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: an exception other than zg::Error: %s\n", e.what());
    std::abort();
  }
}

}  // namespace zg::fuzz
