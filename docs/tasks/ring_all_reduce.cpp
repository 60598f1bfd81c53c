// Task 4 (docs/tasks/README.md): an all-reduce made of its two halves, as a ring runs it
// and as ZeRO splits it: a reduce-scatter (rank r ends with the sum of slice r) followed
// by an all-gather (every rank ends with every summed slice). Checked against the group's
// own all_reduce on 4 ranks (threads), value for value and byte for byte.
#include <cstdio>
#include <mutex>

#include "dist/comm/local_group.h"
#include "zerograd.h"

using namespace zg;

namespace {

// The sum over ranks of `x`, on every rank. The buffer is cut into N equal slices, so it
// is padded with zeros to a multiple of N first (as a ZeRO unit is); the padding is cut off after.
Tensor all_reduce_by_halves(dist::ProcessGroup& pg, const Tensor& x) {
  const int64_t n = pg.size(), numel = x.numel();
  const int64_t padded = (numel + n - 1) / n * n;
  Tensor full = zeros({padded}, x.dtype());
  full.narrow(0, 0, numel).copy_(x);
  const Tensor slice = empty({padded / n}, x.dtype());
  pg.reduce_scatter(full, slice);  // slice r of the sum
  pg.all_gather(slice, full);      // every slice of the sum
  return full.narrow(0, 0, numel).contiguous();
}

}  // namespace

int main() {
  constexpr int kRanks = 4;
  constexpr int64_t kNumel = 1001;  // not a multiple of 4: the padding shows in the bytes sent
  std::mutex print;
  bool all_equal = true;
  dist::run_local(kRanks, [&](dist::ProcessGroup& pg) {
    // Rank r's values: r + i / 8, exact in f32, so every order of summing gives the same bits.
    const Tensor x = (arange(kNumel, DType::f32) * 0.125 + static_cast<double>(pg.rank())).contiguous();

    const Tensor reference = x.clone();
    pg.reset_bytes_sent();
    pg.all_reduce(reference);
    const int64_t all_reduce_bytes = pg.bytes_sent();

    pg.reset_bytes_sent();
    const Tensor mine = all_reduce_by_halves(pg, x);
    const int64_t halves_bytes = pg.bytes_sent();

    const bool equal = sum(ne(mine, reference)).item<int64_t>() == 0;  // bool sums to i64
    std::lock_guard lock(print);
    all_equal = all_equal && equal;
    if (pg.rank() == 0)
      std::printf("N = %d, %lld f32 values: all_reduce sent %lld bytes, reduce_scatter + all_gather %lld; "
                  "sums %s\n",
                  kRanks, (long long)kNumel, (long long)all_reduce_bytes, (long long)halves_bytes,
                  equal ? "equal" : "differ");
  });
  return all_equal ? 0 : 1;
}
