// A Storage is one allocation: the bytes that views share. It can be released
// and re-materialised in place (ZeRO-3 frees a gathered unit after forward and
// gathers it again for backward), so views never cache a raw pointer: they ask
// data() at the moment of use, and a released storage throws instead of
// handing out freed memory. A deferred storage (tensor/deferred.h) was never
// allocated: it holds the recipe of its values instead, until its tensor is
// materialised into a storage of its own.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tensor/memory.h"

namespace zg {

struct InitRecipe;  // tensor/deferred.h

class Storage {
 public:
  Storage(std::shared_ptr<Allocator> allocator, int64_t bytes, MemoryCategory category);
  // A storage of `bytes` that allocates nothing and is counted nowhere: data() refuses it.
  static std::shared_ptr<Storage> deferred(std::shared_ptr<Allocator> allocator, int64_t bytes,
                                           std::shared_ptr<const InitRecipe> recipe);
  // A storage that starts released: its bytes are allocated (in `category`) at the first
  // materialize() -- a ZeRO-3 unit's full weights, which exist only once gathered.
  static std::shared_ptr<Storage> unallocated(std::shared_ptr<Allocator> allocator, int64_t bytes,
                                              MemoryCategory category);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // The bytes; throws if released. nullptr for meta storage and for 0 bytes.
  void* data() const;
  int64_t nbytes() const { return bytes_; }
  Device device() const { return allocator_->device(); }
  MemoryCategory category() const { return category_; }
  const std::shared_ptr<Allocator>& allocator() const { return allocator_; }

  // Bumped by every in-place write through the Tensor API; autograd compares it with
  // the value a saved tensor recorded, to catch modification before backward.
  uint64_t version() const { return version_; }
  void bump_version() { ++version_; }
  // Sets the version back to one read earlier: only for a write that restores the very
  // bytes saved tensors were saved with (ZeRO-3 gathering a unit's unchanged weights
  // again for backward; PyTorch's FSDP does the same).
  void restore_version(uint64_t version) { version_ = version; }

  // How a deferred storage's values are made; null for every other storage.
  const InitRecipe* recipe() const { return recipe_.get(); }
  bool is_released() const { return released_; }  // a deferred storage counts as released: it holds no bytes
  void release();      // gives the bytes back to the allocator; views stay valid objects
  void materialize();  // allocates again (contents undefined until written); refused when deferred
  // What data() adds to its error when the storage is released: who releases it, and
  // when it exists (ZeRO-3 names the unit and the uses it is gathered around).
  void set_release_note(std::string note) { release_note_ = std::move(note); }

 private:
  Storage(std::shared_ptr<Allocator> allocator, int64_t bytes, MemoryCategory category,
          std::shared_ptr<const InitRecipe> recipe);

  std::shared_ptr<Allocator> allocator_;  // kept alive: the bytes return to the rank that took them
  int64_t bytes_;
  MemoryCategory category_;
  Allocation block_;
  bool released_ = false;
  uint64_t version_ = 0;
  std::string release_note_;
  std::shared_ptr<const InitRecipe> recipe_;
};

}  // namespace zg
