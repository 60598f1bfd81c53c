#include "tensor/backend.h"

#include <array>

namespace zg {

Backend& cpu_backend();   // tensor/cpu/backend.cpp
Backend& meta_backend();  // tensor/meta/backend.cpp

bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq && op <= BinaryOp::ge; }
bool is_logical(BinaryOp op) { return op == BinaryOp::logical_and || op == BinaryOp::logical_or; }

namespace {
// Written only while the library loads (static registration), read-only after.
std::array<Backend*, 3>& registry() {
  static std::array<Backend*, 3> backends{&cpu_backend(), nullptr, &meta_backend()};
  return backends;
}
}  // namespace

void register_backend(DeviceType type, Backend* backend) { registry()[static_cast<int>(type)] = backend; }

void Backend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, bool, double, const Tensor&, const Tensor&, const Tensor&) {
  throw Error("attention_backward: this backend has no fused attention (attention() returned false)");
}

Backend& backend(Device device) {
  Backend* b = registry()[static_cast<int>(device.type)];
  ZG_CHECK(b != nullptr, "device ", device.str(), ": this build of zerograd has no CUDA backend");
  return *b;
}

}  // namespace zg
