#include "tensor/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <mutex>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "tensor/atomic_file.h"
#include "tensor/checks.h"
#include "tensor/crc32c.h"

namespace zg {

namespace {

constexpr int64_t kMaxHeaderBytes = 100 << 20;  // the limit the reference implementation uses
constexpr std::string_view kChecksumPrefix = "crc32c/";  // metadata key of a tensor's CRC-32C

std::string hex8(uint32_t value) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", value);
  return text;
}

const char* format_name(DType dtype) {
  switch (dtype) {
    case DType::f64: return "F64";
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::i64: return "I64";
    case DType::i32: return "I32";
    case DType::i8: return "I8";
    case DType::boolean: return "BOOL";
  }
  return "?";
}

bool parse_dtype(const std::string& s, DType& out) {
  for (DType d : {DType::f64, DType::f32, DType::f16, DType::bf16, DType::i64, DType::i32, DType::i8, DType::boolean})
    if (s == format_name(d)) {
      out = d;
      return true;
    }
  return false;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const Metadata& metadata) {
  std::vector<SafetensorsWriter::Layout> layout;
  for (const auto& [name, t] : tensors) {
    ZG_CHECK(t.defined(), "save_safetensors: '", name, "' is an undefined tensor");
    layout.push_back({name, t.dtype(), t.shape()});
  }
  SafetensorsWriter file(path, layout, metadata);
  for (const auto& [name, t] : tensors) file.write(name, t);
  file.commit();
}

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<Layout>& tensors, const Metadata& metadata)
    : path_(std::move(path)), metadata_(metadata) {
  for (const auto& [key, value] : metadata)
    ZG_CHECK(!key.starts_with(kChecksumPrefix), "save_safetensors: ", path_, ": metadata key '", key,
             "' starts with '", kChecksumPrefix, "', which names the checksums the file gets anyway");
  int64_t offset = 0;
  for (const Layout& t : tensors) {
    ZG_CHECK(t.name != "__metadata__" && !index_.contains(t.name), "save_safetensors: ", path_,
             ": duplicate or reserved name '", t.name, "'");
    const int64_t nbytes = numel(t.shape) * element_size(t.dtype);
    index_[t.name] = slots_.size();
    slots_.push_back({t.name, Slot{t.dtype, t.shape, offset, nbytes, std::nullopt}});
    offset += nbytes;
  }
  const std::string json = header();
  data_start_ = 8 + static_cast<int64_t>(json.size());

  file_ = std::make_unique<AtomicFile>(path_, "save_safetensors");
  const uint64_t length = json.size();
  char length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  file_->write_at(length_bytes, 8, 0);
  file_->write_at(json.data(), json.size(), 8);
}

SafetensorsWriter::~SafetensorsWriter() = default;

std::string SafetensorsWriter::header() const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = metadata_;
  for (const auto& [name, slot] : slots_) {
    header["__metadata__"][std::string(kChecksumPrefix) + name] = hex8(slot.crc32c.value_or(0));
    header[name] = {{"dtype", format_name(slot.dtype)},
                    {"shape", slot.shape},
                    {"data_offsets", {slot.begin, slot.begin + slot.nbytes}}};
  }
  if (header["__metadata__"].empty()) header.erase("__metadata__");
  std::string json;
  try {
    json = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("save_safetensors: ", path_,
         ": a tensor name or metadata entry is not valid UTF-8, which the JSON header needs (", e.what(), ")");
  }
  json.append((8 - json.size() % 8) % 8, ' ');  // pad so the data starts 8-byte aligned
  return json;
}

void SafetensorsWriter::write(const std::string& name, const Tensor& value) {
  ZG_CHECK(!committed_, "save_safetensors: ", path_, ": '", name, "' written after the file was committed");
  const auto it = index_.find(name);
  ZG_CHECK(it != index_.end(), "save_safetensors: ", path_, ": '", name, "' is not in the file's layout");
  Slot& slot = slots_[it->second].second;
  ZG_CHECK(!slot.crc32c, "save_safetensors: ", path_, ": '", name, "' written twice");
  ZG_CHECK(value.defined() && value.dtype() == slot.dtype && value.shape() == slot.shape, "save_safetensors: ", path_,
           ": '", name, "' was laid out as ", zg::name(slot.dtype), shape_str(slot.shape), ", written as ",
           value.defined() ? std::string(zg::name(value.dtype())) + shape_str(value.shape()) : "an undefined tensor");
  // Detached: the copy to the host records no graph. Throws for meta tensors: they have no data.
  const Tensor host = value.detach().to(kCPU).contiguous();
  const auto* bytes = static_cast<const char*>(host.data_ptr());
  file_->write_at(bytes, static_cast<size_t>(slot.nbytes), data_start_ + slot.begin);
  slot.crc32c = crc32c(bytes, static_cast<size_t>(slot.nbytes));
}

void SafetensorsWriter::commit() {
  ZG_CHECK(!committed_, "save_safetensors: ", path_, " was committed already");
  for (const auto& [name, slot] : slots_)
    ZG_CHECK(slot.crc32c, "save_safetensors: ", path_, ": '", name, "' was laid out but never written");
  const std::string json = header();  // the checksums in place of the zeros: the same length
  ZG_CHECK(8 + static_cast<int64_t>(json.size()) == data_start_, "save_safetensors: ", path_,
           ": the header changed length with its checksums (an internal error)");
  file_->write_at(json.data(), json.size(), 8);
  file_->commit();
  committed_ = true;
}

// The file behind a SafetensorsFile. The header is read through a descriptor closed
// right after (a sharded load plans over every rank's file: N descriptors per rank
// would run out at large N). The first tensor read opens the file again and keeps that
// descriptor, after checking it is the very file the header came from: a save that
// renamed a new file over the path in between is an error, not the new file's bytes at
// the old offsets, and from then on reads come from one file whatever happens to the path.
struct SafetensorsFile::OpenFile {
  struct Identity {
    dev_t device;
    ino_t inode;
    off_t size;
    timespec modified;
    bool operator==(const Identity& o) const {
      return device == o.device && inode == o.inode && size == o.size && modified.tv_sec == o.modified.tv_sec &&
             modified.tv_nsec == o.modified.tv_nsec;
    }
  };
  Identity identity{};
  std::mutex mutex;  // guards fd's opening; pread itself is safe from several threads
  int fd = -1;

  ~OpenFile() {
    if (fd >= 0) ::close(fd);
  }

  // A regular file opened for reading (without blocking: a FIFO would wait for a writer),
  // or a zg::Error naming it. Its identity goes to `info`.
  static int open_regular(const std::string& path, struct stat& info) {
    const std::string where = "safetensors " + path + ": ";
    // Refused by its type before any open (opening a device node can have effects), and
    // again after (it may have been replaced in between).
    const auto check_type = [&] {
      ZG_CHECK(S_ISREG(info.st_mode), where, "not a regular file (", file_kind(info.st_mode), ")");
    };
    if (::stat(path.c_str(), &info) == 0) check_type();
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    ZG_CHECK(fd >= 0, where, "cannot open the file: ", errno_text());
    const bool stat_ok = ::fstat(fd, &info) == 0;
    const std::string stat_error = stat_ok ? "" : errno_text();
    if (!stat_ok || !S_ISREG(info.st_mode)) {
      ::close(fd);
      ZG_CHECK(stat_ok, where, "cannot stat the file: ", stat_error);
      check_type();
    }
    return fd;
  }
  static Identity identity_of(const struct stat& info) {
    return {info.st_dev, info.st_ino, info.st_size, info.st_mtim};
  }

  // The descriptor for tensor reads, opened the first time (see above).
  int reading(const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex);
    if (fd >= 0) return fd;
    struct stat info {};
    const int opened = open_regular(path, info);
    if (!(identity_of(info) == identity)) {
      ::close(opened);
      fail("safetensors ", path, ": the file changed after its header was read (another save replaced it); load again");
    }
    fd = opened;
    return fd;
  }

  // `size` bytes at `offset` of `from`, or a zg::Error saying why not.
  static void read_at(int from, void* into, int64_t size, int64_t offset, const std::string& what) {
    auto* out = static_cast<char*>(into);
    while (size > 0) {
      const ssize_t n = ::pread(from, out, static_cast<size_t>(size), offset);
      if (n < 0 && errno == EINTR) continue;
      ZG_CHECK(n > 0, what, n == 0 ? " failed: the file ends first (was it truncated?)" : " failed: ", n == 0 ? "" : errno_text());
      out += n, size -= n, offset += n;
    }
  }
};

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)), file_(std::make_shared<OpenFile>()) {
  const std::string where = "safetensors " + path_ + ": ";
  struct stat info {};
  const int fd = OpenFile::open_regular(path_, info);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  file_->identity = OpenFile::identity_of(info);
  const int64_t file_size = static_cast<int64_t>(info.st_size);
  ZG_CHECK(file_size >= 8, where, "the file is ", file_size, " bytes, shorter than its 8-byte header length");
  unsigned char length_bytes[8];
  OpenFile::read_at(fd, length_bytes, 8, 0, where + "reading the 8-byte header length");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | length_bytes[i];
  ZG_CHECK(length <= static_cast<uint64_t>(kMaxHeaderBytes), where, "header length ", length,
           " (bytes 0-7) is over the 100 MiB limit");
  ZG_CHECK(static_cast<int64_t>(length) <= file_size - 8, where, "header length ", length,
           " (bytes 0-7) runs past the end of the file (", file_size, " bytes)");
  std::string json(length, '\0');
  OpenFile::read_at(fd, json.data(), static_cast<int64_t>(length), 8,
                    where + "reading the " + std::to_string(length) + "-byte header");
  data_start_ = 8 + static_cast<int64_t>(length);
  const int64_t data_size = file_size - data_start_;

  // Parse, refusing duplicate names (a JSON parser would silently keep the last one) and
  // nesting deeper than the format's header -> entry -> array: a hostile header nested a
  // million deep would otherwise overflow the stack wherever a value is printed.
  constexpr int kMaxDepth = 4;
  std::vector<std::string> top_keys;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(json, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& value) {
      ZG_CHECK(depth <= kMaxDepth, where, "the header (bytes 8-", 8 + length, ") nests deeper than ", kMaxDepth,
               " levels: not a safetensors header");
      if (depth == 1 && event == nlohmann::json::parse_event_t::key) top_keys.push_back(value.get<std::string>());
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    fail(where, "the header (bytes 8-", 8 + length, ") is not valid JSON: ", e.what());
  }
  ZG_CHECK(header.is_object(), where, "the header is not a JSON object");
  std::vector<std::string> sorted_keys = top_keys;
  std::sort(sorted_keys.begin(), sorted_keys.end());
  const auto dup = std::adjacent_find(sorted_keys.begin(), sorted_keys.end());
  ZG_CHECK(dup == sorted_keys.end(), where, "the header names '", dup == sorted_keys.end() ? "" : *dup, "' twice");

  std::map<std::string, uint32_t> checksums;  // by tensor name
  for (const std::string& name : top_keys) {
    const nlohmann::json& value = header.at(name);
    if (name == "__metadata__") {
      ZG_CHECK(value.is_object(), where, "__metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        ZG_CHECK(v.is_string(), where, "__metadata__ value of '", k, "' is not a string");
        const std::string text = v.get<std::string>();
        if (!k.starts_with(kChecksumPrefix)) {
          metadata_[k] = text;
          continue;
        }
        uint32_t crc = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), crc, 16);
        ZG_CHECK(text.size() == 8 && ec == std::errc() && end == text.data() + text.size(), where, "metadata '", k,
                 "' = '", text, "' is not a CRC-32C (8 hex digits)");
        checksums[k.substr(kChecksumPrefix.size())] = crc;
      }
      continue;
    }
    const std::string what = where + "tensor '" + name + "': ";
    ZG_CHECK(value.is_object() && value.size() == 3 && value.contains("dtype") && value.contains("shape") &&
                 value.contains("data_offsets"),
             what, "expected exactly dtype, shape and data_offsets");
    Entry e{};
    ZG_CHECK(value["dtype"].is_string() && parse_dtype(value["dtype"].get<std::string>(), e.dtype), what,
             "unsupported dtype ", value["dtype"].dump());
    ZG_CHECK(value["shape"].is_array(), what, "shape is not an array");
    // The product of the non-zero sizes must fit (zg::numel's rule: a zero size empties a
    // tensor, but its strides and the other sizes still have to be counted).
    int64_t extent = element_size(e.dtype);
    bool empty = false;
    for (const auto& dim : value["shape"]) {
      ZG_CHECK(dim.is_number_unsigned(), what, "shape ", value["shape"].dump(), " has a non-integer or negative size");
      const uint64_t d = dim.get<uint64_t>();
      ZG_CHECK(d <= static_cast<uint64_t>(INT64_MAX) &&
                   (d == 0 || !__builtin_mul_overflow(extent, static_cast<int64_t>(d), &extent)),
               what, "shape ", value["shape"].dump(), " is too large");
      empty = empty || d == 0;
      e.shape.push_back(static_cast<int64_t>(d));
    }
    const int64_t bytes = empty ? 0 : extent;
    const auto& offsets = value["data_offsets"];
    ZG_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                 offsets[1].is_number_unsigned(),
             what, "data_offsets ", offsets.dump(), " is not a pair of non-negative integers");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    ZG_CHECK(begin <= end && end <= static_cast<uint64_t>(data_size), what, "data_offsets [", begin, ", ", end,
             "] do not lie within the ", data_size, "-byte data section (file offsets ", data_start_, "-", file_size,
             ")");
    e.begin = static_cast<int64_t>(begin);
    e.end = static_cast<int64_t>(end);
    ZG_CHECK(e.end - e.begin == bytes, what, "shape ", shape_str(e.shape), " of ", format_name(e.dtype), " needs ",
             bytes, " bytes but data_offsets [", begin, ", ", end, "] hold ", e.end - e.begin);
    names_.push_back(name);
    entries_[name] = e;
  }

  // The ranges must tile the data section exactly: no overlap, no hole, nothing after.
  std::vector<std::pair<int64_t, std::string>> order;
  for (const auto& [name, e] : entries_) order.emplace_back(e.begin, name);
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : entries_[a.second].end < entries_[b.second].end;
  });
  int64_t expected = 0;
  std::string previous = "the start of the data";
  for (const auto& [begin, name] : order) {
    const Entry& e = entries_[name];
    ZG_CHECK(begin >= expected, where, "tensors '", previous, "' and '", name, "' overlap (bytes ", begin, "-",
             expected, " of the data)");
    ZG_CHECK(begin == expected, where, "bytes ", expected, "-", begin, " of the data, after ", previous,
             ", belong to no tensor");
    expected = e.end;
    previous = name;
  }
  ZG_CHECK(expected == data_size, where, "the data section has ", data_size - expected,
           " bytes after the last tensor");
  for (const auto& [name, crc] : checksums) {
    const auto it = entries_.find(name);
    ZG_CHECK(it != entries_.end(), where, "metadata '", kChecksumPrefix, name, "' is the checksum of a tensor the file does not have");
    it->second.crc32c = crc;
  }
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  ZG_CHECK(it != entries_.end(), "safetensors ", path_, ": no tensor named '", name, "'");
  return it->second;
}

// The checks of a tensor's bytes, over them in order a block at a time: BOOL bytes are 0
// or 1, and the CRC-32C (continued in `crc`) is compared by the caller at the end.
void SafetensorsFile::check_bytes(const std::string& name, const Entry& e, const void* bytes, int64_t size,
                                  int64_t at, uint32_t& crc) const {
  crc = crc32c(bytes, static_cast<size_t>(size), crc);
  if (e.dtype != DType::boolean) return;
  // A bool is one byte holding 0 or 1; any other byte would be a bool the kernels cannot
  // represent (it compares unequal to both true and false).
  const auto* b = static_cast<const uint8_t*>(bytes);
  for (int64_t i = 0; i < size; ++i)
    ZG_CHECK(b[i] <= 1, "safetensors ", path_, ": tensor '", name, "' is BOOL but the byte at file offset ",
             data_start_ + e.begin + at + i, " is ", int{b[i]}, " (a BOOL byte must be 0 or 1)");
}

void SafetensorsFile::check_checksum(const std::string& name, const Entry& e, uint32_t crc) const {
  if (!e.crc32c) return;
  ZG_CHECK(crc == *e.crc32c, "safetensors ", path_, ": tensor '", name, "' (file bytes ", data_start_ + e.begin, "-",
           data_start_ + e.end, ") fails its checksum: CRC-32C ", hex8(crc), ", the file records ", hex8(*e.crc32c),
           " -- the bytes changed after they were written (a damaged disk or copy)");
}

Tensor SafetensorsFile::read(const std::string& name) const {
  const Entry& e = entry(name);
  Tensor t = empty(e.shape, e.dtype);
  if (e.end > e.begin)
    OpenFile::read_at(file_->reading(path_), t.data_ptr(), e.end - e.begin, data_start_ + e.begin,
                      "safetensors " + path_ + ": tensor '" + name + "': reading bytes " +
                          std::to_string(data_start_ + e.begin) + "-" + std::to_string(data_start_ + e.end));
  uint32_t crc = 0;
  check_bytes(name, e, t.data_ptr(), e.end - e.begin, 0, crc);
  check_checksum(name, e, crc);
  return t;
}

void SafetensorsFile::verify(const std::string& name) const {
  const Entry& e = entry(name);
  constexpr int64_t kBlock = 1 << 20;  // streamed: a verify holds one block, not the tensor
  std::vector<char> block(static_cast<size_t>(std::min(kBlock, e.end - e.begin)));
  uint32_t crc = 0;
  for (int64_t at = 0; at < e.end - e.begin; at += kBlock) {
    const int64_t size = std::min(kBlock, e.end - e.begin - at);
    OpenFile::read_at(file_->reading(path_), block.data(), size, data_start_ + e.begin + at,
                      "safetensors " + path_ + ": tensor '" + name + "': reading bytes " +
                          std::to_string(data_start_ + e.begin + at) + "-" +
                          std::to_string(data_start_ + e.begin + at + size));
    check_bytes(name, e, block.data(), size, at, crc);
  }
  check_checksum(name, e, crc);
}

void SafetensorsFile::read_into(const std::string& name, const Tensor& destination) const {
  check_readable_into(name, destination);
  destination.detach().copy_(read(name));  // a parameter's data, written as under NoGradGuard
}

void SafetensorsFile::check_readable_into(const std::string& name, const Tensor& destination) const {
  // What copy_ would refuse, refused here too, so a load checks every destination before
  // it overwrites any.
  const std::string into = "safetensors " + path_ + ": loading '" + name + "' into";
  detail::check_no_broadcast_dims(into.c_str(), "destination", destination);
  ZG_CHECK(!destination.storage()->is_released(), into, " ", describe(destination),
           ": its storage is released (a ZeRO-3 parameter holds only a shard; load through the ShardedModel)");
  const Entry& e = entry(name);
  ZG_CHECK(e.shape == destination.shape(), "safetensors ", path_, ": tensor '", name, "' has shape ",
           shape_str(e.shape), ", expected ", shape_str(destination.shape()));
  check_readable_as(name, destination.dtype());
}

void SafetensorsFile::check_readable_as(const std::string& name, DType to) const {
  const Entry& e = entry(name);
  ZG_CHECK(e.dtype == to || (is_floating(e.dtype) && is_floating(to)), "safetensors ", path_, ": tensor '", name,
           "' is ", format_name(e.dtype), ", expected ", format_name(to));
  // Into a dtype of narrower range (f16; f32 or bf16 from f64), a value past its largest
  // would load as inf: the data is read once more here, so a load refuses it before
  // overwriting anything.
  const bool narrower = (to == DType::f16 && e.dtype != DType::f16) ||
                        ((to == DType::f32 || to == DType::bf16) && e.dtype == DType::f64);
  if (!narrower) return verify(name);
  const Tensor source = read(name);  // verified as it is read
  const auto infinities = [](const Tensor& t) {
    const std::vector<double> values = t.to_vector<double>();
    return std::count_if(values.begin(), values.end(), [](double v) { return std::isinf(v); });
  };
  ZG_CHECK(infinities(source.to(to)) == infinities(source), "safetensors ", path_, ": tensor '", name, "' (",
           format_name(e.dtype), ") holds values beyond the range of ", format_name(to), ", which would load as inf");
}

template <class T>
bool parse_number(std::string_view text, T& out) {
  // The whole text, no space or sign prefix; for floats a finite value (from_chars
  // refuses one that overflows, and inf and nan are refused here).
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (ec != std::errc() || text.empty() || end != text.data() + text.size()) return false;
  if constexpr (std::is_floating_point_v<T>) return std::isfinite(out);
  return true;
}

template <class T>
T metadata_number(const Metadata& metadata, const std::string& key, const std::string& path, const char* who) {
  const auto it = metadata.find(key);
  ZG_CHECK(it != metadata.end(), who, ": ", path, " has no '", key, "' in its metadata");
  T value{};
  ZG_CHECK(parse_number(it->second, value), who, ": ", path, ": metadata '", key, "' = '", it->second, "' is not ",
           std::is_floating_point_v<T> ? "a finite number" : std::is_signed_v<T> ? "an integer" : "a non-negative integer");
  return value;
}

#define ZG_INSTANTIATE(T)                                  \
  template bool parse_number<T>(std::string_view, T&);     \
  template T metadata_number<T>(const Metadata&, const std::string&, const std::string&, const char*);
ZG_INSTANTIATE(int64_t)
ZG_INSTANTIATE(uint64_t)
ZG_INSTANTIATE(double)
#undef ZG_INSTANTIATE

}  // namespace zg
