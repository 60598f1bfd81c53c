// Process groups: the collectives every strategy is built from, behind one
// interface. Implementations: `local` (ranks as threads of one process, data moved
// through shared memory; tests and single-machine runs) and `fake` (one rank that
// believes it is one of N: moves nothing, counts everything; for memory planning
// at large N on the meta device). `mpi` and `nccl` plug in the same way.
//
// Every collective is counted the way a ring implementation moves data, per rank:
//   all_reduce      2 (N-1)/N x bytes of the buffer
//   reduce_scatter    (N-1)/N x bytes of the full (input) buffer
//   all_gather        (N-1)/N x bytes of the full (output) buffer
//   broadcast         (N-1)/N x bytes (a pipelined ring)
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tensor/tensor.h"

namespace zg::dist {

enum class ReduceKind : uint8_t { sum, average, max };

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string kind() const = 0;  // "local", "fake", ...

  // In place on every rank; buffers must match in dtype and numel across ranks.
  virtual void all_reduce(const Tensor& buffer, ReduceKind op = ReduceKind::sum) = 0;
  // input [N * S] on every rank -> output [S]: the reduction of every rank's slice `rank`.
  // output may be input's own slice (in place).
  virtual void reduce_scatter(const Tensor& input, const Tensor& output, ReduceKind op = ReduceKind::sum) = 0;
  // input [S] on every rank -> output [N * S], rank q's input in slice q. input may be output's own slice.
  virtual void all_gather(const Tensor& input, const Tensor& output) = 0;
  virtual void broadcast(const Tensor& buffer, int root) = 0;
  virtual void barrier() = 0;

  // Bytes this rank has sent (ring model above), since construction or reset.
  int64_t bytes_sent() const { return bytes_sent_; }
  void reset_bytes_sent() { bytes_sent_ = 0; }

 protected:
  void count_ring(double fraction_of_buffer, int64_t buffer_bytes) {
    bytes_sent_ += static_cast<int64_t>(fraction_of_buffer * static_cast<double>(buffer_bytes) + 0.5);
  }
  int64_t bytes_sent_ = 0;
};

}  // namespace zg::dist
