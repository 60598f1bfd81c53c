// What the MpiGroups of one process share (mpi_group.cpp), and the point-to-point
// messages they have posted (mpi_p2p.cpp). Private to the mpi group: not installed.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/comm/process_group.h"

namespace zg::dist {

// One posted send or receive. Both ends first exchange their calls' signatures (a send's
// on kSendHeaderTag, a receive's on kRecvHeaderTag, so a pair's k-th header meets the
// other's k-th); each compares them, and only a matching pair moves its bytes
// (kDataTag). A mismatch so ends both ends, each naming both calls, with nothing in flight.
struct MpiMessage {
  enum class Phase : uint8_t { headers, data, done };
  Collective call;  // holds the buffer until done
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;       // this end's rank in comm
  int64_t index = 0;  // its place among the messages between the two ends, this way
  std::string what;   // "send(f32[4] on cpu, to rank 1, tag 3) (message #0)"
  Collective::Signature mine{}, theirs{};
  MPI_Request requests[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};  // header out, header in, data
  Phase phase = Phase::headers;
  std::string error;  // a mismatch, once done
};

// MPI runs MPI_THREAD_SERIALIZED: the groups' workers, their messages and fail_others take
// turns under `mpi`.
struct MpiProcess {
  std::mutex mpi;
  std::string broken;    // why the groups are unusable (a timeout, a failure); "" while they work; under mpi
  int notified_by = -1;  // the rank (of MPI_COMM_WORLD) whose failure notice this one received; under mpi
  std::string notice;    // what it said
  std::chrono::steady_clock::time_point noticed;  // when it arrived
  MPI_Comm notices = MPI_COMM_NULL;  // failure notices, over every rank of MPI_COMM_WORLD
  int rank = 0, size = 1;            // in MPI_COMM_WORLD
  // Messages posted by any group of the process and not yet done; under mpi. Every poll
  // for anything advances them all (progress_messages), so a rank waiting in a
  // collective still takes the messages sent to it.
  std::vector<std::shared_ptr<MpiMessage>> messages;
};

// Throws a zg::Error naming `call` and MPI's reason unless `status` is MPI_SUCCESS.
void check_mpi(int status, const char* call);

// Under `mpi`: moves each posted message on (headers compared, bytes posted, done).
void progress_messages(MpiProcess& process);

}  // namespace zg::dist
