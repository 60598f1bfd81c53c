// One writer per checkpoint folder. Two jobs saving into one folder destroy each other's
// saves: each save removes every save folder `latest` does not name, the other job's save
// in progress included. A CheckpointWriterLock claims the folder for one job: it is an
// advisory flock on DIR/writer.lock, taken by rank 0's process and held while any holder
// in that process lives. The kernel drops it when the process exits or is killed
// (SIGKILL included), so a dead job leaves nothing held; the file stays, naming the last
// holder, and is not part of any save.
//
//   dist::CheckpointWriterLock writer(group, device, "ckpt");  // at the start of the job
//   ... train, sharded.save("ckpt") as often as wanted ...
//
// A job that holds one for its whole life is refused at its start when the folder is
// another job's, or cannot be written -- not at its first save, after hours of training.
// ShardedModel::save takes one for the save's duration by itself (shared with the job's
// where the process holds one), so a save never runs beside another job's.
//
// flock works across hosts on NFS (Linux emulates it with fcntl locks there, served by the
// NFS lock manager); on a filesystem without working locks, taking it fails and says so.
#pragma once

#include <memory>
#include <string>

#include "dist/comm/process_group.h"

namespace zg::dist {

class CheckpointWriterLock {
 public:
  // A collective: every rank of `group` calls it with the same `dir`. Rank 0 creates `dir`
  // (and its parents) and takes the lock, then writes "pid P on host H since T" into
  // DIR/writer.lock. Holds in one process share the lock (the ranks of a local group, two
  // models of one job). Where `dir` cannot be written, or another process holds it, every
  // rank throws the same zg::Error, opened by `who`: "checkpoint folder DIR is being
  // written by pid P on host H since T; save into another folder, or stop that job first".
  // `device`: where the ranks agree (the model's device).
  CheckpointWriterLock(ProcessGroup& group, Device device, const std::string& dir,
                       const std::string& who = "CheckpointWriterLock");

 private:
  std::shared_ptr<const void> held_;  // rank 0's hold (released with the last in its process); null elsewhere
};

}  // namespace zg::dist
