#!/usr/bin/env bash
# Runs every libFuzzer target of a Clang build made with -Dfuzz=true (tests/fuzz) for
# SECONDS each, all at once, starting from the committed seeds; what they find goes to
# BUILD_DIR/fuzz/<target>/, not into the repository. A crash, leak or hang prints the
# end of its log and the reproducer -- add that file to tests/fuzz/corpus/<target>/
# with the fix, and it replays in every test run -- and the script exits 1.
# Usage: scripts/fuzz.sh BUILD_DIR [SECONDS]   (60 s unless given)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
seconds=${2:-60}

targets=(fuzz_safetensors fuzz_single_file_checkpoint fuzz_sharded_checkpoint)
pids=()
for target in "${targets[@]}"; do
  out="$build/fuzz/$target"
  rm -rf "$out"
  mkdir -p "$out/found"
  # The first folder receives the new inputs; the seeds' folder is only read.
  "$build/tests/fuzz/$target" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$out/" "$out/found" "tests/fuzz/corpus/$target" >"$out/log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!targets[@]}"; do
  target=${targets[$i]}
  out="$build/fuzz/$target"
  if wait "${pids[$i]}"; then
    echo "$target: $(grep -E '^stat::number_of_executed_units' "$out/log" | awk '{print $2}') inputs," \
      "$(grep -Eo 'cov: [0-9]+' "$out/log" | tail -n 1)"
  else
    status=1
    tail -n 60 "$out/log"
    echo "$target FAILED; reproducer: $(ls "$out"/crash-* "$out"/leak-* "$out"/timeout-* "$out"/oom-* 2>/dev/null | tr '\n' ' ')"
  fi
done
exit $status
