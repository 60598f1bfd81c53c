// The formats a save can be in, and the one step that reads an older one as the current:
//
//   5  zerograd-sharded-checkpoint-5, the current: a parameter cut across tensor-parallel
//      ranks is in the order of its slices, its cut in metadata split/<parameter>
//      (slice_order.h); its pieces' names count in that order
//   4  every role of every parameter in pieces, frozen ones too; rank 0's file holds the
//      buffers whole, as buffer/<name>
//   3  the frozen parameters whole in the first file, as frozen/<name>
//   2  no frozen parameters and no buffers (the model's are left as they are)
//   1  no parameter shapes either (its pieces are checked by element counts only)
//   0  optim::save_checkpoint's single file (zerograd-training-checkpoint-1): whole tensors
//      named <parameter> (master weights), optimizer.exp_avg.<parameter> and
//      optimizer.exp_avg_sq.<parameter>; no frozen parameters or buffers
//
// upgrade() names and shapes each tensor of an older file as the current format would:
// a whole tensor (format 0; format 3's frozen parameters), checked whole against the
// model, becomes its parameter's piece from element 0; a format-1 piece takes the model's
// shape as its parameter's recorded one. The index and the coverage (index.h,
// coverage.h) know only the current format, and whether a save holds frozen parameters
// and buffers at all.
#pragma once

#include <optional>
#include <string>

#include "dist/zero/checkpoint/model_parameters.h"
#include "tensor/safetensors.h"

namespace zg::dist::checkpoint {

inline constexpr int kFormatVersion = 5;
inline constexpr const char* kSingleFileFormat = "zerograd-training-checkpoint-1";

// "zerograd-sharded-checkpoint-<version>", for a version from 1 to kFormatVersion.
const char* format_name(int version);
// A file's format version (1 to kFormatVersion), or 0 for none of them.
int format_of(const Metadata& meta);
// Whether a save of `format` holds frozen parameters and buffers (from format 3 on).
bool holds_replicated(int format);

// A tensor of a save's file, as the current format has it.
struct SavedTensor {
  std::string tensor;  // its name in the file: what errors name and the load reads
  std::string name;    // the current format's name: <role>/<parameter>/<first element>, or buffer/<name>
  Shape shape;         // the current format's: a piece is 1-D
  // The parameter's shape, where the file records none: the whole tensor's, or (format
  // 1) the model's; otherwise the file's metadata "shape/<parameter>" holds it.
  std::optional<std::string> parameter_shape;
};
// `tensor` of `file`, a file of a save of `format` (the first file of it, or not); a
// zg::Error for what only an older format refuses: a frozen piece before format 4, or a
// whole tensor that does not fit the model's parameter.
SavedTensor upgrade(const SafetensorsFile& file, const std::string& tensor, int format, bool first_file,
                    const ModelParameters& model);

// A zg::Error unless `held_there`: `tensor`, held whole, is in the first file of a save
// that holds such tensors.
void check_held_in_first_file(bool held_there, const SafetensorsFile& file, const std::string& tensor);

}  // namespace zg::dist::checkpoint
