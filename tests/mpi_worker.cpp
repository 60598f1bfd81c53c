// Launched by tests/test_mpi.cpp as `mpirun -n 2 mpi_worker OUT_DIR`: trains the
// ZeRO test run at every stage over the mpi group and writes rank 0's gathered
// weights to OUT_DIR/stage-S.safetensors for the test to compare with the local
// group. With `mismatch` as second argument, the ranks call different collectives.
#include <cstdio>

#include "dist/mpi_group.h"
#include "zero_training.h"

int main(int argc, char** argv) {
  using namespace zg;
  if (argc < 2) {
    std::fprintf(stderr, "usage: mpi_worker OUT_DIR [mismatch]\n");
    return 2;
  }
  int status = 0;
  try {
    dist::MpiGroup group;
    dist::ProcessGroup& pg = group;
    if (argc > 2 && std::string(argv[2]) == "mismatch") {
      Tensor t = zeros({4});
      if (pg.rank() == 0) pg.all_reduce(t);
      else pg.all_gather(zeros({2}), t);
    }
    for (int stage = 0; stage <= 3; ++stage) {
      const nn::NamedTensors weights = test::train_sharded(pg, {.dtype = DType::f32, .stage = stage, .steps = 3});
      if (pg.rank() == 0)
        save_safetensors(std::string(argv[1]) + "/stage-" + std::to_string(stage) + ".safetensors", weights);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    status = 1;
  }
  if (status == 0) dist::MpiGroup::finalize();
  return status;  // a failed rank exits without finalize: mpirun ends the job
}
