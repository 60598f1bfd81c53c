// A safetensors file that some ranks write while every rank takes part in the
// collectives that feed it (gathers, a unit at a time). It is opened on every rank that
// writes one, or on none (all_or_none). A write that fails is kept, not thrown, so its
// rank goes on through the gathers the others wait in; commit() raises it on every rank
// (the others' error says a rank failed), or commits every rank's file.
#pragma once

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "dist/comm/process_group.h"
#include "tensor/safetensors.h"

namespace zg::dist::checkpoint {

class GroupFileWriter {
 public:
  // `who` names the operation in errors; `writes_here`: whether this rank writes a file.
  GroupFileWriter(ProcessGroup& group, Device device, std::string who, bool writes_here, const std::string& path,
                  const std::vector<SafetensorsWriter::Layout>& layout, const Metadata& meta);
  void write(const std::string& name, const Tensor& value);
  // `consequence`: what a failure on any rank means, for the error.
  void commit(const std::string& consequence);

 private:
  ProcessGroup& group_;
  Device device_;
  std::string who_;
  std::optional<SafetensorsWriter> file_;
  std::exception_ptr failed_;
};

}  // namespace zg::dist::checkpoint
