// Crash consistency: train_zero and train_gpt, saving after every step, are killed with
// SIGKILL at random moments; after each kill the checkpoint on disk must load. Two jobs
// on one checkpoint folder: the second is refused, and a killed one leaves it free. A sharded
// save alternates world sizes (2 and 3 ranks) and stages; a single file is the
// consolidated export, loaded with nn::load_state.
//
// ZG_KILL_TRIALS sets the trials per kind (default 20), ZG_KILL_SEED the random moments
// (printed, so a failure can be replayed):
//   ZG_KILL_TRIALS=100 build/tests/test_crash
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "helpers.h"
#include "nn/gpt.h"
#include "nn/serialize.h"

#ifndef ZG_EXAMPLES_DIR
#define ZG_EXAMPLES_DIR "examples"
#endif

extern char** environ;

namespace zg::test {

namespace {

int env_number(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}

// The examples' model at the flags below: 1 layer, 1 head, n_embd 16, 8 tokens, bytes.
nn::GPTConfig small_config() {
  nn::GPTConfig c;
  c.n_layer = 1, c.n_head = 1, c.n_embd = 16, c.vocab_size = 256, c.block_size = 8;
  return c;
}
const std::vector<std::string> kSmall = {"--layers", "1", "--heads", "1", "--embd", "16", "--seq",
                                         "8", "--batch", "6", "--steps", "1000000", "--save-every", "1"};

// Starts `program` with `args`, its output discarded: its pid.
pid_t spawn(const std::string& program, std::vector<std::string> args) {
  args.insert(args.begin(), program);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  REQUIRE(posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

// Waits for `pid` to end: its exit status as waitpid gives it.
int reap(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// Starts `program` with `args` (its output discarded), lets it run for `delay`, kills it
// with SIGKILL and reaps it. Returns whether it was still running when killed.
bool kill_after(const std::string& program, std::vector<std::string> args, std::chrono::microseconds delay) {
  const pid_t pid = spawn(program, std::move(args));
  std::this_thread::sleep_for(delay);
  const bool running = ::waitpid(pid, nullptr, WNOHANG) == 0;
  ::kill(pid, SIGKILL);
  reap(pid);
  return running;
}

// The current save in `dir`, loaded at `ranks` and `stage` as a resume would: the error
// (empty if none), the folder and the step.
struct Loaded {
  std::string error, current;
  int64_t step = 0;
};
Loaded load_current(const std::string& dir, int ranks, int stage) {
  Loaded loaded;
  dist::run_local(ranks, [&](dist::ProcessGroup& pg) {
    nn::GPT model(small_config());
    dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f32});
    try {
      const Metadata meta = sharded.load(dir);
      if (pg.rank() == 0) loaded.current = meta.at("path"), loaded.step = sharded.steps();
    } catch (const Error& e) {
      if (pg.rank() == 0) loaded.error = e.what();
    }
  });
  return loaded;
}

// What kills left in a checkpoint directory beside the current save: folders of saves
// `latest` does not name (with what is in them), and temporaries.
struct Leftovers {
  int folders = 0, files = 0;
};
Leftovers leftovers(const std::string& dir, const std::string& current) {
  Leftovers left;
  std::error_code error;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    const bool other_save = name.starts_with("step-") && entry.path().parent_path() == dir && entry.path() != current;
    left.folders += other_save;
    left.files += name.find(".tmp.") != std::string::npos;
  }
  return left;
}

struct Trials {
  int trials = env_number("ZG_KILL_TRIALS", 20);
  unsigned seed = static_cast<unsigned>(env_number("ZG_KILL_SEED", static_cast<int>(std::random_device{}() & 0x7fffffff)));
  std::mt19937 random{seed};
  // Kill moments, uniform over the first 0.6 s of a run: start-up, the first saves, and
  // many later ones (a save of this model takes a few milliseconds).
  std::chrono::microseconds next_delay() { return std::chrono::microseconds(random() % 600000); }
};

}  // namespace

TEST_CASE("kill -9 at any moment of sharded saves, at alternating world sizes (half of them paging the state from "
          "the file tier), never leaves a checkpoint that does not load, nor a file tier's file") {
  Trials t;
  MESSAGE("ZG_KILL_TRIALS=" << t.trials << " ZG_KILL_SEED=" << t.seed);
  const std::string dir = "/tmp/zg_test_kill_sharded_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const std::string tier = dir + "_tier";  // offload nvme's folder: its files are unlinked as they open
  std::filesystem::create_directories(tier);
  int64_t last_step = 0;
  int loaded = 0, failed = 0, mid_save = 0;
  std::string last_current;  // the save that was current after the trial before
  int stalled = 0;           // trials in a row, before this one, in which no save became current
  for (int trial = 0; trial < t.trials; ++trial) {
    const int ranks = 2 + trial % 2, stage = trial % 4;
    const bool nvme = stage > 0 && trial % 8 >= 4;
    INFO("trial " << trial << ": train_zero --ranks " << ranks << " --stage " << stage << (nvme ? " --offload nvme" : ""));
    std::vector<std::string> args = kSmall;
    args.insert(args.end(), {"--ranks", std::to_string(ranks), "--stage", std::to_string(stage), "--save", dir});
    if (nvme) args.insert(args.end(), {"--offload", "nvme", "--offload-dir", tier});
    if (last_step > 0) args.insert(args.end(), {"--resume", dir});
    kill_after(std::string(ZG_EXAMPLES_DIR) + "/train_zero", args, t.next_delay());
    CHECK(std::filesystem::is_empty(tier));
    if (!std::filesystem::exists(dir + "/latest")) {
      CHECK(last_step == 0);  // no save ever finished: nothing to load yet
      continue;
    }
    // Load at the other world size and another stage, as a resume would.
    const Loaded save = load_current(dir, 5 - ranks, (stage + 1) % 4);
    CHECK_MESSAGE(save.error.empty(), save.error);
    if (!save.error.empty()) {
      ++failed;
      continue;
    }
    ++loaded;
    CHECK(save.step >= last_step);  // never an older save than one that loaded before
    last_step = save.step;
    const Leftovers left = leftovers(dir, save.current);
    mid_save += left.folders + left.files > 0;
    // The next save to become current clears what kills left: at most this kill's save,
    // the one current before it (a kill between the rename of `latest` and the clearing),
    // and one a trial for each trial in a row that was killed before any save of its own
    // became current (slow start-ups under load) -- never a pile that outlives a save.
    CHECK(left.folders <= 2 + stalled);
    stalled = save.current == last_current ? stalled + 1 : 0;
    last_current = save.current;
  }
  MESSAGE(t.trials << " kills: " << loaded << " loaded after the kill (" << mid_save << " of them killed in the middle "
                   << "of a save), " << failed << " failed to load; last step " << last_step);
  CHECK(loaded > 0);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(tier);
}

// Whether `dir`'s writer lock names `pid` as its holder, within a minute (a job takes it
// at its start).
bool holds(const std::string& dir, pid_t pid) {
  for (int tries = 0; tries < 600; ++tries) {
    std::ifstream in(dir + "/writer.lock");
    std::string holder;
    if (std::getline(in, holder) && holder.starts_with("pid " + std::to_string(pid) + " on host ")) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

TEST_CASE("two train_zero jobs on one --save folder: the second is refused at its start, naming the first; a killed "
          "one leaves the folder to the next") {
  // Before, each job's saves removed the other's save in progress: one died within a few
  // steps ("cannot rename ...tmp...") and its saves were gone.
  const std::string dir = "/tmp/zg_test_two_writers_" + std::to_string(::getpid());
  const std::string train_zero = std::string(ZG_EXAMPLES_DIR) + "/train_zero";
  std::filesystem::remove_all(dir);
  std::vector<std::string> args = kSmall;
  args.insert(args.end(), {"--ranks", "2", "--save", dir});
  std::vector<std::string> first_args = args;
  first_args.insert(first_args.end(), {"--steps", "400"});
  const pid_t first = spawn(train_zero, first_args);
  REQUIRE(holds(dir, first));
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof host - 1) == 0);
  int status = 0;
  std::string command = train_zero;
  for (const std::string& a : args) command += " " + a;
  const std::string second = run_command(command + " --steps 3 2>&1", status);
  INFO(second);
  CHECK(status != 0);
  CHECK(second.find("train_zero: --save: checkpoint folder " + dir + " is being written by pid " +
                    std::to_string(first) + " on host " + host + " since ") != std::string::npos);
  CHECK(second.find("; save into another folder, or stop that job first") != std::string::npos);
  CHECK(second.find("step ") == std::string::npos);  // refused before its first step
  CHECK(::waitpid(first, nullptr, WNOHANG) == 0);     // while the first trains
  const int first_status = reap(first);
  CHECK((WIFEXITED(first_status) && WEXITSTATUS(first_status) == 0));
  const Loaded saved = load_current(dir, 3, 1);
  CHECK_MESSAGE(saved.error.empty(), saved.error);
  CHECK(saved.step == 400);
  // A job killed with SIGKILL leaves no lock behind: the next one takes the folder.
  const pid_t killed = spawn(train_zero, args);
  REQUIRE(holds(dir, killed));
  ::kill(killed, SIGKILL);
  reap(killed);
  const std::string next = run_command(command + " --steps 3 2>&1", status);
  INFO(next);
  CHECK(status == 0);
  CHECK(load_current(dir, 2, 3).step == 3);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kill -9 at any moment of single-file saves never leaves a file that does not load") {
  Trials t;
  MESSAGE("ZG_KILL_TRIALS=" << t.trials << " ZG_KILL_SEED=" << t.seed);
  const std::string dir = "/tmp/zg_test_kill_file_" + std::to_string(::getpid());
  const std::string file = dir + "/weights.safetensors";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  int loaded = 0, failed = 0, mid_save = 0;
  for (int trial = 0; trial < t.trials; ++trial) {
    INFO("trial " << trial);
    std::vector<std::string> args = kSmall;
    args.insert(args.end(), {"--export", file});
    const bool existed = std::filesystem::exists(file);
    if (existed) args.insert(args.end(), {"--init", file});
    kill_after(std::string(ZG_EXAMPLES_DIR) + "/train_gpt", args, t.next_delay());
    if (!std::filesystem::exists(file)) {
      CHECK_FALSE(existed);
      continue;
    }
    nn::GPT model(small_config());
    std::string error;
    try {
      nn::load_state(model, file);
    } catch (const Error& e) {
      error = e.what();
    }
    CHECK_MESSAGE(error.empty(), error);
    (error.empty() ? loaded : failed) += 1;
    const Leftovers left = leftovers(dir, file);
    mid_save += left.files > 0;
    CHECK(left.files <= 1);  // the next save removes a killed one's temporary
  }
  MESSAGE(t.trials << " kills: " << loaded << " loaded after the kill (" << mid_save << " of them killed in the middle "
                   << "of a save), " << failed << " failed to load");
  CHECK(loaded > 0);
  std::filesystem::remove_all(dir);
}

}  // namespace zg::test
