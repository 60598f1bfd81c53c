// The gradient reducer: the scheduler that decides when each bucket's gradients are
// averaged across ranks (Unit::reduce_gradients says how), started from
// post-accumulate-grad hooks while the backward goes on.
//
// Ranks must issue their collectives in one order, but buckets can fill in different
// orders on different ranks: a parameter only some ranks' forward used fills its bucket
// there, and elsewhere never. So, as in PyTorch DDP, a full bucket waits for the buckets
// before it in a fixed order, and the backward's end reduces every bucket still waiting,
// in that order -- with zeros for gradients that never came. ZeRO-3 instead reduces a
// unit when its gather scheduler says the unit's backward is done (reduce_unit).
//   At most two reductions are in flight, so a unit's collective overlaps the next
// unit's backward while at most two unit gradients wait; all have finished when the
// backward ends.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "dist/zero/unit.h"

namespace zg::dist {

class GradientReducer {
 public:
  // Plans buckets (DDP: about bucket_bytes each; ZeRO: one per unit), their collective
  // tags (after the units' own), and the fixed order, from `parameters`' registration order.
  GradientReducer(const Placement& placement, std::vector<Unit*> units, const nn::NamedTensors& parameters,
                  int64_t bucket_bytes, DType reduce_dtype);

  // Hooks each parameter: DDP and ZeRO-1, 2 count arrivals (ZeRO-2, 3 also allocate the
  // unit's full gradient before the first lands). `on_backward_end` runs once at the end
  // of every backward pass that produced a gradient, after every reduction finished.
  void hook(std::weak_ptr<ParameterOwner> alive, std::function<void()> on_backward_end);

  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  void reduce_unit(Unit& unit);           // ZeRO-3: the unit's backward is done
  void finish(size_t keep_in_flight = 0);  // waits for the oldest until at most that many remain
  // Called on this thread as each unit's reduction ends (its gradient shard final); null: none.
  void set_on_reduced(std::function<void(Unit&)> fn) { on_reduced_ = std::move(fn); }
  void reduce_the_rest();                 // of this backward's buckets, in the fixed order
  // step() may not run on gradients that were never reduced (sync off for the last backward).
  bool unsynced() const { return unsynced_; }
  int64_t backwards() const { return backwards_; }  // passes that produced a gradient, ever
  void zero_grad();
  // The bucket tags in reduction order, hashed into `order` (every rank must agree).
  std::vector<int64_t> order_tags() const;

 private:
  // A range [begin, end) of a unit's flat gradient, full once the gradients of its
  // `members` parameters have all landed. DDP cuts a unit into buckets of about
  // bucket_bytes; the ZeRO stages use one bucket per unit.
  struct Bucket {
    Unit* unit = nullptr;
    int64_t begin = 0, end = 0;
    size_t members = 0;
    size_t arrived = 0;    // members whose gradient landed in this backward
    bool reduced = false;  // in this backward
    int64_t tag = 0;       // its reduction's CollectiveTag: the unit's, or (DDP) one of its own
  };
  void plan_buckets(Unit& unit, int64_t cap, int64_t& next_tag);
  void note_backward();  // queues the backward's end, once per pass
  void on_grad_arrival(size_t bucket);
  void reduce(Bucket& bucket);

  const Placement placement_;
  std::vector<Unit*> units_;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<size_t>> bucket_of_;  // per unit, per entry: its bucket in buckets_
  std::vector<size_t> order_;                   // every bucket, in the one order all ranks use
  size_t reduced_ = 0;                          // the first `reduced_` of order_ are done
  std::deque<InFlight> in_flight_;
  bool in_backward_ = false;  // a gradient has landed since the last backward's end
  int64_t backwards_ = 0;
  std::weak_ptr<void> end_queued_;  // live while this backward's end is queued
  std::weak_ptr<ParameterOwner> alive_;
  std::function<void()> on_backward_end_;
  std::function<void(Unit&)> on_reduced_;
  bool sync_ = true;
  bool unsynced_ = false;  // the last backward kept its gradients local (sync off)
};

}  // namespace zg::dist
