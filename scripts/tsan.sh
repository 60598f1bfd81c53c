#!/usr/bin/env bash
# ThreadSanitizer over the threaded code: the local process group (ranks and their
# communication workers are threads), the caching allocator (two threads on one) and
# ZeRO-3 prefetch (gathers on the worker while the rank computes), offload and the CPU
# worker pool (the optimizer's blocks on several threads), a memory timeline recording
# ranks that run as threads. A Clang CPU build
# of those test binaries only; any report fails their tests.
# Usage: scripts/tsan.sh [BUILD_DIR]   (build-tsan unless given)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build=${1:-build-tsan}
if [ ! -f "$build/build.ninja" ]; then
  CC=clang CXX=clang++ meson setup "$build" -Dcuda=disabled -Dbench=false -Db_sanitize=thread -Db_lundef=false \
    -Dbuildtype=plain -Dcpp_args='-O1 -g1' >/dev/null
fi
meson compile -C "$build" tests/test_dist tests/test_caching_allocator tests/test_zero_checkpoint tests/test_zero_equivalence \
  tests/test_zero_errors tests/test_zero_memory tests/test_zero_parameters tests/test_zero_stage3 tests/test_zero_units \
  tests/test_mesh tests/test_p2p tests/test_offload tests/test_optim tests/test_memory tests/local_worker >/dev/null
meson test -C "$build" --no-rebuild --print-errorlogs --timeout-multiplier 4 dist caching_allocator zero_checkpoint \
  zero_equivalence zero_errors zero_memory zero_parameters zero_stage3 zero_units mesh p2p offload optim memory
