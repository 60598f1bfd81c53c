// Agreements between ranks, built from one small collective each: that every rank
// passed the same values (a different lr on one rank would make the replicas drift
// apart unnoticed), and that a step either succeeded everywhere or failed everywhere
// (so no rank waits in a collective that another, having thrown, will never issue).
#pragma once

#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dist/comm/process_group.h"

namespace zg::dist {

// Where the small agreements run: on the model's device (meta, which has no values: the
// CPU), or on the CPU for a group that takes host tensors only (mpi).
Device agreement_device(const ProcessGroup& group, Device model_device);

// Runs fn on this rank, then every rank learns whether it threw on any: where it did,
// its error is rethrown (with " (<consequence>)" unless that is empty); elsewhere
// "<who>: rank q failed: <q's message>; <consequence>", q the lowest rank that threw.
void all_or_none(ProcessGroup& group, Device device, const std::string& who, const std::string& consequence,
                 const std::function<void()>& fn);

// An enum's value, carried as a double, by its name (zg::name(DType), name(Offload), ...).
template <class Enum>
std::string name_of_enum(double value) {
  return name(static_cast<Enum>(value));
}

// One value every rank must give alike, as a double; an enum is shown by its name in the
// error ("from f32 to bf16", not "from 1 to 3"), a number by its shortest decimal.
struct AgreedValue {
  template <class Value>
  AgreedValue(std::string name, Value value) : name(std::move(name)), value(static_cast<double>(value)) {
    if constexpr (std::is_enum_v<Value>) show = &name_of_enum<Value>;
  }
  std::string name;
  double value;
  std::string (*show)(double) = nullptr;
};

// Values every rank must give alike. A max-reduction of [x, -x] gives every rank the
// largest and the smallest of each -- the same figures on all, so all refuse together,
// before anything changes.
class Agreement {
 public:
  // Issues the reduction (asynchronous: other work may overlap it).
  Agreement(ProcessGroup& group, Device on, const std::vector<AgreedValue>& values);
  // Waits, and throws "<who> a different <name> on some ranks (from <least> to <most>);
  // every rank must pass the same" for the first value that differs.
  void check(const std::string& who);

 private:
  std::vector<AgreedValue> values_;
  Tensor bounds_;
  WorkHandle work_;
};

// FNV-1a, cut to 53 bits: a double holds it exactly, so an Agreement can compare it.
class Hash53 {
 public:
  void mix(const void* data, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) hash_ = (hash_ ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ull;
  }
  void mix_name_and_shape(const std::string& name, const Shape& shape);
  double value() const { return static_cast<double>(hash_ & ((uint64_t{1} << 53) - 1)); }

 private:
  uint64_t hash_ = 14695981039346656037ull;
};

}  // namespace zg::dist
