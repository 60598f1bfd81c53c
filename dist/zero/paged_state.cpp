#include "dist/zero/paged_state.h"

#include "dist/zero/buffers.h"

#include <map>

namespace zg::dist {

// The initial state goes to the file: the master weights written (and waited for: a unit
// at a time), m, v and the gradient shard marked zeros, which no write needs.
void Unit::page_out_state() {
  if (!ctx_.file_tier) return;
  const std::string unit = "unit '" + spec_.name + "' ";
  paged_.reset(new PagedState{PagedTensor(ctx_.file_tier, master_, unit + "master weights"),
                              PagedTensor(ctx_.file_tier, m_, unit + "Adam m"),
                              PagedTensor(ctx_.file_tier, v_, unit + "Adam v"),
                              PagedTensor(ctx_.file_tier, grad_shard_, unit + "gradient shard")});
  for (PagedTensor* zeros : {&paged_->m, &paged_->v, &paged_->grad}) zeros->mark_zero();
  for (PagedTensor* p : paged(StateUse::update)) p->page_out(false);  // the master: its first write
  settle_state();
}

std::vector<PagedTensor*> Unit::paged(StateUse use) const {
  if (!paged_) return {};
  if (use == StateUse::gradient) return {&paged_->grad};
  return {&paged_->master, &paged_->m, &paged_->v, &paged_->grad};
}

void Unit::fetch_state(StateUse use) {
  for (PagedTensor* p : paged(use)) p->page_in();
}

void Unit::await_state() {
  for (PagedTensor* p : paged(StateUse::update)) p->wait();
}

void Unit::store_state(StateUse use, bool updated) {
  for (PagedTensor* p : paged(use)) p->page_out(updated && p != &paged_->grad);  // AdamW reads the gradient only
}

void Unit::settle_state() {
  for (PagedTensor* p : paged(StateUse::update)) p->settle(true);
}

// ZeRO-3's shard, up to the device in the compute dtype for its all-gather; paged in from
// the file for the cast when it lives there (and not already in host memory).
Tensor Unit::shard_to_gather(const Weights& w) {
  const bool page = paged_ && w.shard.is_same(master_) && paged_->master.state() != PagedTensor::State::in;
  if (page) {
    paged_->master.page_in();
    paged_->master.wait();
  }
  Tensor up = moved(w.shard, ctx_.device, ctx_.compute_dtype);
  if (page && up.is_same(w.shard)) {  // (f32 on the cpu: the gather reads it after the page-out)
    MemoryScope scope(MemoryCategory::communication);
    up = up.clone();
  }
  if (page) paged_->master.page_out(false);
  return up;
}

// Offloaded gradients land in the host's shard: copied (ZeRO-1's running sum) or added
// (ZeRO-2, 3's micro-batches). In the file tier the shard is paged in for it and written behind.
void Unit::into_gradient_shard(const Tensor& reduced, bool add) {
  if (paged_) {
    paged_->grad.page_in();
    paged_->grad.wait();
  }
  if (add) {
    backend(grad_shard_.device())
        .binary(BinaryOp::add, grad_shard_, moved(reduced, grad_shard_.device(), grad_shard_.dtype()), grad_shard_);
  } else {
    cast_into(reduced, grad_shard_);
  }
  if (paged_) paged_->grad.page_out_behind();
}

void Unit::zero_gradient_shard() {
  if (paged_) {
    paged_->grad.mark_zero();
  } else {
    grad_shard_.zero_();
  }
}

void visit_paged(const std::vector<Unit*>& units, Unit::StateUse use, bool updated,
                 const std::function<void(size_t)>& fn) {
  if (!units.empty()) units.front()->fetch_state(use);
  for (size_t u = 0; u < units.size(); ++u) {
    if (u + 1 < units.size()) units[u + 1]->fetch_state(use);  // read ahead
    units[u]->await_state();
    fn(u);
    units[u]->store_state(use, updated);                 // written behind
    if (u > 0) units[u - 1]->settle_state();             // three units at most in host memory
  }
  if (!units.empty()) units.back()->settle_state();
}

void visit_by_unit(const std::vector<Unit*>& units, const std::vector<Tensor>& tensors, bool updated,
                   const std::function<void(size_t)>& fn, const std::function<void(size_t)>& after) {
  std::map<const Storage*, size_t> owner;  // a paged state tensor's storage -> its unit
  for (size_t u = 0; u < units.size(); ++u)
    if (units[u]->pages_state())
      for (const Tensor* t : {&units[u]->master(), &units[u]->exp_avg(), &units[u]->exp_avg_sq()})
        owner.emplace(t->storage().get(), u);
  std::vector<std::vector<size_t>> of_unit(units.size() + 1);  // [0]: no unit's
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto it = tensors[i].defined() ? owner.find(tensors[i].storage().get()) : owner.end();
    of_unit[it == owner.end() ? 0 : it->second + 1].push_back(i);
  }
  for (size_t i : of_unit[0]) fn(i);
  for (size_t u = 0; u < units.size(); ++u) {
    if (of_unit[u + 1].empty() && !after) continue;  // nothing to do with its state
    const StateInHost resident({units[u]}, updated);
    for (size_t i : of_unit[u + 1]) fn(i);
    if (after) after(u);
  }
}

StateInHost::StateInHost(std::vector<Unit*> units, bool updated) : units_(std::move(units)), updated_(updated) {
  for (Unit* unit : units_) unit->fetch_state(Unit::StateUse::update);
  for (Unit* unit : units_) unit->await_state();
}

// A write that fails leaves its values in host memory (paged in), not lost: the next
// visit writes them again, and throws if it fails again.
StateInHost::~StateInHost() {
  try {
    for (Unit* unit : units_) unit->store_state(Unit::StateUse::update, updated_);
    for (Unit* unit : units_) unit->settle_state();
  } catch (const Error&) {
  }
}

}  // namespace zg::dist
