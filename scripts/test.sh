#!/usr/bin/env bash
# Builds and runs the test suite (installing what is missing). Its last line is
# "N passed, N failed, N skipped", counting doctest test cases over all areas.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
source scripts/env.sh
zg_build
status=0
meson test -C "$BUILD_DIR" --print-errorlogs || status=$?
python3 scripts/count_tests.py "$BUILD_DIR/meson-logs/testlog.json" || status=1
exit $status
