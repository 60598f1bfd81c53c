// Launched by tests/test_mpi.cpp as `mpirun -n 2 mpi_worker OUT_DIR`: trains the
// ZeRO test run at every stage over the mpi group and writes rank 0's gathered
// weights to OUT_DIR/stage-S.safetensors for the test to compare with the local
// group. With `mismatch` as second argument, the ranks call different collectives;
// with `stall`, rank 1 never joins rank 0's all_reduce (it sleeps a minute), and rank 0,
// whose group times out after 2 s, fails and exits, so mpirun ends the job; with
// `huge`, both broadcast 2^31 bytes, one more than an MPI count holds; with `throw`,
// rank 1 throws while rank 0 waits for it; with `damaged`, a sharded load meets a
// damaged byte in rank 1's file; with `p2p`, messages go round a ring, cross in a batch,
// and a large one waits while its receiver is in a collective (prints "p2p ok"); with
// `p2p_mismatch`, rank 0 sends f32[4] where rank 1 receives f32[8].
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "dist/comm/device_mesh.h"
#include "dist/comm/mpi_group.h"
#include "zero_training.h"

int main(int argc, char** argv) {
  using namespace zg;
  if (argc < 2) {
    std::fprintf(stderr, "usage: mpi_worker OUT_DIR [mismatch|stall|huge|throw|damaged|p2p|p2p_mismatch]\n");
    return 2;
  }
  const std::string mode = argc > 2 ? argv[2] : "", out = argv[1];
  const auto options = mode == "stall" ? dist::MpiOptions{.timeout = std::chrono::seconds(2)} : dist::MpiOptions{};
  const int status = dist::run_mpi(
        [&](dist::ProcessGroup& pg) {
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
          if (mode == "throw") {  // the last rank fails while the others wait in collectives (timeout: 5 minutes)
            const int last = pg.size() - 1;
            // At N = 4 they wait in hybrid sharding's sub-groups: 1 for 3 across groups, 0 and 2 for 1 and 3 within.
            const std::unique_ptr<dist::DeviceMesh> mesh =
                pg.size() == 4 ? std::make_unique<dist::DeviceMesh>(pg, std::vector<dist::MeshDim>{{"dp_replicate", 2}, {"dp_shard", 2}})
                               : nullptr;
            Tensor t = zeros({4});
            if (pg.rank() == last) {
              std::this_thread::sleep_for(std::chrono::milliseconds(500));
              const auto now = std::chrono::steady_clock::now().time_since_epoch();  // CLOCK_MONOTONIC: one clock for all processes
              std::fprintf(stderr, "throws at %lld ns\n",
                           static_cast<long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()));
              fail("rank ", last, "'s data loader found no more data");
            }
            if (mesh) {
              mesh->group("dp_replicate").all_reduce(t);
              mesh->group("dp_shard").all_reduce(t);
            } else {
              pg.all_reduce(t);
            }
          }
          if (mode == "p2p") {
            const int n = pg.size(), r = pg.rank(), next = (r + 1) % n, previous = (r + n - 1) % n;
            const Tensor got = zeros({3});
            dist::WorkHandle sent = pg.send_async(full({3}, 1.0 + r), next, 1);
            pg.recv(got, previous, 1);
            sent->wait();
            ZG_CHECK(got.to_vector<float>() == std::vector<float>(3, 1.0f + previous), "ring: wrong values");
            const Tensor crossed = zeros({2}, DType::f64);
            pg.batch_async({{dist::P2POp::send, full({2}, 10.0 + r, DType::f64), r ^ 1, 2},
                            {dist::P2POp::recv, crossed, r ^ 1, 2}})->wait();
            ZG_CHECK(crossed.to_vector<double>() == std::vector<double>(2, 10.0 + (r ^ 1)), "batch: wrong values");
            // 4 MB (past eager sends): rank 1 takes it while it waits in an all-reduce rank 0 joins only after.
            const Tensor big = r == 0 ? arange(0, 1 << 20, 1, DType::f32) : zeros({1 << 20});
            Tensor one = ones({1});
            if (r == 0) {
              pg.send(big, 1, 3);
              pg.all_reduce(one);
            } else if (r == 1) {
              dist::WorkHandle arriving = pg.recv_async(big, 0, 3);
              pg.all_reduce(one);
              arriving->wait();
              ZG_CHECK(big.to_vector<float>() == arange(0, 1 << 20, 1, DType::f32).to_vector<float>(), "big: wrong values");
            } else {
              pg.all_reduce(one);
            }
            if (r == 0) std::printf("p2p ok\n");
          }
          if (mode == "p2p_mismatch") {
            if (pg.rank() == 0) pg.send(zeros({4}), 1, 1);
            if (pg.rank() == 1) pg.recv(zeros({8}), 0, 1);
          }
          if (mode == "damaged") {  // a load whose rank 1 meets a damaged byte: every rank refuses it
            manual_seed(1);
            nn::GPT model(test::zero_config());
            dist::ShardedModel sharded(model, pg, {.stage = 1, .compute_dtype = DType::f32});
            const std::string dir = out + "/damaged";
            sharded.save(dir);
            if (pg.rank() == 0) {
              const std::string file = dist::ShardedModel::current_save(dir) + "/rank-00001-of-00002.safetensors";
              std::fstream bytes(file, std::ios::in | std::ios::out | std::ios::binary);
              bytes.seekg(-1, std::ios::end);
              const char last = static_cast<char>(bytes.get() ^ 0xff);
              bytes.seekp(-1, std::ios::end);
              bytes.put(last);
            }
            pg.barrier();
            sharded.load(dir);
          }
          for (int stage = 0; stage <= 3 && mode.empty(); ++stage) {
            const nn::NamedTensors weights = test::train_sharded(pg, {.dtype = DType::f32, .stage = stage, .steps = 3});
            if (pg.rank() == 0) save_safetensors(out + "/stage-" + std::to_string(stage) + ".safetensors", weights);
          }
        },
        options);  // an error: printed, sent to the other rank, exit status 1 (mpirun then ends the job)
  if (mode == "throw")  // when this process ends, on the clock of the throw above (mpirun's own teardown comes after)
    std::fprintf(stderr, "exits at %lld ns\n", static_cast<long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                   std::chrono::steady_clock::now().time_since_epoch()).count()));
  return status;
}
