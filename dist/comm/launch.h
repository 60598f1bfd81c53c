// How this process was launched: by mpirun or srun as one rank of several (then
// dist::run_mpi runs it as one rank of the mpi group), and its place among the ranks
// on its node, which picks its GPU (rank r of a node on cuda:r).
#pragma once

namespace zg::dist {

// Whether a launcher started this process as one rank of several: OpenMPI's mpirun
// (OMPI_COMM_WORLD_SIZE), MPICH / Intel MPI (PMI_SIZE), srun and PMIx launchers (PMIX_RANK).
bool launched_as_rank();
// How many ranks the launcher started (OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS), or 1.
int launched_world_size();
// This process's rank among those of its node (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
// SLURM_LOCALID), or `fallback` (its global rank: one node) where no launcher says.
int node_local_rank(int fallback);

}  // namespace zg::dist
