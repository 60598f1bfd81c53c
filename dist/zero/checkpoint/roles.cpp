#include "dist/zero/checkpoint/roles.h"

namespace zg::dist::checkpoint {

UnitRoles roles_of(const Unit& unit) {
  return {.name = unit.name(),
          .tag = unit.tag(),
          .entries = unit.entries(),
          .frozen_entries = unit.frozen_entries(),
          .numel = unit.numel(),
          .shard = unit.shard(),
          .master = unit.master(),
          .m = unit.exp_avg(),
          .v = unit.exp_avg_sq(),
          .frozen = unit.frozen_shard()};
}

}  // namespace zg::dist::checkpoint
