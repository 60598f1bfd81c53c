// The course's own programs run as a student runs them: docs/15-writing-models.md's
// example (examples/own_model) and the solutions of docs/tasks/README.md, each checking
// itself (exit status 0) and printing what the pages quote.
#include <regex>
#include <string>

#include "helpers.h"

#ifndef ZG_TASKS_DIR
#define ZG_TASKS_DIR "docs/tasks"
#endif
#ifndef ZG_EXAMPLES_DIR
#define ZG_EXAMPLES_DIR "examples"
#endif

namespace zg::test {

namespace {

std::string run_task(const std::string& name, int& status) {
  return run_command(std::string(ZG_TASKS_DIR) + "/" + name + " 2>&1", status);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("docs/15's example: a custom op and a layer pass gradcheck, a Llama trains, round-trips and generates, "
          "and builds sharded") {
  int status = 0;
  const std::string out = run_command(std::string(ZG_EXAMPLES_DIR) + "/own_model 2>&1", status);
  INFO(out);
  CHECK(status == 0);
  CHECK(contains(out, "gradcheck(squareplus): ok\n"));
  CHECK(contains(out, "gradcheck(layer): ok\n"));
  CHECK(contains(out, "Llama: 34976 parameters, units: model.layers.0 model.layers.1\n"));
  CHECK(contains(out, "generate after 5 8 11: 5 8 11 14 17 20 23 26 29 32 35\n"));  // the pattern it learned
  for (const char* rank : {"rank 0", "rank 1"})
    CHECK(contains(out, std::string(rank) + " of 2: model states 279808 B (16 x 34976 / 2), peak while building "
                                            "279808 B; weights equal the eager build's\n"));
}

TEST_CASE("task 1: the bytes-per-parameter formula reproduces what the library allocates, and zero_memory's formula") {
  int status = 0;
  const std::string out = run_task("adam8bit_bytes", status);
  INFO(out);
  CHECK(status == 0);  // measured == formula for every stage and N
  CHECK(!contains(out, "differs"));
  const std::regex row(R"(\n    (\d) +(\d+) +(\d+) +(\d+\.\d+)(?=\n))");  // the GPT-2 rows: a decimal last
  std::vector<long long> adamw;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), row); it != std::sregex_iterator(); ++it)
    adamw.push_back(std::stoll((*it)[2]));
  REQUIRE(adamw.size() == 4);
  CHECK(contains(out, "    0     1991036928     1244884176      10.0039\n"));  // 16 bytes against 10.0039
#ifdef ZG_BENCH_DIR
  // The same f32-state figures as the formula zero_memory prints beside what it measures.
  const std::string json =
      run_command(std::string(ZG_BENCH_DIR) + "/zero_memory --model 124m --world-size 8 --seq 8 --json", status);
  REQUIRE(status == 0);
  const std::regex formula(R"("stage": (\d),.*"formula_model_states": (\d+))");
  int stages = 0;
  for (auto it = std::sregex_iterator(json.begin(), json.end(), formula); it != std::sregex_iterator(); ++it, ++stages)
    CHECK(std::stoll((*it)[2]) == adamw[std::stoul((*it)[1])]);
  CHECK(stages == 4);
#endif
}

TEST_CASE("task 2: a model's own unit plan gives a unit per block, and ZeRO-3 on 2 ranks trains as one rank") {
  int status = 0;
  const std::string out = run_task("unit_plan", status);
  INFO(out);
  CHECK(status == 0);
  CHECK(contains(out, "5 units: root (98) blocks.0 (2144) blocks.1 (2144) blocks.2 (2144) blocks.3 (2144)\n"));
  CHECK(contains(out, "the same training as one rank\n"));
}

TEST_CASE("task 3: ZeRO-3's gathered peak with prefetch 1, 2 and 4 is what was predicted") {
  int status = 0;
  const std::string out = run_task("prefetch_peak", status);
  INFO(out);
  CHECK(status == 0);
  CHECK(contains(out, "       2       394752       394752       427648       427648\n"));
  CHECK(contains(out, "measured as predicted\n"));
}

TEST_CASE("task 4: reduce_scatter + all_gather sum as all_reduce does, and send its bytes plus the padding's") {
  int status = 0;
  const std::string out = run_task("ring_all_reduce", status);
  INFO(out);
  CHECK(status == 0);
  // 2 (N-1)/N x 4004 bytes, against (N-1)/N x 4016 twice: 1001 values padded to 1004.
  CHECK(out == "N = 4, 1001 f32 values: all_reduce sent 6006 bytes, reduce_scatter + all_gather 6024; sums equal\n");
}

}  // namespace zg::test
