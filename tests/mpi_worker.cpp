// Launched by tests/test_mpi.cpp as `mpirun -n 2 mpi_worker OUT_DIR`: trains the
// ZeRO test run at every stage over the mpi group and writes rank 0's gathered
// weights to OUT_DIR/stage-S.safetensors for the test to compare with the local
// group. With `mismatch` as second argument, the ranks call different collectives;
// with `stall`, rank 1 never joins rank 0's all_reduce (it sleeps a minute), and rank 0,
// whose group times out after 2 s, fails and exits, so mpirun ends the job; with
// `huge`, both broadcast 2^31 bytes, one more than an MPI count holds.
#include <chrono>
#include <cstdio>
#include <thread>

#include "dist/comm/mpi_group.h"
#include "zero_training.h"

int main(int argc, char** argv) {
  using namespace zg;
  if (argc < 2) {
    std::fprintf(stderr, "usage: mpi_worker OUT_DIR [mismatch|stall|huge]\n");
    return 2;
  }
  const std::string mode = argc > 2 ? argv[2] : "";
  int status = 0;
  try {
    dist::MpiGroup group(mode == "stall" ? dist::MpiOptions{.timeout = std::chrono::seconds(2)} : dist::MpiOptions{});
    dist::ProcessGroup& pg = group;
    if (mode == "stall") {
      Tensor t = zeros({4});
      if (pg.rank() == 0) pg.all_reduce(t);
      else std::this_thread::sleep_for(std::chrono::minutes(1));
    }
    if (mode == "huge") pg.broadcast(empty({int64_t{1} << 31}, DType::boolean), 0);  // never written: not paged in
    if (mode == "mismatch") {
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
