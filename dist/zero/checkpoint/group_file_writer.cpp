#include "dist/zero/checkpoint/group_file_writer.h"

#include <utility>

#include "dist/comm/agreement.h"

namespace zg::dist::checkpoint {

GroupFileWriter::GroupFileWriter(ProcessGroup& group, Device device, std::string who, bool writes_here,
                                 const std::string& path, const std::vector<SafetensorsWriter::Layout>& layout,
                                 const Metadata& meta)
    : group_(group), device_(device), who_(std::move(who)) {
  all_or_none(group_, device_, who_, path + " was not written", [&] {
    if (writes_here) file_.emplace(path, layout, meta);
  });
}

void GroupFileWriter::write(const std::string& name, const Tensor& value) {
  if (!file_ || failed_) return;
  try {
    file_->write(name, value);
  } catch (...) {
    failed_ = std::current_exception();
  }
}

void GroupFileWriter::commit(const std::string& consequence) {
  all_or_none(group_, device_, who_, consequence, [&] {
    if (failed_) std::rethrow_exception(failed_);
    if (file_) file_->commit();
  });
}

}  // namespace zg::dist::checkpoint
