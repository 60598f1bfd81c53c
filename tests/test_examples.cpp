// The examples run as a user runs them: train_gpt's loss falls and its last line
// is "final loss: X"; the README's model example trains.
#include <cstdio>
#include <regex>

#include "helpers.h"

#ifndef ZG_EXAMPLES_DIR
#define ZG_EXAMPLES_DIR "examples"
#endif

namespace zg::test {

TEST_CASE("train_gpt trains: the loss falls and the last line is 'final loss: X'") {
  int status = 0;
  const std::string out =
      run_command(std::string(ZG_EXAMPLES_DIR) + "/train_gpt --steps 40 --layers 2 --embd 64 --seq 32 --batch 4", status);
  CHECK(status == 0);
  std::vector<double> losses;
  const std::regex step_line(R"(step +\d+/\d+ \| loss ([0-9.]+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), step_line); it != std::sregex_iterator(); ++it)
    losses.push_back(std::stod((*it)[1]));
  REQUIRE(losses.size() == 40);
  std::smatch final_line;
  const std::string last = out.substr(out.rfind('\n', out.size() - 2) + 1);
  REQUIRE(std::regex_match(last, final_line, std::regex(R"(final loss: ([0-9.]+)\n)")));
  CHECK(std::stod(final_line[1]) == losses.back());
  MESSAGE("train_gpt loss " << losses.front() << " -> " << losses.back());
  CHECK(losses.back() < losses.front() - 1.0);
}

TEST_CASE("train_gpt refuses bad flags with a clear message") {
  int status = 0;
  const std::string out = run_command(std::string(ZG_EXAMPLES_DIR) + "/train_gpt --dtype f8 2>&1", status);
  CHECK(status != 0);
  CHECK(out.find("--dtype must be f32, bf16 or f16, got f8") != std::string::npos);
}

TEST_CASE("the README's write-your-own-model example trains") {
  int status = 0;
  const std::string out = run_command(std::string(ZG_EXAMPLES_DIR) + "/readme", status);
  MESSAGE(out.substr(out.rfind("loss")));
  CHECK(status == 0);
}

#ifdef ZG_BENCH_DIR
TEST_CASE("bench/zero_memory --json gives one record per stage with the formula beside each figure") {
  int status = 0;
  const std::string out =
      run_command(std::string(ZG_BENCH_DIR) + "/zero_memory --model 124m --world-size 8 --seq 8 --json", status);
  REQUIRE(status == 0);
  const std::regex record(R"re(\{"model": "124m", "device": "meta", "group": "fake", "stage": (\d), "world_size": 8, "rank": 0, "params": (\d+), "parameter": (\d+), "gradient": (\d+), "optimizer_state": (\d+), "activation": \d+, "communication": \d+, "peak_allocated": \d+, "reserved": \d+, "sent_per_step": (\d+), "formula_model_states": (\d+), "formula_sent_per_step": (\d+)\})re");
  int records = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), record); it != std::sregex_iterator(); ++it, ++records) {
    const auto& m = *it;
    INFO("stage " << m[1]);
    CHECK(std::stoll(m[2]) == 124'439'808);
    const double states = std::stod(m[3]) + std::stod(m[4]) + std::stod(m[5]), formula = std::stod(m[7]);
    CHECK(states >= formula);
    CHECK((states - formula) / formula < 0.005);
    CHECK(std::fabs(std::stod(m[6]) - std::stod(m[8])) / std::stod(m[8]) < 0.01);  // 2Ψ, and 3Ψ for stage 3
  }
  CHECK(records == 4);

  // The quick start's run: --device auto (here the CPU unless a GPU is usable), real steps.
  const std::string table = run_command(std::string(ZG_BENCH_DIR) + "/zero_memory --device auto --world-size 2 --stage 3", status);
  CHECK(status == 0);
  CHECK(table.find("GPT ") != std::string::npos);
  CHECK(run_command(std::string(ZG_BENCH_DIR) + "/zero_memory --stage 4 2>&1", status).find(
            "--stage must be 0, 1, 2, 3 or all, got '4'") != std::string::npos);
  CHECK(status != 0);
}

// bench/train_step's CPU path, as bench/torch_reference.py reads it: one JSON record,
// a loss per step (falling: every step trains on the same tokens), positive speed.
TEST_CASE("bench/train_step --json trains the same token block and reports speed and memory") {
  int status = 0;
  const std::string out = run_command(std::string(ZG_BENCH_DIR) +
                                          "/train_step --device cpu --model tiny --dtype f32 --batch 2 --seq 16 "
                                          "--steps 6 --warmup 1 --lr 1e-2 --json",
                                      status);
  REQUIRE(status == 0);
  const std::regex record(R"re(\{"impl": "zerograd", "model": "tiny", "device": "cpu", "dtype": "f32", "batch": 2, "seq": 16, "params": (\d+), "steps": 6, "timed_steps": 5, "ms_per_step": ([0-9.]+), "tokens_per_s": ([0-9.]+), .*"peak_allocated": (\d+), .*"losses": \[([^\]]*)\]\})re");
  std::smatch m;
  REQUIRE(std::regex_search(out, m, record));
  CHECK(std::stod(m[3]) > 0);
  CHECK(std::stoll(m[4]) > 0);
  std::vector<double> losses;
  const std::string list = m[5];
  const std::regex number(R"([0-9.]+)");
  for (auto it = std::sregex_iterator(list.begin(), list.end(), number); it != std::sregex_iterator(); ++it)
    losses.push_back(std::stod(it->str()));
  REQUIRE(losses.size() == 6);
  CHECK(losses.back() < losses.front() - 0.5);
  CHECK(run_command(std::string(ZG_BENCH_DIR) + "/train_step --dtype f8 2>&1", status).find(
            "--dtype must be bf16 or f32, got f8") != std::string::npos);
  CHECK(status != 0);
}
#endif

}  // namespace zg::test
