#include "tensor/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace zg {

namespace {

// table[b] = the CRC register after shifting byte b through it (reflected, LSB first).
constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int bit = 0; bit < 8; ++bit) r = (r >> 1) ^ ((r & 1) ? 0x82F63B78u : 0u);
    table[b] = r;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

// The register form: no initial or final inversion (crc32c() applies them).
uint32_t update_portable(const unsigned char* p, size_t n, uint32_t r) {
  for (; n > 0; --n) r = kTable[(r ^ *p++) & 0xff] ^ (r >> 8);
  return r;
}

#if defined(__x86_64__)
// SSE4.2's crc32 instruction is this polynomial: 8 bytes a step, then the tail bytewise.
__attribute__((target("sse4.2"))) uint32_t update_sse42(const unsigned char* p, size_t n, uint32_t r) {
  uint64_t wide = r;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    wide = _mm_crc32_u64(wide, word);
  }
  r = static_cast<uint32_t>(wide);
  for (; n > 0; --n) r = _mm_crc32_u8(r, *p++);
  return r;
}
bool has_sse42() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("sse4.2"));
  return has;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* bytes = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (has_sse42()) return ~update_sse42(bytes, size, ~crc);
#endif
  return ~update_portable(bytes, size, ~crc);
}

uint32_t detail::crc32c_portable(const void* data, size_t size, uint32_t crc) {
  return ~update_portable(static_cast<const unsigned char*>(data), size, ~crc);
}

}  // namespace zg
