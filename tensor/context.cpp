#include "tensor/context.h"

#include <set>

#include "tensor/backend.h"
#include "tensor/cpu/cpu_backend.h"

namespace zg {

namespace {
// The contexts made for ranks, alive (a memory timeline notes what they hold as it begins).
std::mutex contexts_mutex;
std::set<Context*>& live_contexts() {
  static std::set<Context*> live;
  return live;
}
}  // namespace

Context::Context(int rank) : rank_(rank) {
  std::lock_guard lock(contexts_mutex);
  live_contexts().insert(this);
}

Context::~Context() {
  if (thread_default_) return;
  std::lock_guard lock(contexts_mutex);
  live_contexts().erase(this);
}

std::vector<std::shared_ptr<Allocator>> Context::rank_allocators() {
  std::lock_guard lock(contexts_mutex);
  std::vector<std::shared_ptr<Allocator>> all;
  for (Context* context : live_contexts())
    for (auto& allocator : context->allocators()) all.push_back(std::move(allocator));
  return all;
}

std::shared_ptr<Allocator> Context::allocator(Device device) {
  std::lock_guard lock(mutex_);
  auto& slot = allocators_[device];
  if (!slot) {
    slot = backend(device).make_allocator(device);
    slot->set_owner(rank_, false);
  }
  return slot;
}

void Context::set_allocator(Device device, std::shared_ptr<Allocator> allocator) {
  ZG_CHECK(allocator != nullptr && allocator->device() == device, "Context::set_allocator: the allocator given for ",
           device.str(), " is ", allocator ? "for " + allocator->device().str() : std::string("null"));
  std::lock_guard lock(mutex_);
  auto& slot = allocators_[device];
  ZG_CHECK(!slot, "Context::set_allocator: rank ", rank_, " already has an allocator for ", device.str(),
           " (install one before the first tensor on that device)");
  allocator->set_owner(rank_, false);
  slot = std::move(allocator);
}

std::shared_ptr<Allocator> Context::host_allocator(Device device) {
  ZG_CHECK(device.type != DeviceType::cuda, "host_allocator: the host pool holds host memory; ask for cpu (or meta, "
           "for a dry run's pool), not ", device.str());
  std::lock_guard lock(mutex_);
  auto& slot = host_allocators_[device];
  if (!slot && device.type == DeviceType::cpu) slot = make_pinned_allocator();
  if (!slot && device.type == DeviceType::cpu) slot = cpu::make_host_pool();
  if (!slot) slot = backend(device).make_allocator(device);
  slot->set_owner(rank_, true);
  return slot;
}

std::vector<std::shared_ptr<Allocator>> Context::allocators() {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<Allocator>> all;
  for (const auto* made : {&allocators_, &host_allocators_})
    for (const auto& [device, allocator] : *made) all.push_back(allocator);
  return all;
}

std::shared_ptr<void> Context::backend_state(Device device, const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard lock(mutex_);
  auto& slot = backend_states_[device];
  if (!slot) slot = make();
  return slot;
}

namespace {
thread_local Context* current_context = nullptr;
thread_local Generator* current_generator = nullptr;  // a GeneratorGuard's
}  // namespace

Context& Context::current() {
  if (current_context) return *current_context;
  thread_local Context thread_default{ThreadDefault{}};
  return thread_default;
}

ContextGuard::ContextGuard(Context& context) : previous_(current_context) { current_context = &context; }
ContextGuard::~ContextGuard() { current_context = previous_; }

Generator& Generator::current() { return current_generator ? *current_generator : Context::current().generator(); }

GeneratorGuard::GeneratorGuard(Generator& generator) : previous_(current_generator) { current_generator = &generator; }
GeneratorGuard::~GeneratorGuard() { current_generator = previous_; }

}  // namespace zg
