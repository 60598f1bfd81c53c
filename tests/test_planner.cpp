// zero_memory --plan (bench/plan.h): the search, the ranking and the report, on a Llama read
// from a config.json; each figure it ranks by is the dry run's and the step model's.
// (A build without the benches, -Dbench=false, compiles this file empty.)
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "helpers.h"

namespace zg::test {

#ifdef ZG_BENCH_DIR  // a build with -Dbench=false has no zero_memory to run
namespace {

const std::string kZeroMemory = std::string(ZG_BENCH_DIR) + "/zero_memory";
const std::string kTinyLlama = std::string(ZG_TEST_FIXTURES) + "/hf_llama/config.json";
// A toy cluster the tiny Llama does not always fit: 16 GPUs in nodes of 4, 200 KB each.
const std::string kCluster = " --gpus 16 --gpus-per-node 4 --gpu-memory 0.2MB --seq 32 --global-batch 64";

nlohmann::json plan(const std::string& flags) {
  int status = 0;
  const std::string out = run_command(kZeroMemory + " --plan --config " + kTinyLlama + kCluster + flags + " --json", status);
  REQUIRE(status == 0);
  return nlohmann::json::parse(out);
}

std::string key(const nlohmann::json& r) {
  return r["setting"].get<std::string>() + " " + r["dp_replicate"].dump() + "x" + r["dp_shard"].dump() + "x" +
         r["tp"].dump() + "x" + r["pp"].dump() + " " + r["micro_batch_rows"].dump() + "x" + r["micro_batches"].dump() +
         (r["activation_checkpointing"].get<bool>() ? " AC" : "");
}

}  // namespace

TEST_CASE("zero_memory --plan: every setting splits the cluster and the batch, fitting ones ranked by tokens/s") {
  const nlohmann::json ranked = plan("");
  REQUIRE(ranked.size() > 50);
  bool fitting = true, saw_offload = false, saw_checkpointing = false, saw_misfit = false;
  double last_speed = 1e300;
  for (const nlohmann::json& r : ranked) {
    INFO(key(r));
    CHECK(r["dp_replicate"].get<int>() * r["dp_shard"].get<int>() * r["tp"].get<int>() * r["pp"].get<int>() == 16);
    CHECK(r["dp_replicate"].get<int>() * r["dp_shard"].get<int>() * r["micro_batch_rows"].get<int>() *
              r["micro_batches"].get<int>() == 64);
    const bool fits = r["fits"].get<bool>();
    CHECK(fits == (r["peak_bytes"].get<int64_t>() <= 200'000));
    CHECK((!fits || fitting));  // every fitting setting before every other
    if (fits) CHECK(r["tokens_per_second"].get<double>() <= last_speed);
    if (fits) last_speed = r["tokens_per_second"].get<double>();
    fitting = fits;
    saw_misfit |= !fits;
    saw_offload |= r["offload"] != "none";
    saw_checkpointing |= r["activation_checkpointing"].get<bool>();
    CHECK(r["tokens_per_second"].get<double>() ==
          doctest::Approx(64.0 * 32 / r["step_seconds"].get<double>()).epsilon(1e-6));
  }
  CHECK(ranked.front()["fits"].get<bool>());
  // The ladder of memory savers ran: settings that did not fit were tried again with them.
  CHECK(saw_misfit);
  CHECK(saw_offload);
  CHECK(saw_checkpointing);
}

TEST_CASE("zero_memory --plan on long sequences: context parallelism joins the search, each variant where it divides") {
  // The tiny Llama with room for 16,384 positions: cp = 2 leaves a rank 8,192 tokens, cp = 4 too few.
  const std::string dir = "/tmp/zg_test_plan_cp_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::ifstream in(kTinyLlama);
  nlohmann::json config = nlohmann::json::parse(in);
  config["max_position_embeddings"] = 16384;
  std::ofstream(dir + "/config.json") << config.dump();
  int status = 0;
  const std::string out = run_command(kZeroMemory + " --plan --config " + dir + "/config.json --gpus 8 --gpus-per-node 4 "
                                      "--gpu-memory 0.2GB --seq 16384 --global-batch 8-sequences --json", status);
  REQUIRE(status == 0);
  std::map<std::string, int> variants;
  for (const nlohmann::json& r : nlohmann::json::parse(out)) {
    INFO(key(r) << " cp " << r["cp"]);
    const int cp = r["cp"].get<int>(), tp = r["tp"].get<int>();
    CHECK(r["dp_replicate"].get<int>() * r["dp_shard"].get<int>() * cp * tp * r["pp"].get<int>() == 8);
    CHECK((cp == 1 || cp == 2));
    if (cp == 2) ++variants[r["cp_variant"].get<std::string>()];
    if (r["cp_variant"] == "ulysses") CHECK(tp == 1);  // 4 heads, 2 key/value heads: C = 2 divides them at T = 1 only
  }
  CHECK(variants.size() == 3);
  std::filesystem::remove_all(dir);
}

TEST_CASE("zero_memory --plan --host-memory: offloaded settings fit only where the node's host pools do") {
  const nlohmann::json ranked = plan(" --host-memory 0.3MB");
  int refused_by_host = 0;
  for (const nlohmann::json& r : ranked) {
    INFO(key(r));
    const bool device = r["peak_bytes"].get<int64_t>() <= 200'000;
    const bool host = r["host_peak_bytes"].get<int64_t>() * 4 <= 300'000;  // 4 GPUs a node
    CHECK(r["fits"].get<bool>() == (device && host));
    refused_by_host += device && !host;
  }
  CHECK(refused_by_host > 0);
  CHECK(ranked.front()["fits"].get<bool>());
}

TEST_CASE("zero_memory --plan: the top setting's peak and bytes are the dry run's of that setting, run alone") {
  const nlohmann::json top = plan("").front();
  const int tp = top["tp"], pp = top["pp"], s = top["dp_shard"], dp = top["dp_replicate"].get<int>() * s;
  std::string flags = " --config " + kTinyLlama + " --world-size 16 --seq 32 --ranks-per-node 4 --json --stage " +
                      std::to_string(top["stage"].get<int>()) + " --offload " + top["offload"].get<std::string>() +
                      " --batch " + top["micro_batch_rows"].dump() + " --micro-batches " + top["micro_batches"].dump() +
                      " --steps 2";
  if (tp > 1) flags += " --tp " + std::to_string(tp) + " --sequence-parallel";
  if (pp > 1) flags += " --pp " + std::to_string(pp);
  if (s != dp) flags += " --shard-group " + std::to_string(s);
  if (top["activation_checkpointing"].get<bool>()) flags += " --checkpointing";
  int status = 0;
  const std::string out = run_command(kZeroMemory + flags, status);
  INFO(flags << "\n" << out);
  REQUIRE(status == 0);
  const nlohmann::json alone = nlohmann::json::parse(out).front();
  CHECK(alone["peak_allocated"].get<int64_t>() <= top["peak_bytes"].get<int64_t>());  // pp: the last stage's may be more
  if (pp == 1) CHECK(alone["peak_allocated"].get<int64_t>() == top["peak_bytes"].get<int64_t>());
}

TEST_CASE("zero_memory --plan: a step of many micro-batches extended from two dry runs is the full dry run's") {
  const nlohmann::json extended = plan(""), full = plan(" --plan-full-runs");
  REQUIRE(extended.size() == full.size());
  std::map<std::string, nlohmann::json> by_key;
  for (const nlohmann::json& r : full) by_key[key(r)] = r;
  int longer = 0;
  for (const nlohmann::json& r : extended) {
    INFO(key(r));
    REQUIRE(by_key.count(key(r)) == 1);
    const nlohmann::json& f = by_key[key(r)];
    longer += r["micro_batches"].get<int>() > std::max(r["pp"].get<int>(), 2) + 1;
    CHECK(r["peak_bytes"] == f["peak_bytes"]);
    for (const char* bytes : {"sent_within_node_bytes", "sent_across_nodes_bytes"})
      CHECK(r[bytes].get<double>() == doctest::Approx(f[bytes].get<double>()).epsilon(1e-6));
    CHECK(r["step_seconds"].get<double>() == doctest::Approx(f["step_seconds"].get<double>()).epsilon(0.1));
  }
  CHECK(longer > 10);  // the extension was used
  CHECK(key(extended.front()) == key(full.front()));
}

TEST_CASE("zero_memory --plan prints the table and why the top setting wins; bad requests are refused") {
  int status = 0;
  const std::string table = run_command(kZeroMemory + " --plan --config " + kTinyLlama + kCluster + " --top 5", status);
  CHECK(status == 0);
  CHECK(table.find("Llama hf_llama on 16 GPUs (4 a node, 0.2 MB each), global batch 64 x 32 tokens") == 0);
  CHECK(table.find(" wins: ") != std::string::npos);
  CHECK(table.find("\n   5  ") != std::string::npos);
  CHECK(table.find("\n   6  ") == std::string::npos);
  const auto refused = [&](const std::string& flags, const std::string& says) {
    const std::string out = run_command(kZeroMemory + " --plan --config " + kTinyLlama + flags + " 2>&1", status);
    INFO(flags << ": " << out);
    CHECK(status != 0);
    CHECK(out.find(says) != std::string::npos);
  };
  // --rates FILE: the flags it holds (as --calibrate prints them), as if given on the command line.
  const std::string rates = std::filesystem::temp_directory_path() / ("zg-rates-" + std::to_string(::getpid()));
  std::ofstream(rates) << "--tflops 100 --inter-gbps 20\n";
  CHECK(plan(" --rates " + rates) == plan(" --tflops 100 --inter-gbps 20"));
  CHECK(plan(" --rates " + rates) != plan(""));
  std::filesystem::remove(rates);
  refused(" --rates /nonexistent/rates", "--rates /nonexistent/rates cannot be read");
  refused(" --seq 32 --global-batch 1000-tokens", "is 1000 tokens, not a whole number of sequences of 32");
  refused(" --seq 32 --global-batch 4-rows", "--global-batch is N-tokens or N-sequences");
  refused(" --gpu-memory 80XB", "--gpu-memory needs a size such as 80GB");
  refused(" --seq 128", "--seq 128 is longer than Llama hf_llama's 64 positions");
  refused(" --model 124m", "both name the model");
}

TEST_CASE("zero_memory takes a Llama from config.json and any sequence length (a GPT's positions grow)") {
  int status = 0;
  const std::string table = run_command(kZeroMemory + " --config " + kTinyLlama + " --world-size 4 --stage 3 --seq 32",
                                        status);
  CHECK(status == 0);
  CHECK(table.find("Llama hf_llama: Ψ = ") == 0);
  const std::string gpt2 = run_command(kZeroMemory + " --config " + std::string(ZG_TEST_FIXTURES) +
                                       "/hf_gpt2 --world-size 2 --stage 1 --seq 32", status);
  CHECK(status == 0);
  CHECK(gpt2.find("GPT hf_gpt2: Ψ = 11200 parameters") == 0);
  const std::string simulated =
      run_command(kZeroMemory + " --model 124m --simulate --seq 8192 --world-size 8 --stage 3 --json", status);
  REQUIRE(status == 0);
  const nlohmann::json rows = nlohmann::json::parse(simulated);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0]["tokens_per_second"].get<double>() > 0);
}

#endif  // ZG_BENCH_DIR

}  // namespace zg::test
