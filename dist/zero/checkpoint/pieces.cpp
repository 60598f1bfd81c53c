#include "dist/zero/checkpoint/pieces.h"

#include <algorithm>
#include <string_view>

namespace zg::dist::checkpoint {

namespace {

// A unit range [begin, end) and where unit element `local_base` sits in the local buffers.
struct Owned {
  int64_t begin, end, local_base;
};
// What a rank writes: its slice r (with full optimizer state -- DDP -- slice r of its full
// buffers, so ranks share the work).
Owned saved_range(const UnitRoles& unit, int rank, bool full_state) {
  const int64_t begin = rank * unit.shard, end = std::min(begin + unit.shard, unit.numel);
  return {begin, std::max(begin, end), full_state ? 0 : begin};
}
// What a rank must read: everything where the optimizer state is full, else its slice.
Owned loaded_range(const UnitRoles& unit, int rank, bool full_state) {
  if (full_state) return {0, unit.numel, 0};
  return saved_range(unit, rank, full_state);
}

// The parts of every role of every trained parameter that overlaps `own`.
void add_trained_parts(const UnitRoles& unit, const Owned& own, std::vector<Part>& parts) {
  const std::pair<const char*, const Tensor*> roles[] = {
      {"master", &unit.master}, {"exp_avg", &unit.m}, {"exp_avg_sq", &unit.v}};
  for (const ParamSlot& e : unit.entries) {
    const int64_t a = std::max(own.begin, e.offset), b = std::min(own.end, e.offset + numel(e.shape));
    if (b <= a) continue;
    for (const auto& [role, buffer] : roles)
      parts.push_back({std::string(role) + "/" + e.name, e.shape, a - e.offset,
                       buffer->narrow(0, a - own.local_base, b - a), {}, {}});
  }
}

// ZeRO-3: rank r's slice of the unit's frozen buffer, cut at parameter boundaries.
void add_frozen_parts(const UnitRoles& unit, int r, std::vector<Part>& parts) {
  if (!unit.frozen.defined()) return;
  const int64_t begin = r * unit.frozen.numel(), end = begin + unit.frozen.numel();
  for (const ParamSlot& e : unit.frozen_entries) {
    const int64_t a = std::max(begin, e.offset), b = std::min(end, e.offset + numel(e.shape));
    if (a < b)
      parts.push_back({std::string(kFrozenKey) + e.name, e.shape, a - e.offset, unit.frozen.narrow(0, a - begin, b - a), {}, {}});
  }
}

}  // namespace

std::vector<Part> parts_of(const std::vector<UnitRoles>& units, const nn::NamedTensors& replicated, int r,
                           bool full_state, bool saving) {
  std::vector<Part> parts;
  for (const UnitRoles& unit : units) {
    add_trained_parts(unit, saving ? saved_range(unit, r, full_state) : loaded_range(unit, r, full_state), parts);
    add_frozen_parts(unit, r, parts);
  }
  if (saving && r != 0) return parts;
  for (const auto& [key, t] : replicated)
    if (key.starts_with(kFrozenKey))
      parts.push_back({key, t.shape(), 0, t.reshape({-1}), t.is_contiguous() ? Tensor() : t, {}});
  return parts;
}

std::string piece_name(const Part& part) { return part.key + "/" + std::to_string(part.begin); }

PieceName parse_piece_name(const std::string& name, bool frozen_role, const SafetensorsFile& file,
                           const std::string& tensor) {
  PieceName piece;
  const size_t last = name.rfind('/'), first = name.find('/');
  ZG_CHECK(first != last && last != std::string::npos &&
               parse_number(std::string_view(name).substr(last + 1), piece.begin) && piece.begin >= 0,
           kLoad, ": ", file.path(), ": tensor '", tensor, "' is not named <role>/<parameter>/<first element>");
  piece.role = name.substr(0, first), piece.parameter = name.substr(first + 1, last - first - 1);
  const std::string& role = piece.role;
  ZG_CHECK(role == "master" || role == "exp_avg" || role == "exp_avg_sq" || (role == "frozen" && frozen_role), kLoad,
           ": ", file.path(), ": tensor '", tensor, "' has no role master, exp_avg, exp_avg_sq",
           frozen_role ? " or frozen" : "");
  return piece;
}

}  // namespace zg::dist::checkpoint
