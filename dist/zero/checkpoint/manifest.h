// A save's manifest: its files -- rank-R-of-N.safetensors for every R < N in its folder,
// or optim::save_checkpoint's single file -- opened, and what their metadata says of the
// save, every file's checked alike on every rank (so all ranks accept the same files):
// the format, each file's world size and rank, the step, the save's id and loss scale,
// the generator states. Also what a save writes there.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optim/grad_scaler.h"
#include "tensor/safetensors.h"

namespace zg::dist::checkpoint {

struct Manifest {
  std::string path;  // the save: its folder, or the single file
  std::vector<std::unique_ptr<SafetensorsFile>> files;  // rank R's at R
  int format = 0;                 // formats.h
  bool holds_replicated = false;  // frozen parameters and buffers (formats 0-2 hold neither)
  int64_t step = 0;
  uint64_t seed = 0, offset = 0;  // this rank's generator state
  std::optional<optim::ScalerState> scaler;

  const SafetensorsFile& first() const { return *files.front(); }
  // The save's id and step hashed, for the ranks to agree that they found the same save.
  double identity() const;
};

// The save at `path` (what checkpoint_dir::current_save gives), as rank r reads it:
// with more ranks than the save had, r takes the last saved rank's generator state.
// `scaler` is the one to load into (GradScaler state is checked for it).
Manifest read_manifest(const std::string& path, int r, const optim::GradScaler* scaler);

// What each rank's file of a save says of it, before the scaler's state and the
// caller's keys.
struct SaveHeader {
  uint64_t save_id;
  int world_size, rank, stage;
  int64_t step;
  DType compute_dtype;
  uint64_t rng_seed, rng_offset;
};
Metadata manifest_metadata(const SaveHeader& save);
// A zg::Error for a `keep` below 1, or a key of `extra` that the save writes itself
// (`meta`: manifest_metadata's).
void check_save_request(const Metadata& extra, const Metadata& meta, int keep);

}  // namespace zg::dist::checkpoint
