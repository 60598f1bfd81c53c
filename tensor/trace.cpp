#include "tensor/trace.h"

#include <atomic>

namespace zg {

namespace {
// Constant-initialised, so a backend may install its calls during static initialisation.
std::atomic<const TraceHooks*> installed{nullptr};
}  // namespace

void set_trace_hooks(const TraceHooks* hooks) { installed.store(hooks, std::memory_order_release); }

void set_trace_thread_name(const std::string& name) { TimelineHooks::name_thread(name); }

TraceRange::TraceRange(const char* name, TracePath scope)
    : hooks_(installed.load(std::memory_order_acquire)), timeline_(TimelineHooks::begin_range(name, scope)) {
  if (hooks_) hooks_->push(name);
}

TraceRange::~TraceRange() {
  TimelineHooks::end_range(timeline_);
  if (hooks_) hooks_->pop();
}

}  // namespace zg
