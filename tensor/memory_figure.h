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

// A horizontal line drawn across a panel: "formula" at its bytes.
struct MemoryLevel {
  std::string label;
  int64_t bytes = 0;
  bool host = false;  // a level of the host pool ("host formula"), drawn in its colour
};

// Chrome's trace event format (ui.perfetto.dev, chrome://tracing): a process per rank; a
// counter track ("C" events named "cuda:0 activation", "host pool optimizer_state", with
// args {"bytes": n}: Perfetto names the track "cuda:0 activation bytes") per allocator and
// category, and one of reserved bytes per allocator ("cuda:0 reserved"), each event its
// value after a change; a slice ("B"/"E") per range on its thread's row, its full path in
// args. A row is named by its thread (set_trace_thread_name: "communication"), else
// "compute". Times in microseconds; a dry run's (meta) count the rank's memory events instead.
// `levels` (the formula's model states...) are kept in otherData for figures drawn later.
std::string chrome_trace_json(const MemoryTimeline& timeline, const std::vector<MemoryLevel>& levels = {});

// One rank's allocator through a trace (chrome_trace_json's, or a file it wrote): its
// bytes by category after each of its events, its host pool's total beside them
// (offload), and the step's phases -- forward, backward, optimizer.
struct MemorySeries {
  struct Phase {
    std::string name;
    double begin = 0, end = 0;
  };
  bool dry_run = false;  // x counts the rank's memory events; else it is in milliseconds
  std::vector<double> x;
  std::vector<std::array<int64_t, kMemoryCategories>> bytes;
  std::vector<int64_t> reserved;  // the allocator's reserved bytes
  std::vector<int64_t> host;      // the rank's host pool, allocated (all zero without one)
  std::vector<Phase> phases;
  int64_t total(size_t i) const;  // allocated at sample i, all categories
  int64_t peak() const;           // the largest total: the allocator's peak_total
  int64_t peak_of(MemoryCategory category) const;
};
// `allocator`: a device's name ("cpu", "cuda:0", "meta").
MemorySeries memory_series(const std::string& trace_json, int rank, const std::string& allocator);
MemorySeries memory_series(const MemoryTimeline& timeline, int rank, Device device);
std::vector<MemoryLevel> trace_levels(const std::string& trace_json);

struct MemoryPanel {
  std::string title;
  MemorySeries series;
  std::vector<MemoryLevel> levels;
  bool show_reserved = false;  // the reserved bytes as a line over the stack (caching, rounding)
  bool own_scale = false;      // on a vertical scale of its own: a close-up of what the shared one makes small
};

// The panels side by side (two to a row) on one vertical scale (but those on their own):
// each a stacked area of bytes by category, drawn as steps (a value holds until the next
// event), its peak marked and labelled, its levels dashed, the host pool a wide purple
// line, the phases as a band under the axis. Each panel's <g> carries its figures as
// data attributes (data-peak-bytes, data-baseline-y, data-bytes-per-px) so that a reader
// or a test can check what is drawn against what was measured.
std::string memory_figure_svg(const std::vector<MemoryPanel>& panels, const std::string& title);

}  // namespace zg
