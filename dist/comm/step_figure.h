// The step model's schedule (step_model.h) as a Gantt chart, SVG: per panel a compute
// row -- its kernels, coloured by the phase the log marks (forward, backward, optimizer),
// and the time it waits in red -- over the host thread's row where it ran tasks (offload's
// CPU AdamW beside the backward), then a row per group's link with each collective,
// coloured by kind; offload's work is coloured by kind (CPU, host link, disk) wherever it runs. Every panel on one time scale; no clock is read, so the
// figure is the same on every machine.
//
//   StepLog log;  // a dry run's, recorded under a StepLogScope
//   const StepTime t = predict(log, machine);
//   write_file_atomically("step.svg", step_schedule_svg({{"ZeRO-3, N = 8", log, t}}, "one step"), "figure");
#pragma once

#include <string>
#include <vector>

#include "dist/comm/step_model.h"

namespace zg::dist {

struct SchedulePanel {
  std::string title;
  const StepLog& log;
  StepTime time;  // predict(log, ...)
};

// `subtitle`: under the title (the machine's rates, Machine::describe()).
std::string step_schedule_svg(const std::vector<SchedulePanel>& panels, const std::string& title,
                              const std::string& subtitle = "");

}  // namespace zg::dist
