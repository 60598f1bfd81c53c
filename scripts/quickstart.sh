#!/usr/bin/env bash
# Installs what is missing, builds, and runs bench/zero_memory, which
# trains a GPT for a few steps under DDP and ZeRO-1/2/3 with 4 ranks (threads of one
# process, on the GPU if this build has one, else on the CPU) and prints each rank's
# memory by category and bytes sent per step next to the ZeRO paper's formulas; then
# the same for GPT-2 124M at 8 ranks as a meta-device dry run (nothing allocated).
# Extra arguments go to the first run (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
source scripts/env.sh
zg_build
"$BUILD_DIR/bench/zero_memory" --device auto --world-size 4 --steps 3 "$@"
echo
"$BUILD_DIR/bench/zero_memory" --device meta --model 124m --world-size 8
