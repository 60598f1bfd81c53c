// The former single-file training checkpoint (format zerograd-training-checkpoint-1),
// made for tests and the fuzz corpus from a one-rank save: whole tensors <name> (f32
// master weights), optimizer.exp_avg.<name> and optimizer.exp_avg_sq.<name>, and metadata
// step, compute_dtype, rng_seed, rng_offset, the loss scale and the caller's keys.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "zerograd.h"

namespace zg::test {

// `trainer` must hold `model` over a group of one (its pieces are whole parameters).
inline void save_single_file_checkpoint(const std::string& path, dist::ShardedModel& trainer, const nn::Module& model,
                                        const optim::GradScaler* scaler = nullptr, const Metadata& extra = {}) {
  const std::string dir = path + ".sharded";
  trainer.save(dir, {}, scaler);
  const SafetensorsFile saved(dist::ShardedModel::current_save(dir) + "/rank-00000-of-00001.safetensors");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [prefix, role] : {std::pair<std::string, std::string>{"", "master"},
                                     {"optimizer.exp_avg.", "exp_avg"},
                                     {"optimizer.exp_avg_sq.", "exp_avg_sq"}})
    for (const auto& [name, p] : model.named_parameters())
      tensors.emplace_back(prefix + name, saved.read(role + "/" + name + "/0").view(p.shape()));
  Metadata meta = extra;
  meta["format"] = "zerograd-training-checkpoint-1";
  for (const char* key : {"step", "compute_dtype", "rng_seed", "rng_offset", "loss_scale", "loss_scale_good_steps"})
    if (saved.metadata().contains(key)) meta[key] = saved.metadata().at(key);
  save_safetensors(path, tensors, meta);
  std::filesystem::remove_all(dir);
}

}  // namespace zg::test
