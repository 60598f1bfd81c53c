// Where a tensor's bytes live: the CPU, a CUDA GPU, or nowhere (meta: shapes
// and counted bytes only, so memory can be planned for models larger than RAM).
#pragma once

#include <compare>
#include <ostream>
#include <string>
#include <string_view>

namespace zg {

enum class DeviceType : uint8_t { cpu, cuda, meta };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // which GPU; always 0 for cpu and meta

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}  // NOLINT: implicit
  // Parses "cpu", "meta", "cuda", "cuda:N"; throws zg::Error on anything else.
  Device(std::string_view spec);  // NOLINT: implicit, so t.to("cuda:0") reads naturally
  Device(const char* spec) : Device(std::string_view(spec)) {}  // NOLINT

  std::string str() const;  // "cpu", "cuda:1", "meta"
  auto operator<=>(const Device&) const = default;
};

inline constexpr Device kCPU{DeviceType::cpu};
inline constexpr Device kMeta{DeviceType::meta};
inline constexpr Device kCUDA{DeviceType::cuda, 0};  // cuda:0; Device(DeviceType::cuda, i) for others

std::ostream& operator<<(std::ostream& os, const Device& device);

}  // namespace zg
