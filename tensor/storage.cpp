#include "tensor/storage.h"

#include "tensor/error.h"

namespace zg {

Storage::Storage(std::shared_ptr<Allocator> allocator, int64_t bytes, MemoryCategory category)
    : allocator_(std::move(allocator)), bytes_(bytes), category_(category) {
  block_ = allocator_->allocate(bytes_, category_);
}

Storage::~Storage() {
  if (!released_) allocator_->deallocate(block_);
}

void* Storage::data() const {
  ZG_CHECK(!released_, "storage: the ", format_bytes(bytes_), " ", name(category_), " storage on ", device().str(),
           " was released", release_note_.empty() ? "" : " (", release_note_, release_note_.empty() ? "" : ")",
           "; materialize it (e.g. all-gather the unit) before use");
  return block_.ptr;
}

void Storage::release() {
  if (released_) return;
  allocator_->deallocate(block_);
  block_.ptr = nullptr;
  released_ = true;
}

void Storage::materialize() {
  if (!released_) return;
  block_ = allocator_->allocate(bytes_, category_);
  released_ = false;
}

}  // namespace zg
