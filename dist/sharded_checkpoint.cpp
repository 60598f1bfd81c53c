// Sharded checkpoints. Every rank writes the slice [r S, (r+1) S) of each unit it
// owns (for DDP: the same slice of its full buffers, so the ranks share the
// writing), cut at parameter boundaries and named
//     <role>/<parameter name>/<first element>      role: master, exp_avg, exp_avg_sq
// Loading at another world size or stage only needs, for each parameter, the
// pieces that overlap the range a rank owns now -- found from the file headers.
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string_view>

#include "dist/unit.h"
#include "tensor/autograd.h"
#include "tensor/context.h"

namespace zg::dist {

namespace {

// N for a file named rank-R-of-N.safetensors (R < N, plain decimals), else -1.
int world_size_of(const std::string& file) {
  const auto number = [&](size_t& at) -> int64_t {
    int64_t value = 0;
    const size_t start = at;
    while (at < file.size() && std::isdigit(static_cast<unsigned char>(file[at])) && at - start < 9)
      value = value * 10 + (file[at++] - '0');
    return at > start ? value : -1;
  };
  const auto literal = [&](size_t& at, std::string_view text) {
    if (file.compare(at, text.size(), text) != 0) return false;
    at += text.size();
    return true;
  };
  size_t at = 0;
  if (!literal(at, "rank-")) return -1;
  const int64_t rank = number(at);
  if (rank < 0 || !literal(at, "-of-")) return -1;
  const int64_t size = number(at);
  if (size <= rank || !literal(at, ".safetensors") || at != file.size()) return -1;
  return static_cast<int>(size);
}

constexpr const char* kFormat = "zerograd-sharded-checkpoint-1";

std::string rank_file(const std::string& dir, int rank, int size) {
  char name[64];
  std::snprintf(name, sizeof name, "/rank-%05d-of-%05d.safetensors", rank, size);
  return dir + name;
}

// A unit range [begin, end) and where unit element `local_base` sits in the local buffers.
struct Owned {
  int64_t begin, end, local_base;
};
// What a rank writes: its slice r (for DDP, slice r of its full buffers, so ranks share the work).
Owned saved_range(const ShardedModel::Unit& unit, int rank, int stage) {
  const int64_t begin = rank * unit.shard, end = std::min(begin + unit.shard, unit.numel);
  return {begin, std::max(begin, end), stage == 0 ? 0 : begin};
}
// What a rank must read: everything for DDP (full buffers), else its slice.
Owned loaded_range(const ShardedModel::Unit& unit, int rank, int stage) {
  if (stage == 0) return {0, unit.numel, 0};
  return saved_range(unit, rank, stage);
}

struct Piece {
  const SafetensorsFile* file;
  std::string tensor;
  int64_t begin, length;  // in elements of the flattened parameter
};

// Calls fn(key, role buffer, entry, [a, b)) for every role of every parameter that overlaps
// `own`, with [a, b) the overlap in unit elements and key "role/parameter name".
template <class Fn>
void for_each_part(const ShardedModel::Unit& unit, const Owned& own, Fn fn) {
  const std::pair<const char*, const Tensor*> roles[] = {
      {"master", &unit.master}, {"exp_avg", &unit.m}, {"exp_avg_sq", &unit.v}};
  for (const auto& e : unit.entries) {
    const int64_t a = std::max(own.begin, e.offset), b = std::min(own.end, e.offset + numel(e.shape));
    if (b <= a) continue;
    for (const auto& [role, buffer] : roles) fn(std::string(role) + "/" + e.name, *buffer, e, a, b);
  }
}

}  // namespace

void ShardedModel::save(const std::string& dir, const Metadata& extra) {
  NoGradGuard no_grad;
  std::filesystem::create_directories(dir);
  const int r = group_.rank();
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& unit : units_) {
    const Owned own = saved_range(*unit, r, config_.stage);
    for_each_part(*unit, own, [&](const std::string& key, const Tensor& buffer, const auto& e, int64_t a, int64_t b) {
      tensors.emplace_back(key + "/" + std::to_string(a - e.offset), buffer.narrow(0, a - own.local_base, b - a));
    });
  }
  Metadata meta = extra;
  const Generator& gen = Context::current().generator();
  meta["format"] = kFormat;
  meta["world_size"] = std::to_string(group_.size());
  meta["rank"] = std::to_string(r);
  meta["stage"] = std::to_string(config_.stage);
  meta["step"] = std::to_string(step_);
  meta["compute_dtype"] = name(config_.compute_dtype);
  meta["rng_seed"] = std::to_string(gen.seed());
  meta["rng_offset"] = std::to_string(gen.offset());
  save_safetensors(rank_file(dir, r, group_.size()), tensors, meta);
  group_.barrier();  // every rank's file exists when save returns
}

Metadata ShardedModel::load(const std::string& dir) {
  NoGradGuard no_grad;
  // The files of one save: rank-R-of-N for every R < N.
  int old_size = -1;
  ZG_CHECK(std::filesystem::is_directory(dir), "ShardedModel::load: ", dir, " is not a directory");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const int n = world_size_of(entry.path().filename().string());
    if (n < 0) continue;
    ZG_CHECK(old_size < 0 || old_size == n, "ShardedModel::load: ", dir, " mixes saves of ", old_size, " and ", n,
             " ranks");
    old_size = n;
  }
  ZG_CHECK(old_size > 0, "ShardedModel::load: ", dir, " has no rank-R-of-N.safetensors files");
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  for (int q = 0; q < old_size; ++q) {
    const std::string path = rank_file(dir, q, old_size);
    ZG_CHECK(std::filesystem::exists(path), "ShardedModel::load: ", path, " is missing (a save of ", old_size,
             " ranks)");
    files.push_back(std::make_unique<SafetensorsFile>(path));
    ZG_CHECK(files.back()->metadata().count("format") && files.back()->metadata().at("format") == kFormat,
             "ShardedModel::load: ", path, " is not a zerograd sharded checkpoint");
  }
  // Index every saved piece by role and parameter.
  std::map<std::string, std::vector<Piece>> pieces;  // key: role/parameter
  for (const auto& file : files)
    for (const std::string& tensor : file->names()) {
      const size_t last = tensor.rfind('/');
      ZG_CHECK(last != std::string::npos, "ShardedModel::load: ", file->path(), ": unexpected tensor '", tensor, "'");
      pieces[tensor.substr(0, last)].push_back(
          {file.get(), tensor, std::stoll(tensor.substr(last + 1)), numel(file->entry(tensor).shape)});
    }

  const int r = group_.rank();
  for (auto& unit : units_) {
    const Owned own = loaded_range(*unit, r, config_.stage);
    for_each_part(*unit, own, [&](const std::string& key, const Tensor& buffer, const auto& e, int64_t a, int64_t b) {
      int64_t covered = 0;
      for (const Piece& p : pieces[key]) {
        // Overlap of the piece and [a, b), in parameter-local elements.
        const int64_t lo = std::max(a - e.offset, p.begin), hi = std::min(b - e.offset, p.begin + p.length);
        if (hi <= lo) continue;
        const Tensor data = p.file->read(p.tensor);
        Tensor(buffer.narrow(0, e.offset + lo - own.local_base, hi - lo)).copy_(data.narrow(0, lo - p.begin, hi - lo));
        covered += hi - lo;
      }
      ZG_CHECK(covered == b - a, "ShardedModel::load: ", dir, " does not cover ", key, " elements [", a - e.offset,
               ", ", b - e.offset, ") (", covered, " of ", b - a, " found)");
    });
  }
  const Metadata& mine = files[std::min(r, old_size - 1)]->metadata();
  step_ = std::stoll(mine.at("step"));
  Generator& gen = Context::current().generator();
  gen.manual_seed(std::stoull(mine.at("rng_seed")));
  gen.set_offset(std::stoull(mine.at("rng_offset")));
  refresh_compute();
  return files[0]->metadata();
}

void ShardedModel::refresh_compute() {
  NoGradGuard no_grad;
  for (auto& unit : units_) {
    const bool separate = config_.compute_dtype != unit->master.dtype();
    if (config_.stage == 0) {
      if (separate) unit->compute_full.copy_(unit->master);
      continue;
    }
    if (separate) unit->compute_shard.copy_(unit->master);
    if (config_.stage < 3) group_.all_gather(unit->compute_shard, unit->compute_full);
  }
}

void ShardedModel::export_consolidated(const std::string& path) {
  const nn::NamedTensors weights = gathered_master();
  if (group_.rank() == 0) save_safetensors(path, weights, {{"format", "zerograd-consolidated-1"}});
  group_.barrier();
}

}  // namespace zg::dist
