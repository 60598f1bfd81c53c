#include "dist/zero/checkpoint/roles.h"

namespace zg::dist::checkpoint {

UnitRoles roles_of(const Unit& unit) {
  return {.name = unit.name,
          .tag = unit.tag,
          .entries = unit.entries,
          .frozen_entries = unit.frozen_entries,
          .numel = unit.numel,
          .shard = unit.shard,
          .master = unit.master,
          .m = unit.m,
          .v = unit.v,
          .frozen = unit.frozen.shard};
}

}  // namespace zg::dist::checkpoint
