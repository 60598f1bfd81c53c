// The fuzz target this binary is linked with, run on every file of its corpus
// (ZG_FUZZ_CORPUS): the seeds, and each input a fuzzer crashed on, kept once fixed as
// a regression test. Any compiler builds it; libFuzzer is not needed to replay.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

TEST_CASE("every input of the fuzz corpus is read or refused with a zg::Error") {
  std::vector<std::filesystem::path> inputs;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(ZG_FUZZ_CORPUS))
    if (entry.is_regular_file()) inputs.push_back(entry.path());
  std::sort(inputs.begin(), inputs.end());
  REQUIRE(!inputs.empty());
  for (const std::filesystem::path& input : inputs) {
    INFO("input ", input.string());
    std::ifstream in(input, std::ios::binary);
    const std::string bytes(std::istreambuf_iterator<char>(in), {});
    CHECK(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()) == 0);
  }
}
