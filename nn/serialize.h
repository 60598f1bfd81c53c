// A module's state (parameters and buffers, by their dotted names) as a
// safetensors file: what PyTorch's state_dict + safetensors.torch.save_file write.
#pragma once

#include <string>

#include "nn/module.h"
#include "tensor/safetensors.h"

namespace zg::nn {

void save_state(const Module& module, const std::string& path, const Metadata& metadata = {});
// Every parameter and buffer must be in the file with its shape; floating dtypes
// convert (an f32 file loads into a bf16 model). Names in the file that the module
// lacks are an error unless `strict` is false. Returns the file's metadata. Refused
// once the parameters live in a FlatParameters' or ShardedModel's buffers (their master
// weights would overwrite what is loaded): load before building those.
Metadata load_state(Module& module, const std::string& path, bool strict = true);

}  // namespace zg::nn
