// A sharded checkpoint directory, laid out so that no kill at any moment loses both the
// previous save and the new one:
//
//   dir/latest                                 the current save's folder name, then older kept ones
//   dir/step-00000120-3f2a9c1d/rank-00000-of-00002.safetensors
//   dir/step-00000120-3f2a9c1d/rank-00001-of-00002.safetensors
//
// Each save writes a new folder (step and a random id). Once every rank's file is durable,
// rank 0 makes it current with one atomic rename of `latest` (DeepSpeed's file of that
// name holds its tag the same way), and only then removes what `latest` no longer names:
// older saves beyond the kept ones, and folders of saves killed part-way. Until that
// rename, load() reads the previous save; after it, the new one. Those removals are safe
// because one job writes the folder: dir/writer.lock (dist/zero/writer_lock.h), which no
// save reads.
//
// Directories of earlier versions, with the rank files directly in `dir`, still load; a
// save into one replaces them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace zg::dist::checkpoint_dir {

// "step-<step, 8 digits or more>-<id, 8 hex digits>", and whether a name is one.
std::string save_name(int64_t step, uint64_t id);
bool is_save_name(const std::string& name);

// "<folder>/rank-RRRRR-of-NNNNN.safetensors", and N for such a file name (else -1).
std::string rank_file(const std::string& folder, int rank, int size);
int world_size_of(const std::string& file_name);
// The rank files directly in `folder`, each with its N.
std::vector<std::pair<std::filesystem::path, int>> rank_files_in(const std::string& folder, const char* who);

// What load(path) reads: a regular file as it is (the former single-file format); the
// folder `latest` names; else `path` itself, when it holds rank files (one save's folder,
// or an earlier version's directory). A zg::Error where there is no complete save.
std::string current_save(const std::string& path, const char* who);

// Rank 0, once every rank's file in dir/name is durable: `latest` names `name` first,
// then up to keep - 1 of the saves it named before; then every other save folder,
// and rank files of an earlier version's save, are removed (best effort: what cannot
// be removed now goes at the next save).
void make_current(const std::string& dir, const std::string& name, int keep);

}  // namespace zg::dist::checkpoint_dir
