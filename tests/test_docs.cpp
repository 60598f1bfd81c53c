// Every command whose output the course (docs/) and the README quote runs here, and what
// it prints is compared with the quote (tests/quotes.h says how). A test case a file,
// named after it; a quote that goes stale fails its file's case with both texts.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "helpers.h"
#include "quotes.h"

namespace zg::test {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot read " << path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A folder that looks like a checkout after a build: build/ is the build under test,
// every other name links to the source tree (what commands write lands here).
fs::path workspace() {
  std::string templ = (fs::temp_directory_path() / "zg_docs_XXXXXX").string();
  REQUIRE(::mkdtemp(templ.data()) != nullptr);
  const fs::path dir = templ;
  for (const auto& entry : fs::directory_iterator(ZG_SOURCE_DIR))
    if (entry.path().filename() != "build") fs::create_directory_symlink(entry.path(), dir / entry.path().filename());
  fs::create_directory_symlink(ZG_BUILD_DIR, dir / "build");
  return dir;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs a file's quotes in order (a later one may read what an earlier one wrote), once
// per ISA setting; returns the quotes it ran.
int check_quotes(const std::string& file) {
  const std::vector<Quote> quotes = quotes_in(read_text(fs::path(ZG_SOURCE_DIR) / file));
  int ran = 0;
  for (const char* isa : {"", "portable"}) {
    const fs::path dir = workspace();
    for (const Quote& q : quotes) {
      if (!q.unchecked.empty()) {
        if (*isa == 0) MESSAGE(file << ":" << q.line << ": not run (" << q.unchecked << "): $ " << q.command);
        continue;
      }
      if (*isa != 0 && q.command.find("ZG_CPU_ISA=") != std::string::npos) continue;
      // mpirun refuses root without these (CI runs as root); MPI's own allocations leak.
      std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
      if (*isa != 0) env += std::string("ZG_CPU_ISA=") + isa + " ";
      if (q.command.find("mpirun") != std::string::npos) env += "ASAN_OPTIONS=\"${ASAN_OPTIONS}:detect_leaks=0\" ";
      int status = 0;
      const std::string output =
          run_command("cd " + shell_quote(dir.string()) + " && " + env + "bash -c " + shell_quote(q.command), status);
      ++ran;
      INFO(file << ":" << q.line << (*isa == 0 ? "" : " (ZG_CPU_ISA=portable)") << ": $ " << q.command);
      CHECK_MESSAGE(status == 0, "exit status " << status << "; output:\n" << output);
      const std::optional<std::string> wrong = quote_mismatch(q.expected, output);
      CHECK_MESSAGE(!wrong, *wrong);
    }
    fs::remove_all(dir);
  }
  return ran;
}

// The files QUOTES_OF below names, as it registers each.
std::set<std::string>& checked_files() {
  static std::set<std::string> files;
  return files;
}

}  // namespace

TEST_CASE("a quote matches line by line; '...' skips lines or text; timings are any number") {
  const std::string out = "GPT: 2 layers\nstep 1 | loss 2.5000 |    954 tok/s | took 1.5 s\nstep 2 | loss 2.4000\nfinal loss: 2.4000\n";
  CHECK_FALSE(quote_mismatch({"GPT: 2 layers", "...", "final loss: 2.4000"}, out));
  CHECK_FALSE(quote_mismatch({"GPT: ...", "step 1 | loss 2.5000 |   7457 tok/s | took 12.25 s", "...", "final loss: 2.4000"}, out));
  CHECK(quote_mismatch({"GPT: 2 layers", "...", "final loss: 2.4001"}, out));        // a digit
  CHECK(quote_mismatch({"GPT: 2 layers", "step 2 | loss 2.4000", "..."}, out));       // a line left out
  CHECK(quote_mismatch({"step 1 | loss 2.5001 |    954 tok/s | took 1.5 s", "..."}, out.substr(14)));
  const std::optional<std::string> wrong = quote_mismatch({"...", "final loss: 2.5000"}, out);
  REQUIRE(wrong);
  CHECK(wrong->find("final loss: 2.4000") != std::string::npos);  // the message shows what was printed
}

TEST_CASE("quotes are the console blocks' commands and the lines under each; an unchecked block says why") {
  const std::string md = "text\n```console\n$ echo a\na\n$ echo b\nb\n```\n```sh\n$ not a quote\n```\n"
                         "<!-- unchecked: needs a GPU -->\n```console\n$ nvidia-smi\nH100\n```\n"
                         "```console\n$ python3 -c \"print(1)\nprint('\\\"')\"\n1\n\"\n```\n";
  const std::vector<Quote> q = quotes_in(md);
  REQUIRE(q.size() == 4);
  CHECK(q[0].command == "echo a");
  CHECK(q[0].expected == std::vector<std::string>{"a"});
  CHECK(q[1].line == 5);
  CHECK(q[1].unchecked.empty());
  CHECK(q[2].unchecked == "needs a GPU");
  CHECK(q[3].command == "python3 -c \"print(1)\nprint('\\\"')\"");  // a command over two lines
  CHECK(q[3].expected == std::vector<std::string>{"1", "\""});
}

TEST_CASE("every markdown file of docs/ and the README has its quotes checked here") {
  std::set<std::string> found = {"README.md"};
  for (const auto& entry : fs::recursive_directory_iterator(fs::path(ZG_SOURCE_DIR) / "docs"))
    if (entry.path().extension() == ".md") found.insert(fs::relative(entry.path(), ZG_SOURCE_DIR).string());
  CHECK(found == checked_files());
}

TEST_CASE("a quote edited by one digit fails its check") {
  // The README's first quote, with its last digit changed: the same run must now fail.
  std::vector<Quote> quotes = quotes_in(read_text(fs::path(ZG_SOURCE_DIR) / "README.md"));
  auto q = std::find_if(quotes.begin(), quotes.end(), [](const Quote& q) { return q.unchecked.empty() && !q.expected.empty(); });
  REQUIRE(q != quotes.end());
  int status = 0;
  const fs::path dir = workspace();
  const std::string output = run_command("cd " + shell_quote(dir.string()) + " && bash -c " + shell_quote(q->command), status);
  fs::remove_all(dir);
  REQUIRE_FALSE(quote_mismatch(q->expected, output));
  bool edited = false;
  for (auto line = q->expected.rbegin(); line != q->expected.rend() && !edited; ++line)
    for (auto c = line->rbegin(); c != line->rend() && !edited; ++c)
      if (std::isdigit(static_cast<unsigned char>(*c))) *c = *c == '9' ? '0' : static_cast<char>(*c + 1), edited = true;
  REQUIRE(edited);
  CHECK(quote_mismatch(q->expected, output));
}

#define QUOTES_OF(file)                                                                  \
  static const bool DOCTEST_ANONYMOUS(quotes_of_) = checked_files().insert(file).second; \
  TEST_CASE(file ": every quoted command prints what the text quotes") { MESSAGE(check_quotes(file) << " runs"); }

QUOTES_OF("README.md")
QUOTES_OF("docs/01-bytes-per-parameter.md")
QUOTES_OF("docs/02-caching-allocator.md")
QUOTES_OF("docs/03-autograd-and-activations.md")
QUOTES_OF("docs/04-activation-checkpointing.md")
QUOTES_OF("docs/05-mixed-precision.md")
QUOTES_OF("docs/06-ddp.md")
QUOTES_OF("docs/07-zero.md")
QUOTES_OF("docs/09-offload.md")
QUOTES_OF("docs/10-checkpoints.md")
QUOTES_OF("docs/11-reading-traces.md")
QUOTES_OF("docs/12-device-mesh.md")
QUOTES_OF("docs/13-collectives.md")
QUOTES_OF("docs/14-overlap.md")
QUOTES_OF("docs/15-writing-models.md")
QUOTES_OF("docs/16-tensor-parallel.md")
QUOTES_OF("docs/17-pipeline-parallel.md")
QUOTES_OF("docs/18-zeropp.md")
QUOTES_OF("docs/19-infinity.md")
QUOTES_OF("docs/20-planner.md")
QUOTES_OF("docs/21-context-parallel.md")
QUOTES_OF("docs/answers.md")
QUOTES_OF("docs/tasks/README.md")
QUOTES_OF("docs/README.md")
QUOTES_OF("docs/design.md")
QUOTES_OF("docs/training-step.md")

}  // namespace zg::test
