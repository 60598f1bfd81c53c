// Fuzz target: the bytes as a safetensors file. Opening it and reading every tensor
// (whole, into a tensor of its shape, and the dtype check of a load in parts) must
// either work or throw zg::Error; a crash, another exception, a leak or a hang is a bug.
#include "fuzz_support.h"

namespace {

// Everything a reader can do with one tensor; a bad one must not stop the next.
void read_tensor(const zg::SafetensorsFile& file, const std::string& name) {
  using namespace zg;
  try {
    const SafetensorsFile::Entry& entry = file.entry(name);
    const Tensor whole = file.read(name);
    const DType into = is_floating(entry.dtype) ? DType::f32 : entry.dtype;  // floating dtypes convert
    const Tensor destination = empty(entry.shape, TensorOptions(into));
    file.check_readable_into(name, destination);
    file.read_into(name, destination);
    file.check_readable_as(name, DType::bf16);
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path path = zg::fuzz::scratch_dir() / "input.safetensors";
  zg::fuzz::write_file(path, data, size);
  try {
    const zg::SafetensorsFile file(path.string());
    for (const auto& [key, value] : file.metadata()) {
      double number;
      zg::parse_number(value, number);
    }
    for (const std::string& name : file.names()) read_tensor(file, name);
  } catch (const zg::Error&) {
  }
  return 0;
}
