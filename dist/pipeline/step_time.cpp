#include "dist/pipeline/step_time.h"

#include <algorithm>
#include <array>

#include "tensor/tensor.h"

namespace zg::dist {

namespace {

// When the compute stream reaches events[event] in the replay: the start of the first
// compute span at or after it, else the step's end.
double reached(const StepTime& replay, size_t event) {
  for (const StepSpan& span : replay.compute_spans)
    if (span.event >= event) return span.start;
  return replay.step;
}

}  // namespace

PipelineStepTime predict_pipeline(const StepLog& log, const StepTime& replay, const Schedule& schedule, int rank) {
  // The marks an action left ("F3", "B0.1", "I2", "W2"), each action until the next mark.
  std::array<double, 4> total{};  // by Action::Kind
  std::array<int, 4> count{};
  for (size_t k = 0; k < log.marks.size(); ++k) {
    const std::string& name = log.marks[k].name;
    const size_t kind = std::string_view("FBIW").find(name.empty() ? '?' : name[0]);
    if (kind == std::string_view::npos || name.size() < 2 || name[1] < '0' || name[1] > '9') continue;
    const double end = k + 1 < log.marks.size() ? reached(replay, log.marks[k + 1].event) : replay.step;
    total[kind] += end - reached(replay, log.marks[k].event);
    ++count[kind];
  }
  const auto mean = [&](Action::Kind kind) { return count[kind] ? total[kind] / count[kind] : 0.0; };
  ZG_CHECK(count[Action::forward] > 0, "pipeline step time: the log has no action's mark; record it while the "
           "Pipeline runs (StepLogScope around Pipeline::run)");
  PipelineStepTime out;
  out.action.forward = mean(Action::forward);
  out.action.backward_input = schedule.splits_backward() ? mean(Action::backward_input) : mean(Action::backward) / 2;
  out.action.backward_weight = schedule.splits_backward() ? mean(Action::backward_weight) : mean(Action::backward) / 2;
  const Timeline timeline = simulate(schedule, out.action);
  for (const Timeline::Block& b : timeline.ranks.at(static_cast<size_t>(rank))) out.busy += b.end - b.start;
  out.idle = timeline.makespan - out.busy;
  out.step = replay.step + out.idle;
  return out;
}

}  // namespace zg::dist
