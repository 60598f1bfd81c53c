#include "dist/zero/placement.h"

namespace zg::dist {

const char* name(Offload offload) {
  switch (offload) {
    case Offload::none: return "none";
    case Offload::optimizer: return "optimizer";
    case Offload::optimizer_and_params: return "optimizer+params";
  }
  return "?";
}

Offload parse_offload(std::string_view text) {
  for (Offload o : {Offload::none, Offload::optimizer, Offload::optimizer_and_params})
    if (text == name(o)) return o;
  fail("offload must be none, optimizer or optimizer+params, got '", text, "'");
}

}  // namespace zg::dist
