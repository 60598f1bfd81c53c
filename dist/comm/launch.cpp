#include "dist/comm/launch.h"

#include <cstdlib>
#include <initializer_list>

namespace zg::dist {

bool launched_as_rank() {
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(variable) != nullptr) return true;
  return false;
}

int launched_world_size() {
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"})
    if (const char* value = std::getenv(variable)) return std::atoi(value);
  return 1;
}

int node_local_rank(int fallback) {
  for (const char* variable : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* value = std::getenv(variable)) return std::atoi(value);
  return fallback;
}

}  // namespace zg::dist
