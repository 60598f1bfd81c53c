// Writes the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/): small valid
// files of each kind, the same without checksums (so that the fuzzer's changes to the
// data reach past the CRC check), and two broken safetensors files. From a build folder:
//   tests/fuzz/make_corpus ../tests/fuzz/corpus
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "../legacy_checkpoint.h"
#include "tiny_save.h"

namespace {

namespace fs = std::filesystem;
using namespace zg;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::cout << path.string() << " (" << bytes.size() << " bytes)\n";
}

// The same safetensors file with its "crc32c/<name>" metadata entries removed.
std::string without_checksums(const std::string& file) {
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(static_cast<uint8_t>(file[i])) << (8 * i);
  nlohmann::json header = nlohmann::json::parse(file.substr(8, length));
  nlohmann::json& meta = header["__metadata__"];
  for (auto it = meta.begin(); it != meta.end();) it = it.key().starts_with("crc32c/") ? meta.erase(it) : std::next(it);
  const std::string text = header.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text + file.substr(8 + length);
}

// A valid file, and the same without checksums.
void seeds_of(const fs::path& dir, const std::string& name, const std::string& file, const std::string& prefix = "") {
  write(dir / (name + ".safetensors"), prefix + file);
  write(dir / (name + "-no-crc.safetensors"), prefix + without_checksums(file));
}

void safetensors_seeds(const fs::path& out, const fs::path& scratch) {
  const fs::path path = scratch / "tensors.safetensors";
  save_safetensors(path.string(),
                   {{"f32", arange(6, TensorOptions(DType::f32)).view({2, 3})},
                    {"f16", ones({3}, TensorOptions(DType::f16))},
                    {"bf16", full({2}, -1.5, TensorOptions(DType::bf16))},
                    {"i64", arange(3, TensorOptions(DType::i64))},
                    {"bool", ones({2}, TensorOptions(DType::boolean))},
                    {"scalar", full({}, 2.0, TensorOptions(DType::f64))},
                    {"empty", zeros({0, 4}, TensorOptions(DType::f32))}},
                   {{"note", "seed"}, {"step", "3"}});
  const std::string file = read_file(path);
  seeds_of(out, "tensors", file);
  write(out / "truncated.safetensors", file.substr(0, file.size() - 5));
  write(out / "not-json.safetensors", std::string("\x09\0\0\0\0\0\0\0{not json", 17));
}

// Model state, and the former single-file training checkpoint made from a one-rank
// save as optim::save_checkpoint wrote it (tests/legacy_checkpoint.h).
void single_file_seeds(const fs::path& out, const fs::path& scratch) {
  manual_seed(1);
  nn::GPT model(fuzz::tiny_gpt());
  nn::save_state(model, (scratch / "state.safetensors").string());
  seeds_of(out, "state", read_file(scratch / "state.safetensors"));

  dist::SingleRank one;
  dist::ShardedModel sharded(model, one, {.stage = 0, .compute_dtype = DType::f32});
  optim::GradScaler scaler;
  test::save_single_file_checkpoint((scratch / "legacy.safetensors").string(), sharded, model, &scaler,
                                    {{"data_position", "0"}});
  seeds_of(out, "legacy", read_file(scratch / "legacy.safetensors"));
}

// Each file of the 2-rank save behind the selector byte that replaces it, loaded by one
// rank at stage 3; and the first loaded by two ranks at stage 1.
void sharded_seeds(const fs::path& out, const fs::path& scratch) {
  const fuzz::TinySave save(scratch / "two-ranks");
  for (size_t i = 0; i < save.files.size(); ++i) {
    const std::string bytes = read_file(save.dir / save.files[i]);
    const std::string name = "file" + std::to_string(i);
    if (save.files[i] == "latest") {
      write(out / (name + "-latest"), std::string(1, static_cast<char>(i)) + bytes);
      continue;
    }
    seeds_of(out, name + "-stage3", bytes, std::string(1, static_cast<char>(i | 0x30)));
    if (i == 0) write(out / (name + "-two-ranks-stage1.safetensors"), std::string(1, static_cast<char>(i | 0x90)) + bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_corpus CORPUS_DIR (tests/fuzz/corpus)\n";
    return 2;
  }
  const fs::path out = argv[1];
  const fs::path scratch = fuzz::scratch_dir();
  safetensors_seeds(out / "fuzz_safetensors", scratch);
  single_file_seeds(out / "fuzz_single_file_checkpoint", scratch);
  sharded_seeds(out / "fuzz_sharded_checkpoint", scratch);
  return 0;
}
