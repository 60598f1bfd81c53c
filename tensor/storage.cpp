#include "tensor/storage.h"

#include "tensor/error.h"

namespace zg {

Storage::Storage(std::shared_ptr<Allocator> allocator, int64_t bytes, MemoryCategory category)
    : allocator_(std::move(allocator)), bytes_(bytes), category_(category) {
  block_ = allocator_->allocate(bytes_, category_);
}

Storage::Storage(std::shared_ptr<Allocator> allocator, int64_t bytes, MemoryCategory category,
                 std::shared_ptr<const InitRecipe> recipe)
    : allocator_(std::move(allocator)), bytes_(bytes), category_(category), released_(true),
      recipe_(std::move(recipe)) {}

std::shared_ptr<Storage> Storage::deferred(std::shared_ptr<Allocator> allocator, int64_t bytes,
                                           std::shared_ptr<const InitRecipe> recipe) {
  return std::shared_ptr<Storage>(new Storage(std::move(allocator), bytes, MemoryScope::current(), std::move(recipe)));
}

std::shared_ptr<Storage> Storage::unallocated(std::shared_ptr<Allocator> allocator, int64_t bytes,
                                              MemoryCategory category) {
  return std::shared_ptr<Storage>(new Storage(std::move(allocator), bytes, category, nullptr));
}

Storage::~Storage() {
  if (!released_) allocator_->deallocate(block_);
}

void* Storage::data() const {
  ZG_CHECK(recipe_ == nullptr, "storage: the ", format_bytes(bytes_), " storage on ", device().str(),
           " is deferred (made under DeferredInit) and has no values yet; materialise its tensor first "
           "(zg::materialize, materialize_range, or nn::materialize for a model)");
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
  ZG_CHECK(recipe_ == nullptr, "storage: a deferred storage is materialised through its tensor (zg::materialize), "
           "which writes its values");
  block_ = allocator_->allocate(bytes_, category_);
  released_ = false;
}

}  // namespace zg
