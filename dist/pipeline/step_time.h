// The step-time model (dist/comm/step_model.h) for one rank of a pipeline. Replaying the
// rank's dry run gives its own work: each action's time, from the marks the executor
// leaves in the log where an action begins (its kernels and its messages' waits). What
// the replay cannot see is the time the rank waits for its peers; the schedule gives it:
// simulate() with the rank's mean F, I and W (every stage taken as long as this one, as
// the bubble formulas do), its idle time added to the replay's step.
#pragma once

#include "dist/comm/step_model.h"
#include "dist/pipeline/schedule.h"

namespace zg::dist {

struct PipelineStepTime {
  ActionTimes action;  // this rank's mean F, I and W a chunk (a whole B split in halves)
  double busy = 0;     // its actions' time in simulate()'s run
  double idle = 0;     // simulate()'s makespan minus busy: waiting for its peers
  double step = 0;     // the replay's step time + idle
};

// `log`: rank `rank`'s dry run of a step of `schedule` (recorded while the Pipeline ran);
// `replay`: predict(log, machine).
PipelineStepTime predict_pipeline(const StepLog& log, const StepTime& replay, const Schedule& schedule, int rank);

}  // namespace zg::dist
