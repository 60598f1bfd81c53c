// What one rank keeps per GPU, in its context's backend_state slot
// (tensor/context.h): its compute and communication streams, and the place for the
// library handles the backend needs per rank. Created on first use; destroyed with
// the rank's context, before its allocators.
#pragma once

#include "cuda/stream.h"
#include "tensor/device.h"

namespace zg::cuda {

struct RankState {
  explicit RankState(int device) : compute(device), communication(device) {}
  Stream compute;        // every kernel of the rank, in issue order
  Stream communication;  // collectives, so they overlap compute
};

// The current rank context's state for `device`; throws zg::Error for a device that is
// not a visible GPU.
RankState& rank_state(Device device);

}  // namespace zg::cuda
