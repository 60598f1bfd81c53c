// Reading a memory timeline (memory_timeline.h): as a trace that Perfetto and Chrome
// open, and as figures the library draws itself -- SVG, no plotting dependency.
//
//   MemoryTimeline timeline;
//   { MemoryTimelineRecording recording(timeline); train_step(); }
//   write_file_atomically("step.json", chrome_trace_json(timeline), "trace");
//   MemoryPanel panel{"rank 0", memory_series(timeline, 0, kCUDA)};
//   write_file_atomically("step.svg", memory_figure_svg({panel}, "one step"), "figure");
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tensor/memory.h"
#include "tensor/memory_timeline.h"

namespace zg {

// Chrome's trace event format (ui.perfetto.dev, chrome://tracing): a process per rank; a
// counter track ("C" events, {"bytes": n}) per device and category -- "cuda:0 activation",
// "host pool optimizer_state" -- and one of reserved bytes per allocator, each event its
// value after a change; a slice ("B"/"E") per range on its thread's row, its full path in
// args. Times in microseconds; a dry run's (meta) are event indices.
std::string chrome_trace_json(const MemoryTimeline& timeline);

// One rank's allocator on `device` through a recording: its bytes by category after each
// of its events, with its host pool's total beside them (offload) and the step's phases.
struct MemorySeries {
  struct Phase {
    std::string name;  // forward, backward, optimizer
    double begin = 0, end = 0;
  };
  bool dry_run = false;  // x is the event's index in the timeline; else milliseconds
  std::vector<double> x;
  std::vector<std::array<int64_t, kMemoryCategories>> bytes;
  std::vector<int64_t> reserved;  // the allocator's reserved bytes
  std::vector<int64_t> host;      // the rank's host pool, allocated (all zero without one)
  std::vector<Phase> phases;
  int64_t total(size_t i) const;  // allocated at sample i, all categories
  int64_t peak() const;           // the largest total: the allocator's peak_total
  int64_t peak_of(MemoryCategory category) const;
};
MemorySeries memory_series(const MemoryTimeline& timeline, int rank, Device device);

// A horizontal line drawn across a panel: "formula 16Ψ/N" at its bytes.
struct MemoryLevel {
  std::string label;
  int64_t bytes = 0;
};

struct MemoryPanel {
  std::string title;
  MemorySeries series;
  std::vector<MemoryLevel> levels;
  bool show_reserved = false;  // the reserved bytes as a line over the stack (caching, rounding)
};

// The panels side by side (two to a row) on one vertical scale: each a stacked area of
// bytes by category, its peak marked and labelled, its levels dashed, the host pool
// dotted, the phases as a band under the axis. Each panel's <g> carries its figures as
// data attributes (data-peak-bytes, data-baseline-y, data-bytes-per-px) so that a reader
// or a test can check what is drawn against what was measured.
std::string memory_figure_svg(const std::vector<MemoryPanel>& panels, const std::string& title);

}  // namespace zg
