#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: train_gpt, a small GPT
# learning a text byte by byte (about a minute on two cores), with a progress line
# per step. Extra arguments go to train_gpt (try --help). Uses CUDA when present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
source scripts/env.sh
zg_build
"$BUILD_DIR/examples/train_gpt" "$@"
