// A module's state (parameters and buffers, by their dotted names) as a
// safetensors file: what PyTorch's state_dict + safetensors.torch.save_file write.
#pragma once

#include <string>
#include <vector>

#include "nn/module.h"
#include "tensor/safetensors.h"

namespace zg::nn {

void save_state(const Module& module, const std::string& path, const Metadata& metadata = {});
// What a load found, as PyTorch's load_state_dict reports it.
struct LoadedState {
  Metadata metadata;                    // the file's
  std::vector<std::string> missing;     // the module's names the file lacks
  std::vector<std::string> unexpected;  // the file's names the module lacks
};

// Reads every parameter and buffer from the file, by name, with its shape; floating
// dtypes convert (an f32 file loads into a bf16 model). With `strict`, a name in one
// but not the other is an error; without, the module's tensors the file lacks keep
// their values and the file's extra tensors are skipped, both listed in the result.
// A shared (tied) parameter loads from any of its names; a file naming it several
// times (as torch's state_dict does) must hold the same values under each.
// Every tensor is checked before any is written. Refused once the parameters live in a
// ShardedModel's buffers (their master weights would overwrite what
// is loaded): load before building those.
LoadedState load_state(Module& module, const std::string& path, bool strict = true);

}  // namespace zg::nn
