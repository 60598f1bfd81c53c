#include "tensor/step_log.h"

#include <utility>

namespace zg {

namespace {
thread_local StepLog* recording = nullptr;
}

StepLog* StepLog::current() { return recording; }

void StepLog::compute(double flops, double bytes) { offload(StepEvent::Kind::compute, bytes), events.back().flops += flops; }

void StepLog::offload(StepEvent::Kind kind, double bytes) {
  if (events.empty() || events.back().kind != kind || (!marks.empty() && marks.back().event == events.size()))
    events.push_back({.kind = kind});
  StepEvent& e = events.back();
  e.bytes += bytes, ++e.kernels;
}

int64_t StepLog::issue(int op, double sent, const void* group, int size, int stride) {
  int index = 0;
  while (index < static_cast<int>(groups.size()) && groups[index].identity != group) ++index;
  if (index == static_cast<int>(groups.size())) groups.push_back({group, size, stride});
  events.push_back({.kind = StepEvent::Kind::issue, .collective = issued_, .op = op, .group = index, .sent = sent});
  return issued_++;
}

void StepLog::wait(int64_t collective) {
  events.push_back({.kind = StepEvent::Kind::wait, .collective = collective});
}

std::shared_ptr<StepLog> StepLog::queue() {
  events.push_back({.kind = StepEvent::Kind::queue, .task = static_cast<int64_t>(tasks.size())});
  return tasks.emplace_back(std::make_shared<StepLog>());
}

void StepLog::join() { events.push_back({.kind = StepEvent::Kind::join}); }

void StepLog::mark(std::string phase) { marks.push_back({std::move(phase), events.size()}); }

void StepLog::clear() {
  events.clear();
  groups.clear();
  marks.clear();
  tasks.clear();
  issued_ = 0;
}

StepLogScope::StepLogScope(StepLog& log) : previous_(recording) { recording = &log; }
StepLogScope::~StepLogScope() { recording = previous_; }

}  // namespace zg
