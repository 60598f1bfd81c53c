// Pipeline schedules as a figure, SVG: a panel per schedule with a row per rank and time
// running right, each action a block -- F blue, B orange (I and W, its halves, in lighter
// and darker shades) -- labelled with its micro-batch, an interleaved schedule's later
// chunks lighter. The empty space is the bubble; each panel's title gives it, simulated
// and by its formula, and the activations each rank holds at most. All panels on one
// time scale: `times` are a whole stage's, an interleaved schedule's chunk taking 1/v.
//
//   const Schedule s = make_schedule(ScheduleKind::one_f_one_b, 4, 8);
//   write_file_atomically("1f1b.svg", schedule_svg({s}, "1F1B, p = 4, m = 8"), "figure");
#pragma once

#include <string>
#include <vector>

#include "dist/pipeline/schedule.h"

namespace zg::dist {

std::string schedule_svg(const std::vector<Schedule>& schedules, const std::string& title,
                         const ActionTimes& times = {});

}  // namespace zg::dist
