// A map that keeps at most `capacity` entries, the least recently used going first to
// make room. Host-only, so its rule is tested without a GPU; the attention graph cache
// is built on it (a run whose shapes keep changing -- generation with a growing T --
// holds a bounded set of cuDNN graphs, not one for every shape it ever saw).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>

namespace zg::cuda {

template <class Key, class Value>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {}

  // The value for `key`, made by make() the first time. A make() that throws leaves
  // the cache as it was. Finding or making an entry counts as a use; the reference
  // holds until the next call (copy the value to keep it past an eviction).
  template <class Make>
  Value& get_or_make(const Key& key, Make&& make) {
    auto it = slots_.find(key);
    if (it == slots_.end()) {
      Value value = make();
      if (slots_.size() >= capacity_)  // evict the slot whose last use is oldest (n is small)
        slots_.erase(std::min_element(slots_.begin(), slots_.end(), [](const auto& a, const auto& b) {
          return a.second.last_use < b.second.last_use;
        }));
      it = slots_.emplace(key, Slot{std::move(value), 0}).first;
    }
    it->second.last_use = ++clock_;
    return it->second.value;
  }

  bool contains(const Key& key) const { return slots_.count(key) != 0; }
  size_t size() const { return slots_.size(); }

 private:
  struct Slot {
    Value value;
    uint64_t last_use;  // clock_ at the slot's latest get_or_make
  };
  size_t capacity_;
  std::map<Key, Slot> slots_;
  uint64_t clock_ = 0;
};

}  // namespace zg::cuda
