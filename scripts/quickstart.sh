#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job (the tour: tensors and
# the per-category memory report). Uses CUDA when the toolkit is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
source scripts/env.sh
zg_build
"$BUILD_DIR/examples/tour" "$@"
