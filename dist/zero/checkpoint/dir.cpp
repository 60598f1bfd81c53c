#include "dist/zero/checkpoint/dir.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string_view>

#include "tensor/atomic_file.h"
#include "tensor/error.h"

namespace zg::dist::checkpoint_dir {

namespace {

constexpr const char* kLatest = "latest";
constexpr size_t kMaxLatestBytes = 1 << 16;  // a list of names; anything longer is not one

// Reads "<digits>" (at most 18) at `at`: its value, or -1.
int64_t number_at(const std::string& text, size_t& at) {
  int64_t value = 0;
  const size_t start = at;
  while (at < text.size() && std::isdigit(static_cast<unsigned char>(text[at])) && at - start < 18)
    value = value * 10 + (text[at++] - '0');
  return at > start ? value : -1;
}

bool literal_at(const std::string& text, size_t& at, std::string_view literal) {
  if (text.compare(at, literal.size(), literal) != 0) return false;
  at += literal.size();
  return true;
}

// The names `latest` lists, newest first: none when there is no `latest`; a zg::Error
// when it is there but not such a list.
std::vector<std::string> read_latest(const std::string& dir, const char* who) {
  const std::string path = dir + "/" + kLatest;
  std::error_code error;
  if (!std::filesystem::exists(std::filesystem::symlink_status(path, error))) return {};
  ZG_CHECK(std::filesystem::is_regular_file(path, error), who, ": ", path, " is not a regular file");
  std::ifstream in(path, std::ios::binary);
  std::string text(kMaxLatestBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  ZG_CHECK(text.size() <= kMaxLatestBytes, who, ": ", path, " is over ", kMaxLatestBytes,
           " bytes: not a list of saves");
  std::vector<std::string> names;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    ZG_CHECK(is_save_name(line), who, ": ", path, " names '", line.substr(0, 80),
             "', which is not a save folder (step-<step>-<id>): the file is damaged");
    names.push_back(line);
  }
  ZG_CHECK(!names.empty(), who, ": ", path, " names no save: the file is damaged");
  return names;
}

}  // namespace

std::string save_name(int64_t step, uint64_t id) {
  char name[64];
  std::snprintf(name, sizeof name, "step-%08lld-%08llx", static_cast<long long>(step),
                static_cast<unsigned long long>(id & 0xffffffffu));
  return name;
}

bool is_save_name(const std::string& name) {
  size_t at = 0;
  if (!literal_at(name, at, "step-") || number_at(name, at) < 0 || !literal_at(name, at, "-")) return false;
  const size_t hex = at;
  while (at < name.size() && std::isxdigit(static_cast<unsigned char>(name[at]))) ++at;
  return at - hex == 8 && at == name.size();
}

std::string rank_file(const std::string& folder, int rank, int size) {
  char name[64];
  std::snprintf(name, sizeof name, "/rank-%05d-of-%05d.safetensors", rank, size);
  return folder + name;
}

int world_size_of(const std::string& file_name) {
  size_t at = 0;
  if (!literal_at(file_name, at, "rank-")) return -1;
  const int64_t rank = number_at(file_name, at);
  if (rank < 0 || !literal_at(file_name, at, "-of-")) return -1;
  const int64_t size = number_at(file_name, at);
  if (size <= rank || size > (1 << 30) || !literal_at(file_name, at, ".safetensors") || at != file_name.size())
    return -1;
  return static_cast<int>(size);
}

std::vector<std::pair<std::filesystem::path, int>> rank_files_in(const std::string& folder, const char* who) {
  std::vector<std::pair<std::filesystem::path, int>> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(folder, error))
    if (const int n = world_size_of(entry.path().filename().string()); n > 0) files.emplace_back(entry.path(), n);
  ZG_CHECK(!error, who, ": cannot list ", folder, ": ", error.message());
  return files;
}

std::string current_save(const std::string& path, const char* who) {
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) return path;
  ZG_CHECK(std::filesystem::is_directory(path, error), who, ": ", path, " is not a directory");
  if (const std::vector<std::string> kept = read_latest(path, who); !kept.empty()) {
    const std::string folder = path + "/" + kept.front();
    ZG_CHECK(std::filesystem::is_directory(folder, error), who, ": ", path, "/", kLatest, " names the save ",
             kept.front(), ", but ", folder, " is missing (removed by hand?); load an older save by its folder");
    return folder;
  }
  if (!rank_files_in(path, who).empty()) return path;
  // No `latest` and no rank files: saves that never finished, or no checkpoint at all.
  std::vector<std::string> unfinished;
  for (const auto& entry : std::filesystem::directory_iterator(path, error))
    if (is_save_name(entry.path().filename().string())) unfinished.push_back(entry.path().filename().string());
  ZG_CHECK(unfinished.empty(), who, ": ", path, " holds no complete save: ", unfinished.front(),
           unfinished.size() > 1 ? " and others" : "", " never finished (a save killed part-way)");
  fail(who, ": ", path, " has no checkpoint: no ", kLatest, " file and no rank-R-of-N.safetensors files");
}

void make_current(const std::string& dir, const std::string& name, int keep) {
  std::vector<std::string> kept{name};
  try {
    for (const std::string& older : read_latest(dir, "ShardedModel::save"))
      if (static_cast<int>(kept.size()) < keep && older != name && std::filesystem::is_directory(dir + "/" + older))
        kept.push_back(older);
  } catch (const Error&) {
    // A damaged `latest` is replaced: the save just written is complete either way.
  }
  std::string text;
  for (const std::string& n : kept) text += n + "\n";
  sync_folder(dir);  // the new save's folder entry, before anything names it
  write_file_atomically(dir + "/" + kLatest, text, "ShardedModel::save");
  // Now current: what `latest` does not name is an older save, one killed part-way, or an
  // earlier version's rank files (and their temporaries) directly in dir.
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string file = entry.path().filename().string();
    const size_t temporary = file.find(".tmp.");
    const bool old_save = is_save_name(file) && std::find(kept.begin(), kept.end(), file) == kept.end();
    const bool old_rank_file = world_size_of(file.substr(0, temporary)) > 0;
    std::error_code ignored;
    if (old_save || old_rank_file) std::filesystem::remove_all(entry.path(), ignored);
  }
  sync_folder(dir);
}

}  // namespace zg::dist::checkpoint_dir
