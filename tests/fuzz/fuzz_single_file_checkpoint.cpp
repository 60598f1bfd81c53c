// Fuzz target: the bytes as one file of model state: nn::load_state reads it into a
// tiny GPT (strict, then not), and ShardedModel::load over one rank reads it as the
// former single-file training checkpoint (format zerograd-training-checkpoint-1), with
// a loss scaler, at stages 0 and 3. zg::Error is the only allowed failure.
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zg;
  const std::string path = (fuzz::scratch_dir() / "checkpoint.safetensors").string();
  fuzz::write_file(path, data, size);
  manual_seed(1);
  for (const bool strict : {true, false}) {
    nn::GPT model(fuzz::tiny_gpt());
    fuzz::expect_only_errors([&] { nn::load_state(model, path, strict); });
  }
  for (const int stage : {0, 3}) {
    nn::GPT model(fuzz::tiny_gpt());
    dist::SingleRank one;
    dist::ShardedModel sharded(model, one, {.stage = stage, .compute_dtype = DType::f32});
    optim::GradScaler scaler;
    fuzz::expect_only_errors([&] { sharded.load(path, &scaler); });
  }
  return 0;
}
