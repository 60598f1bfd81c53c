#include "dist/zero/placement.h"

namespace zg::dist {

const char* name(Offload offload) {
  switch (offload) {
    case Offload::none: return "none";
    case Offload::optimizer: return "optimizer";
    case Offload::optimizer_and_params: return "optimizer+params";
    case Offload::nvme: return "nvme";
  }
  return "?";
}

Offload parse_offload(std::string_view text) {
  for (Offload o : {Offload::none, Offload::optimizer, Offload::optimizer_and_params, Offload::nvme})
    if (text == name(o)) return o;
  fail("offload must be none, optimizer, optimizer+params or nvme, got '", text, "'");
}

std::string Placement::problem(int stage, Offload offload) {
  if (stage < 0 || stage > 3) return "ShardedModel: stage must be 0, 1, 2 or 3, got " + std::to_string(stage);
  if (offload != Offload::none && stage < 1)
    return std::string("ShardedModel: offload ") + dist::name(offload) +
           " needs the optimizer state sharded: stage 1, 2 or 3 (at one rank they hold what DDP holds)";
  if (offload == Offload::optimizer_and_params && stage != 3)
    return "ShardedModel: offload optimizer+params needs stage 3, where parameters are sharded; stage " +
           std::to_string(stage) + " keeps them whole on the device (offload optimizer moves the rest)";
  return "";
}

}  // namespace zg::dist
