// ZeRO-Infinity's schedule over the file tier (offload nvme). A unit's state -- master
// weights, Adam m and v, the gradient shard -- lives in the file (tensor/file_tier.h) and
// comes into host memory only to be used: units are visited in order with unit k + 1's
// state read while unit k is used and unit k - 1's written back, so the host pool holds at
// most three units' state at any time:
//
//   read   k+1 ─────────── k+2 ─────────── ...
//   use         k ────────────── k+1 ───────────
//   write  k-1 ─────────── k ───────────── ...
//
// The backward writes each gradient shard as it is reduced (one write behind), and a
// ZeRO-3 gather reads its unit's parameter shard (the f32 master) for the cast up.
#pragma once

#include <functional>
#include <vector>

#include "dist/zero/unit.h"

namespace zg::dist {

// fn(u) on each unit in order with the state `use` reads in host memory; `updated`: fn
// wrote it (the update), so it is written back. Without a file tier, fn(u) alone.
void visit_paged(const std::vector<Unit*>& units, Unit::StateUse use, bool updated,
                 const std::function<void(size_t)>& fn);

// For each unit in order, with its state in host memory (one unit's at a time): fn(i) for
// the tensors[i] that view that unit's paged state (master, m, v), then after(u); the
// tensors no unit pages first, with none in. A checkpoint's save writes (and its load reads)
// the state this way, the host holding one unit of it, not all. `updated`: written back.
void visit_by_unit(const std::vector<Unit*>& units, const std::vector<Tensor>& tensors, bool updated,
                   const std::function<void(size_t)>& fn, const std::function<void(size_t)>& after = {});

// The units' state in host memory for the guard's life, written back at the end if
// `updated`.
class StateInHost {
 public:
  StateInHost(std::vector<Unit*> units, bool updated);
  ~StateInHost();
  StateInHost(const StateInHost&) = delete;
  StateInHost& operator=(const StateInHost&) = delete;

 private:
  std::vector<Unit*> units_;
  bool updated_;
};

}  // namespace zg::dist
