#include "tensor/device.h"

#include <charconv>

#include "tensor/error.h"

namespace zg {

Device::Device(std::string_view spec) {
  if (spec == "cpu") { type = DeviceType::cpu; return; }
  if (spec == "meta") { type = DeviceType::meta; return; }
  if (spec.starts_with("cuda")) {
    type = DeviceType::cuda;
    if (spec.size() == 4) return;
    const std::string_view number = spec.substr(4);
    if (number.size() > 1 && number[0] == ':') {
      const char* first = number.data() + 1;
      const char* last = number.data() + number.size();
      auto [end, ec] = std::from_chars(first, last, index);
      if (ec == std::errc() && end == last && index >= 0) return;
    }
  }
  fail("device: cannot parse '", spec, "' (expected cpu, meta, cuda or cuda:N)");
}

std::string Device::str() const {
  switch (type) {
    case DeviceType::cpu: return "cpu";
    case DeviceType::meta: return "meta";
    case DeviceType::cuda: return "cuda:" + std::to_string(index);
  }
  return "?";
}

std::ostream& operator<<(std::ostream& os, const Device& device) { return os << device.str(); }

}  // namespace zg
