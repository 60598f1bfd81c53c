// safetensors files (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON naming each tensor's dtype,
// shape and [begin, end) byte range, then the raw little-endian data. Files
// written here load in PyTorch and Hugging Face tools, and theirs load here.
//
// The reader treats a file as untrusted: the header length is bounded, every
// entry is checked (dtype, shape, size, range), ranges may neither overlap nor
// leave holes, and nothing is allocated before its size has been checked against
// the file. Any problem is a zg::Error naming the file, the tensor and the offsets.
//
// Checksums: the format has none, so files written here carry each tensor's CRC-32C
// (tensor/crc32c.h) in the metadata, as "crc32c/<tensor name>" = 8 hex digits, and every
// read of a tensor checks its bytes against it: a bit flipped on disk or in a copy is an
// error naming the tensor and its file offsets, not a silently wrong weight. Other tools
// ignore the entries; their files (without them) load unchecked. The entries are the
// reader's: metadata() leaves them out, and a save refuses metadata keys starting "crc32c/".
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace zg {

class AtomicFile;  // tensor/atomic_file.h
using Metadata = std::map<std::string, std::string>;

// Writes atomically: a temporary file in the same folder, fsync, rename over `path`,
// fsync of the folder. Tensors may live on any device with data (not meta), and are
// copied to host memory one at a time. First it removes what saves to `path` killed
// part-way left: temporaries ("<path>.tmp.<host>.<pid>.<n>") no writer holds locked.
// (A SafetensorsWriter over `tensors`' layout.)
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const Metadata& metadata = {});

// A safetensors file written a tensor at a time, for what is never in memory at once (a
// sharded model's consolidated export, gathered a unit at a time): the layout -- names,
// dtypes, shapes, so the header and every tensor's place -- is given first; write() then
// puts each tensor in its place, in any order, from any device; commit() checks that
// every one was written, fills in their checksums (the header kept room for them) and
// renames the file over `path` as save_safetensors does. Until commit() nothing is at
// `path`; a writer destroyed before it removes its temporary and leaves `path` as it was.
class SafetensorsWriter {
 public:
  struct Layout {
    std::string name;
    DType dtype;
    Shape shape;
  };
  // Checks the layout and metadata, creates the temporary and writes the header.
  SafetensorsWriter(std::string path, const std::vector<Layout>& tensors, const Metadata& metadata = {});
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  // `value` must have the dtype and shape `name` was laid out with, and each name is written once.
  void write(const std::string& name, const Tensor& value);
  void commit();

 private:
  struct Slot {
    DType dtype;
    Shape shape;
    int64_t begin = 0, nbytes = 0;  // in the data section
    std::optional<uint32_t> crc32c;  // set once written
  };
  std::string header() const;  // the JSON, padded; unwritten tensors' checksums as zeros (same length)

  std::string path_;
  std::unique_ptr<AtomicFile> file_;  // the temporary, renamed over path_ at commit
  Metadata metadata_;
  std::vector<std::pair<std::string, Slot>> slots_;  // in file order
  std::map<std::string, size_t> index_;              // name -> slot
  int64_t data_start_ = 0;
  bool committed_ = false;
};

// Numbers in metadata are text (the format's rule). parse_number reads all of `text`
// as a T (int64_t, uint64_t or double) and says whether it was one; metadata_number looks
// `key` up and parses it, or throws a zg::Error naming `who`, the file and the key.
template <class T>
bool parse_number(std::string_view text, T& out);
template <class T>
T metadata_number(const Metadata& metadata, const std::string& key, const std::string& path, const char* who);

class SafetensorsFile {
 public:
  struct Entry {
    DType dtype;
    Shape shape;
    int64_t begin, end;              // byte range within the data section
    std::optional<uint32_t> crc32c;  // the writer's checksum of those bytes, if it left one
  };

  // Reads and validates the header of the regular file at `path`. Tensor reads come from
  // the file the header described: one replaced since (a save renaming a new file over
  // `path`) is refused at the first read, and later reads keep to the file that read opened.
  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  const Metadata& metadata() const { return metadata_; }
  const std::vector<std::string>& names() const { return names_; }  // in file order
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const Entry& entry(const std::string& name) const;

  Tensor read(const std::string& name) const;  // a new CPU tensor, its checksum verified
  // Reads into an existing tensor of the same shape (any device); floating dtypes convert.
  void read_into(const std::string& name, const Tensor& destination) const;
  // Everything read_into checks (shape; dtype: the same or both floating; the bytes, as
  // verify does): call it for every tensor before reading any, so a load that fails
  // leaves every destination as it was. The file is read once here and once by the load.
  void check_readable_into(const std::string& name, const Tensor& destination) const;
  // Its checks but the shape: the tensor's dtype is `to` or both are floating, its values
  // stay finite when rounded to `to`, and its bytes verify (for a load that reads it in parts).
  void check_readable_as(const std::string& name, DType to) const;
  // Reads the tensor's bytes a block at a time (never the whole tensor in memory) and
  // checks them as read() does: the checksum, and that BOOL bytes are 0 or 1.
  void verify(const std::string& name) const;

 private:
  struct OpenFile;
  // read() and verify(): the checks of `size` bytes at tensor byte `at`, continuing `crc`;
  // then the checksum's comparison once every byte was seen.
  void check_bytes(const std::string& name, const Entry& e, const void* bytes, int64_t size, int64_t at,
                   uint32_t& crc) const;
  void check_checksum(const std::string& name, const Entry& e, uint32_t crc) const;
  std::string path_;
  std::shared_ptr<OpenFile> file_;
  int64_t data_start_ = 0;
  Metadata metadata_;
  std::vector<std::string> names_;
  std::map<std::string, Entry> entries_;
};

}  // namespace zg
