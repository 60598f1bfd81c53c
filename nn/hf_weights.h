// Hugging Face checkpoints' weight files, for the importers (nn/hf_gpt2.h, nn/hf_llama.h);
// not installed. save_pretrained writes a folder holding model.safetensors, or, past its
// max_shard_size, shards model-00001-of-0000N.safetensors ... and model.safetensors.index.json:
//   {"metadata": {"total_size": <bytes of all tensors>}, "weight_map": {"<tensor>": "<shard file>", ...}}
// HfWeights reads either, or one .safetensors file, as one set of named tensors;
// save_hf_weights writes them so.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"
#include "tensor/safetensors.h"

namespace zg::nn {

class HfWeights {
 public:
  // `path`: a .safetensors file, or a folder with model.safetensors or the index
  // (model.safetensors when both are there, as transformers reads). Every shard the index
  // names must be in the folder and hold exactly the tensors the index maps to it. `who`
  // opens the errors.
  HfWeights(const std::string& path, std::string who);
  const std::string& path() const { return path_; }
  const std::vector<std::string>& names() const { return names_; }  // every file's, in the files' order
  bool contains(const std::string& name) const { return file_of_.count(name) != 0; }
  const SafetensorsFile& file_of(const std::string& name) const;  // the file holding `name`

 private:
  void add(const std::string& file_path);
  std::string path_, who_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> names_;
  std::map<std::string, const SafetensorsFile*> file_of_;
};

// Writes `tensors` into `folder` (created if needed) as save_pretrained does: model.safetensors
// when their bytes are at most max_shard_bytes, else shards (in order, each at most
// max_shard_bytes unless one tensor alone is larger) and the index. Each file is written
// atomically and the index (or model.safetensors) after the shards; then the files of the
// other layout a previous save left there are removed, so a reader never finds two models.
void save_hf_weights(const std::string& folder, const NamedTensors& tensors, int64_t max_shard_bytes, const char* who);

// Refuses a model whose parameters live in a ShardedModel's flat buffers (its master weights
// would overwrite what a load writes, and a ZeRO-3 parameter holds only a shard): load and
// save before building that.
void refuse_owned_parameters(const Module& model, const char* who);

// Whether two tensors hold equal values (a file's tied head against its embedding).
bool same_values(const Tensor& a, const Tensor& b);

}  // namespace zg::nn
