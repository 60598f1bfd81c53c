#include "dist/zero/checkpoint/manifest.h"

#include <algorithm>
#include <filesystem>

#include "dist/comm/agreement.h"
#include "dist/zero/checkpoint/dir.h"
#include "dist/zero/checkpoint/formats.h"
#include "dist/zero/checkpoint/pieces.h"

namespace zg::dist::checkpoint {

namespace {

// The paths of one save's files: rank-R-of-N for every R < N; or the single file.
std::vector<std::string> paths_of(const std::string& save) {
  if (std::filesystem::is_regular_file(save)) return {save};
  int size = -1;
  for (const auto& [path, n] : checkpoint_dir::rank_files_in(save, kLoad)) {
    ZG_CHECK(size < 0 || size == n, kLoad, ": ", save, " mixes saves of ", size, " and ", n, " ranks");
    size = n;
  }
  ZG_CHECK(size > 0, kLoad, ": ", save, " has no rank-R-of-N.safetensors files");
  std::vector<std::string> paths;
  for (int q = 0; q < size; ++q) paths.push_back(checkpoint_dir::rank_file(save, q, size));
  return paths;
}

// The single file's format; or a sharded format, the first file's, on rank q's file of n.
void check_format(const SafetensorsFile& file, const SafetensorsFile& first, bool single_file, int q, int n) {
  const Metadata& meta = file.metadata();
  const std::string& path = file.path();
  if (single_file) {
    const auto format = meta.find("format");
    ZG_CHECK(format != meta.end() && format->second == kSingleFileFormat, kLoad, ": ", path,
             " is a file, not a checkpoint directory; pass the directory ShardedModel::save wrote (the one file "
             "load() takes is an earlier version's training checkpoint, format ", kSingleFileFormat,
             ", and this is not one)");
    return;
  }
  ZG_CHECK(format_of(meta) > 0, kLoad, ": ", path, " is not a zerograd sharded checkpoint");
  ZG_CHECK(format_of(meta) == format_of(first.metadata()), kLoad, ": ", path, " has format ", meta.at("format"), ", ",
           first.path(), " has ", first.metadata().at("format"), ": the files come from different saves");
  ZG_CHECK(metadata_number<int64_t>(meta, "world_size", path, kLoad) == n &&
               metadata_number<int64_t>(meta, "rank", path, kLoad) == q,
           kLoad, ": ", path, " says it is rank ", meta.at("rank"), " of ", meta.at("world_size"));
}

// The file's step (the first file's, `first_step`, unless this is the first file), a
// count of updates that can go on; its save id and loss scale the first file's; its
// generator state numbers. Returns the step.
int64_t check_same_save(const SafetensorsFile& file, const SafetensorsFile& first, int q, int64_t first_step) {
  const Metadata& meta = file.metadata();
  const std::string& path = file.path();
  const int64_t step = metadata_number<int64_t>(meta, "step", path, kLoad);
  ZG_CHECK(step >= 0 && step < INT64_MAX, kLoad, ": ", path, ": metadata 'step' = ", step,
           " is not a count of updates that can go on");
  ZG_CHECK(q == 0 || step == first_step, kLoad, ": ", path, " was saved at step ", step, ", ", first.path(),
           " at step ", first_step, ": the files come from different saves");
  // One save's files share its id and loss scale (older files have neither).
  for (const char* key : {"save_id", "loss_scale", "loss_scale_good_steps"}) {
    const auto value = [&](const SafetensorsFile& f) {
      const auto it = f.metadata().find(key);
      return it == f.metadata().end() ? std::string("(none)") : it->second;
    };
    ZG_CHECK(value(file) == value(first), kLoad, ": ", path, " has ", key, " ", value(file), ", ", first.path(),
             " has ", value(first), ": the files come from different saves");
  }
  // Every rank checks every file's generator state: all ranks accept the same files.
  metadata_number<uint64_t>(meta, "rng_seed", path, kLoad);
  metadata_number<uint64_t>(meta, "rng_offset", path, kLoad);
  return step;
}

}  // namespace

double Manifest::identity() const {
  Hash53 which;
  for (const char* key : {"save_id", "step"}) {
    const auto it = first().metadata().find(key);
    const std::string value = it == first().metadata().end() ? "" : it->second;
    which.mix(value.data(), value.size() + 1);
  }
  return which.value();
}

Manifest read_manifest(const std::string& path, int r, const optim::GradScaler* scaler) {
  Manifest manifest;
  manifest.path = path;
  const bool single_file = std::filesystem::is_regular_file(path);
  const std::vector<std::string> paths = paths_of(path);
  const int size = static_cast<int>(paths.size());
  for (int q = 0; q < size; ++q) {
    ZG_CHECK(std::filesystem::is_regular_file(paths[q]), kLoad, ": ", paths[q], " is missing (a save of ", size,
             " ranks)");
    manifest.files.push_back(std::make_unique<SafetensorsFile>(paths[q]));
    check_format(*manifest.files.back(), manifest.first(), single_file, q, size);
    manifest.step = check_same_save(*manifest.files.back(), manifest.first(), q, manifest.step);
  }
  const SafetensorsFile& mine = *manifest.files[std::min(r, size - 1)];
  manifest.seed = metadata_number<uint64_t>(mine.metadata(), "rng_seed", mine.path(), kLoad);
  manifest.offset = metadata_number<uint64_t>(mine.metadata(), "rng_offset", mine.path(), kLoad);
  manifest.scaler = optim::read_scaler_state(manifest.first().metadata(), scaler, manifest.first().path(), kLoad);
  manifest.format = format_of(manifest.first().metadata());
  manifest.holds_replicated = holds_replicated(manifest.format);
  return manifest;
}

Metadata manifest_metadata(const SaveHeader& save) {
  return {{"format", format_name(kFormatVersion)},
          {"save_id", std::to_string(save.save_id)},
          {"world_size", std::to_string(save.world_size)},
          {"rank", std::to_string(save.rank)},
          {"stage", std::to_string(save.stage)},
          {"step", std::to_string(save.step)},
          {"compute_dtype", name(save.compute_dtype)},
          {"rng_seed", std::to_string(save.rng_seed)},
          {"rng_offset", std::to_string(save.rng_offset)}};
}

void check_save_request(const Metadata& extra, const Metadata& meta, int keep) {
  ZG_CHECK(keep >= 1, "ShardedModel::save: keep = ", keep, " would keep no save; it must be at least 1");
  // The checkpoint's own keys would overwrite the caller's values ("path" is what load()
  // adds). shape/<parameter> and split/<parameter> keys are refused whole: a rank writes only those of the
  // parameters it owns, and every rank must refuse alike; the scaler's, with or without
  // a scaler, for the same reason.
  for (const auto& [key, value] : extra)
    ZG_CHECK(!key.starts_with("shape/") && !key.starts_with("split/") && !key.starts_with("loss_scale") && !meta.contains(key) && key != "path",
             "ShardedModel::save: the metadata key '", key, "' is one the checkpoint writes itself; name it otherwise");
}

}  // namespace zg::dist::checkpoint

