// CRC-32C (Castagnoli): the checksum safetensors files written here carry for each
// tensor, so a load notices bytes that changed on disk or in transit.
//
//   polynomial 0x1EDC6F41 (bit-reflected 0x82F63B78), initial value and final xor ~0,
//   as iSCSI, ext4 and Google's crc32c library compute it: crc32c("123456789") = 0xE3069283.
//
// x86-64 CPUs with SSE4.2 compute it in hardware, 8 bytes per instruction (9.6 GB/s on
// the development VM, faster than a disk delivers them); elsewhere a table of 256
// entries, one byte per step (0.46 GB/s there).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zg {

// The CRC-32C of `size` bytes. Continues from `crc` (the CRC of the bytes before):
// crc32c(a + b) = crc32c(b, crc32c(a)).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

namespace detail {
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0);  // the table; for tests
}

}  // namespace zg
