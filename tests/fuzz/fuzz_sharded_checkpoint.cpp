// Fuzz target: a sharded checkpoint folder with one file replaced. Each input copies
// the tiny 2-rank save (tiny_save.h, made once per process), overwrites one of its
// files -- a rank's, or `latest` where the layout has one -- and loads the folder.
// Input byte 0 chooses: bits 0-3 the file (modulo their count), bits 4-5 the stage to
// load at, bit 7 one rank or two; the rest is the file's content. zg::Error is the only
// allowed failure; a hang (a rank left waiting for another) is a bug too.
#include "tiny_save.h"

namespace {

using namespace zg;

void load(dist::ProcessGroup& pg, const std::string& dir, int stage) {
  manual_seed(2);
  nn::GPT model(fuzz::tiny_gpt());
  dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f32});
  optim::GradScaler scaler;
  fuzz::expect_only_errors([&] { sharded.load(dir, &scaler); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const fuzz::TinySave saved(fuzz::scratch_dir() / "saved");
  if (size == 0) return 0;
  const fs::path dir = fuzz::scratch_dir() / "checkpoint";
  fs::remove_all(dir);
  fs::copy(saved.dir, dir, fs::copy_options::recursive);
  const uint8_t choice = data[0];
  fuzz::write_file(dir / saved.files[(choice & 0x0f) % saved.files.size()], data + 1, size - 1);
  const int stage = (choice >> 4) & 3;
  if (choice & 0x80) {
    fuzz::expect_only_errors([&] { dist::run_local(2, [&](dist::ProcessGroup& pg) { load(pg, dir.string(), stage); }); });
  } else {
    dist::SingleRank one;
    load(one, dir.string(), stage);
  }
  return 0;
}
