#!/usr/bin/env bash
# For a session that is lent a GPU (README, "With a GPU"): everything GPU correctness
# needs, in two halves, so the device's minutes go to running, not building.
#
#   scripts/gpu-session.sh build   here: configure and build build-gpu/ (sm_90a,
#                                  release + asserts), then copy what runs (library,
#                                  test and bench binaries, stripped) into gpu-carry/,
#                                  the folder to name in the device tool's carry (< 64 MiB)
#   scripts/gpu-session.sh run     on the device: every test binary, compute-sanitizer
#                                  memcheck on the CUDA areas, bench/zero_memory on
#                                  cuda for GPT-2 124M and 350M at N = 1, 2, 4, 8;
#                                  logs and JSON into $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    source scripts/env.sh
    for ignored in build-gpu/ gpu-carry/; do
      grep -qx "$ignored" .git/info/exclude || echo "$ignored" >> .git/info/exclude
    done
    [ -d build-gpu ] || meson setup build-gpu -Dcuda=enabled -Dcuda-arch=sm_90a -Dbuildtype=release -Db_ndebug=false
    ninja -C build-gpu
    # Only what runs travels: no objects, no Meson state; build.ninja for the paths.
    rm -rf gpu-carry && mkdir gpu-carry
    (cd build-gpu && find . -type f \( -name 'libzerograd.so*' -o -path './tests/test_*' -o -path './bench/*' \
        -o -path './examples/*' -o -name build.ninja \) -not -path '*.p/*' -not -name '*.cpp' -not -name '*.a' |
      while read -r f; do mkdir -p "../gpu-carry/$(dirname "$f")"; cp -P "$f" "../gpu-carry/$f"; done)
    find gpu-carry -type f -perm -u+x -exec strip --strip-unneeded {} + 2>/dev/null || true
    du -sh gpu-carry
    ;;
  run)
    : "${OUT:?run this on the device machine, where \$OUT is set}"
    [ -e build-gpu ] || ln -s gpu-carry build-gpu  # the carried copy stands where it was built
    # The binaries name fixtures and example binaries by the absolute paths of the machine
    # that built them: make those paths lead here.
    built_in="$(sed -n 's/^.*-DZG_TEST_FIXTURES="\([^"]*\)\/tests\/fixtures".*$/\1/p' build-gpu/build.ninja | head -n 1)"
    if [ -n "$built_in" ] && [ ! -e "$built_in" ]; then mkdir -p "$(dirname "$built_in")"; ln -s "$PWD" "$built_in"; fi
    libs="$(find / \( -name 'libcudnn.so*' -o -name 'libnccl.so*' -o -name 'libcublasLt.so*' -o -name 'libnvrtc.so*' \) -not -path '*/proc/*' \
            2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':' || true)"
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
    status=0
    for t in build-gpu/tests/test_*; do
      case "$t" in *test_mpi) continue ;; esac  # OpenMPI is not on the device; CI runs it
      echo "== $t" >> "$OUT/tests.log"
      timeout 300 "$t" >> "$OUT/tests.log" 2>&1 || { status=1; echo "FAILED: $t" | tee -a "$OUT/tests.log"; }
    done
    grep -E '^== |^FAILED|^\[doctest\] test cases' "$OUT/tests.log" | tee "$OUT/summary.txt"
    # (API errors are not reported: test_cuda_runtime asks cudaMalloc for 32 TiB on purpose.)
    for t in cuda cuda_runtime nccl ops; do
      timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 "build-gpu/tests/test_$t" \
        >> "$OUT/memcheck.log" 2>&1 || { status=1; echo "memcheck FAILED: test_$t" | tee -a "$OUT/memcheck.log"; }
    done
    grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tee -a "$OUT/summary.txt" || true
    for model in 124m 350m; do
      for n in 1 2 4 8; do
        timeout 120 build-gpu/bench/zero_memory --model "$model" --world-size "$n" --device cuda --json \
          > "$OUT/zero_memory_${model}_n$n.json" 2>&1 || echo "zero_memory $model N=$n failed" | tee -a "$OUT/summary.txt"
      done
    done
    exit $status
    ;;
  *)
    echo "usage: scripts/gpu-session.sh build|run" >&2
    exit 2
    ;;
esac
