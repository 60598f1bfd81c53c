// When an offloaded step's CPU AdamW runs, as bench/zero_memory (--simulate) and
// bench/train_step take it (--offload-schedule): after the backward (ShardedModel::step), a
// unit at a time on a host thread as its gradient lands during the backward
// (step_in_backward), or beside the next step's forward and backward (the delayed parameter
// update, ZeroConfig::delayed_update_after).
#pragma once

#include <algorithm>
#include <iterator>
#include <string>
#include <vector>

#include "dist/zero/zero_config.h"
#include "tensor/error.h"

namespace zg::bench {

enum class OffloadSchedule { after_backward, in_backward, delayed };
inline constexpr const char* kOffloadSchedules[] = {"after-backward", "in-backward", "delayed"};

inline const char* name(OffloadSchedule s) { return kOffloadSchedules[static_cast<int>(s)]; }

inline OffloadSchedule parse_offload_schedule(const std::string& text, const char* who) {
  const auto* found = std::find(std::begin(kOffloadSchedules), std::end(kOffloadSchedules), text);
  ZG_CHECK(found != std::end(kOffloadSchedules), who, ": --offload-schedule takes after-backward, in-backward or "
           "delayed, got '", text, "'");
  return static_cast<OffloadSchedule>(found - std::begin(kOffloadSchedules));
}

// The configuration a schedule trains with: the update in the backward cannot clip (the
// norm needs every gradient first); the delayed one starts at the first step.
inline dist::ZeroConfig with_schedule(dist::ZeroConfig zero, OffloadSchedule s) {
  if (s == OffloadSchedule::in_backward) zero.max_grad_norm = 0;
  if (s == OffloadSchedule::delayed) zero.delayed_update_after = 0;
  return zero;
}

}  // namespace zg::bench
