// The model as a load checks a save against it: each parameter by name, with its shape
// and the dtype it is held in (the master dtype for the trained ones, the compute dtype
// for the frozen ones), and the buffers. A parameter trained in the save may be frozen
// in the model; one frozen in the save must be frozen in the model too (the save has no
// Adam state for it).
#pragma once

#include <map>
#include <string>

#include "dist/zero/checkpoint/slice_order.h"
#include "nn/module.h"
#include "tensor/safetensors.h"

namespace zg::dist::checkpoint {

struct ModelParameters {
  struct Held {
    Shape shape;  // the whole tensor's, when it is cut across tensor-parallel ranks
    DType dtype;
  };
  std::map<std::string, Held> trained, frozen;
  nn::NamedTensors buffers;  // "buffer/<name>"
  // One stage of a pipeline: the save's pieces and buffers of parameters it does not hold
  // are other stages' (PieceIndex::elsewhere), not unknown.
  bool pipeline_stage = false;

  // Where a piece of `parameter` loads into: the frozen parameter of that name, or for
  // a role other than frozen the trained one; null when the model has neither.
  const Held* find(const std::string& parameter, bool frozen_role) const;
};

// From the units' views, the replicated tensors ("frozen/<name>", "buffer/<name>") and
// the parameters cut across tensor-parallel ranks.
ModelParameters model_parameters(const std::vector<UnitRoles>& units, const nn::NamedTensors& replicated,
                                 const Cuts& cuts);

// A zg::Error unless `tensor` of `file` may load into a parameter held in `held`: of that
// dtype, or floating as it is. `kind` qualifies the piece expected ("1-D " or "").
void check_piece_dtype(const SafetensorsFile& file, const std::string& tensor, DType held, const char* kind);

}  // namespace zg::dist::checkpoint
