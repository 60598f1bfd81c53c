// Point-to-point messages of the mpi group: how a pair meets is in mpi_process.h.
#include <mpi.h>

#include <climits>

#include "dist/comm/mpi_group.h"
#include "dist/comm/mpi_process.h"

namespace zg::dist {

namespace {

// Beside mpi_group.cpp's tags 1-3 (failure notices, the call check). A message's bytes
// carry its index (mod kDataTags): two messages to one peer whose headers arrive out of
// order post their bytes out of order, and must not take each other's (an all-to-all's
// values and scales; MPI_TAG_UB is at least 32767).
constexpr int kSendHeaderTag = 4, kRecvHeaderTag = 5, kDataTag = 6, kDataTags = 16384;

// Under the lock: both headers in -> compared, and a matching pair's bytes posted; the
// bytes moved -> done.
void advance(MpiMessage& m) {
  using Phase = MpiMessage::Phase;
  const bool sending = m.call.op == CollectiveOp::send;
  const int peer = m.call.root;
  if (m.phase == Phase::headers) {
    int done = 0;
    check_mpi(MPI_Testall(2, m.requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall (message headers)");
    if (!done) return;
    m.error = Collective::p2p_mismatch(sending ? m.mine : m.theirs, sending ? m.theirs : m.mine,
                                       sending ? m.rank : peer, sending ? peer : m.rank, m.index, "mpi group");
    if (!m.error.empty()) {
      m.phase = Phase::done;
      return;
    }
    const int bytes = static_cast<int>(m.call.input.nbytes());  // at most INT_MAX: checked when posted
    void* data = m.call.input.data_ptr();
    const int tag = kDataTag + static_cast<int>(m.index % kDataTags);
    check_mpi(sending ? MPI_Isend(data, bytes, MPI_BYTE, peer, tag, m.comm, &m.requests[2])
                      : MPI_Irecv(data, bytes, MPI_BYTE, peer, tag, m.comm, &m.requests[2]),
              sending ? "MPI_Isend (message data)" : "MPI_Irecv (message data)");
    m.phase = Phase::data;
  }
  int done = 0;
  check_mpi(MPI_Test(&m.requests[2], &done, MPI_STATUS_IGNORE), "MPI_Test (message data)");
  if (done) m.phase = Phase::done;
}

}  // namespace

void progress_messages(MpiProcess& p) {
  for (const auto& m : p.messages) advance(*m);
  std::erase_if(p.messages, [](const auto& m) { return m->phase == MpiMessage::Phase::done; });
}

class MpiGroup::MessageWork final : public Work {
 public:
  MessageWork(MpiGroup& group, std::shared_ptr<MpiMessage> message)
      : group_(group, "mpi group: a message's Work outlived its group"), message_(std::move(message)) {}

  // Waiting polls every posted message of the process (MpiGroup::polls), this one among them.
  void wait() override {
    auto& group = static_cast<MpiGroup&>(*group_);
    MpiMessage& m = *message_;
    if (!group.polls([&] { return m.phase == MpiMessage::Phase::done; }, m.what, message_))
      group.give_up("mpi group: rank " + std::to_string(m.rank) + "'s " + m.what + " did not finish within " +
                        std::to_string(group.timeout_.count()) + " ms: rank " + std::to_string(m.call.root) +
                        " has not posted the matching " + (m.call.op == CollectiveOp::send ? "receive" : "send") +
                        " (missing, failed or stuck). MPI cannot cancel it, so the group is unusable: end the process",
                    message_);
    if (!m.error.empty()) throw Error(m.error);
  }
  bool completed() const override {
    auto& group = static_cast<MpiGroup&>(*group_);
    std::lock_guard<std::mutex> lock(group.process_->mpi);
    if (group.process_->broken.empty()) progress_messages(*group.process_);
    return message_->phase == MpiMessage::Phase::done;
  }

 private:
  GroupRef group_;
  std::shared_ptr<MpiMessage> message_;
};

// Each message posts its header and the receive of its partner's at once; the rest
// happens as anything on the process polls.
std::vector<WorkHandle> MpiGroup::issue_p2p(std::vector<Collective> messages) {
  for (const Collective& c : messages)
    ZG_CHECK(c.input.nbytes() <= INT_MAX, "mpi group: ", c.describe(), " moves ", c.input.nbytes(),
             " bytes, over MPI's count limit of 2^31 - 1; send it in pieces");
  messages_to_.resize(static_cast<size_t>(size_)), messages_from_.resize(static_cast<size_t>(size_));
  std::vector<WorkHandle> works;
  std::lock_guard<std::mutex> lock(process_->mpi);
  ZG_CHECK(process_->broken.empty(), process_->broken, " (refusing ", messages.front().describe(), ")");
  for (Collective& c : messages) {
    auto m = std::make_shared<MpiMessage>();
    const bool sending = c.op == CollectiveOp::send;
    const int peer = c.root;
    m->comm = MPI_Comm_f2c(comm_);
    m->rank = rank_;
    m->index = (sending ? messages_to_ : messages_from_)[static_cast<size_t>(peer)]++;
    m->what = c.describe() + " (message #" + std::to_string(m->index) + ")";
    m->mine = c.signature();
    m->call = std::move(c);
    const int n = static_cast<int>(m->mine.size());
    check_mpi(MPI_Isend(m->mine.data(), n, MPI_INT64_T, peer, sending ? kSendHeaderTag : kRecvHeaderTag, m->comm,
                        &m->requests[0]),
              "MPI_Isend (message header)");
    check_mpi(MPI_Irecv(m->theirs.data(), n, MPI_INT64_T, peer, sending ? kRecvHeaderTag : kSendHeaderTag, m->comm,
                        &m->requests[1]),
              "MPI_Irecv (message header)");
    process_->messages.push_back(m);
    works.push_back(std::make_shared<MessageWork>(*this, m));
  }
  return works;
}

}  // namespace zg::dist
