// The sharded checkpoint the sharded fuzz target starts every input from, and which
// make_corpus draws its seeds from: a tiny GPT saved by 2 ranks (threads of a
// LocalGroup) at stage 3. Its files lose their save id (as files from before save ids
// had none), so that a seed file taken from another process's save -- with another
// id -- still belongs to this one, and the fuzzer reaches past the files' agreement.
#pragma once

#include <algorithm>
#include <filesystem>
#include <vector>

#include "fuzz_support.h"

namespace zg::fuzz {

struct TinySave {
  std::filesystem::path dir;
  // Every rank's file, wherever the save's layout put it, in path order, then `latest`
  // (the file naming the current save) if the layout has one; relative to `dir`.
  std::vector<std::filesystem::path> files;

  explicit TinySave(std::filesystem::path where) : dir(std::move(where)) {
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(tiny_gpt());
      dist::ShardedModel sharded(model, pg, {.stage = 3, .compute_dtype = DType::f32});
      optim::GradScaler scaler;
      sharded.save(dir.string(), {{"data_position", "0"}}, &scaler);
    });
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("rank-") && name.find("-of-") != std::string::npos && name.ends_with(".safetensors"))
        files.push_back(std::filesystem::relative(entry.path(), dir));
    }
    std::sort(files.begin(), files.end());
    for (const std::filesystem::path& file : files) forget_save_id(dir / file);
    if (std::filesystem::is_regular_file(dir / "latest")) files.push_back("latest");
  }

 private:
  static void forget_save_id(const std::filesystem::path& path) {
    const SafetensorsFile saved(path.string());
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& name : saved.names()) tensors.emplace_back(name, saved.read(name));
    Metadata meta = saved.metadata();
    meta.erase("save_id");
    save_safetensors(path.string(), tensors, meta);
  }
};

}  // namespace zg::fuzz
