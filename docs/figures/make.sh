#!/usr/bin/env bash
# Draws every figure of the course (docs/*.md) with the project's own binaries:
#   docs/figures/make.sh [BENCH_DIR] [OUT_DIR]      (defaults: build/bench, docs/figures)
# Each is a dry run on the meta device -- real code paths, counted bytes, nothing
# computed -- so they take seconds, need no GPU, and come out byte for byte the same on
# every machine: tests/test_examples.cpp redraws them and compares with the committed ones.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bench="$(cd "${1:-$here/../../build/bench}" && pwd)"
out="${2:-$here}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# zero_memory NAME FLAGS...: one run's traces and figures into $work/NAME.
zero_memory() {
  local name=$1
  shift
  "$bench/zero_memory" "$@" --timeline "$work/$name" >/dev/null
}
# side_by_side OUT TITLE TRACE LABEL...: traces on one scale.
side_by_side() {
  local file=$1 title=$2
  shift 2
  "$bench/memory_figure" --out "$out/$file" --title "$title" "$@"
}

# 1. Sixteen bytes a parameter: GPT-2 124M under DDP, short sequences (activations small).
zero_memory bytes --model 124m --world-size 1 --stage 0 --seq 64 --steps 2
cp "$work/bytes/stage-0.svg" "$out/bytes-per-parameter.svg"

# 2. The caching allocator: what a GPU's cache reserves through two steps, DDP and ZeRO-3.
zero_memory cache-ddp --model 124m --world-size 1 --stage 0 --seq 1024 --steps 2 --caching
zero_memory cache-zero3 --model 124m --world-size 8 --stage 3 --seq 1024 --steps 2 --caching
side_by_side caching-allocator.svg "Allocated (stacked) and reserved (line): GPT-2 124M, batch 1 x 1024, 2 steps" \
  --reserved "$work/cache-ddp/stage-0.json" "DDP, 1 rank" "$work/cache-zero3/stage-3.json" "ZeRO-3, rank 0 of 8"

# 3, 4. Saved activations, kept or recomputed (activation checkpointing).
zero_memory kept --model 124m --world-size 1 --stage 0 --seq 1024 --batch 4
zero_memory recomputed --model 124m --world-size 1 --stage 0 --seq 1024 --batch 4 --checkpointing
cp "$work/kept/stage-0.svg" "$out/activations.svg"
side_by_side activation-checkpointing.svg "GPT-2 124M, batch 4 x 1024, one step: activations kept or recomputed" \
  "$work/kept/stage-0.json" "every activation kept" "$work/recomputed/stage-0.json" "activation checkpointing"

# 5. Mixed precision: f32 compute against bf16 compute with f32 master weights.
zero_memory f32 --model 124m --world-size 1 --stage 0 --seq 256 --batch 4 --compute f32
zero_memory bf16 --model 124m --world-size 1 --stage 0 --seq 256 --batch 4
side_by_side mixed-precision.svg "GPT-2 124M, batch 4 x 256, one step: f32 compute, or bf16 with an f32 master" \
  "$work/f32/stage-0.json" "f32 compute" "$work/bf16/stage-0.json" "bf16 compute, f32 master"

# 6. DDP: one rank or eight, every rank holds everything.
zero_memory ddp1 --model 124m --world-size 1 --stage 0 --seq 256 --steps 2
zero_memory ddp8 --model 124m --world-size 8 --stage 0 --seq 256 --steps 2
side_by_side ddp.svg "DDP, GPT-2 124M, batch 1 x 256 a rank, 2 steps: a rank's bytes at N = 1 and N = 8" \
  "$work/ddp1/stage-0.json" "N = 1" "$work/ddp8/stage-0.json" "N = 8, rank 0"

# 7. ZeRO-1, 2, 3 (the README's figure).
zero_memory stages --model 124m --world-size 8 --stage all --seq 256 --steps 2
cp "$work/stages/all.svg" "$out/zero-stages.svg"
cp "$work/stages/stage-3.svg" "$out/zero3-step.svg"  # the training step chapter's

# 8. Offload: ZeRO-3 with the optimizer, then the parameters too, in host memory.
zero_memory offload --model 124m --world-size 8 --stage 3 --offload all --seq 256 --steps 2
cp "$work/offload/all.svg" "$out/offload.svg"

# 8b. The offloaded step's three schedules: GPT-2 1.5B at ZeRO-1 with the optimizer offloaded on one
# GPU of the step model's H100 box (bench/results/h100-2026-11-26 measured this setting), its CPU
# AdamW after the backward, a unit at a time during it, or delayed beside the next step's passes.
"$bench/zero_memory" --simulate --model 1.5b --world-size 1 --stage 1 --offload optimizer --batch 8 --seq 1024 \
  --checkpointing --offload-schedule after-backward,in-backward,delayed --schedule-svg "$out/offload-schedules.svg" >/dev/null

# 9. Checkpoints: what each rank holds, and so writes, at N = 2 and N = 8 (ZeRO-3).
zero_memory shards2 --model 124m --world-size 2 --stage 3 --seq 256
zero_memory shards8 --model 124m --world-size 8 --stage 3 --seq 256
side_by_side checkpoint-shards.svg "ZeRO-3, GPT-2 124M: the shards a rank holds (and saves) at N = 2 and N = 8" \
  "$work/shards2/stage-3.json" "N = 2, rank 0" "$work/shards8/stage-3.json" "N = 8, rank 0"

# 10. Reading a trace: the tiny GPT at ZeRO-3 on four ranks, as bench/zero_memory's --timeline writes it.
zero_memory tiny --model tiny --world-size 4 --stage 3 --steps 2
cp "$work/tiny/stage-3.svg" "$out/tiny-zero3.svg"

# 12. The device mesh: ZeRO-3 over all 16 ranks, or sharded within each dp_shard group of 4
# and replicated across the 4 groups (HSDP / MiCS).
zero_memory flat16 --model 124m --world-size 16 --stage 3 --seq 256 --steps 2
zero_memory hsdp16 --model 124m --world-size 16 --stage 3 --shard-group 4 --seq 256 --steps 2
side_by_side device-mesh.svg "ZeRO-3, GPT-2 124M, 16 ranks, rank 0: sharded over all 16, or over groups of 4 with 4 replicas" \
  "$work/flat16/stage-3.json" "dp_shard 16" "$work/hsdp16/stage-3.json" "dp_replicate 4 x dp_shard 4"

# 13. Collectives: the alpha-beta model's all-reduce time, ring against trees, at N = 8 and 64
# (formulas only, with dist::Machine's rates: no timing).
"$bench/collectives" --figure "$out/collectives.svg" >/dev/null

# 14. Communication overlapped with compute: one step as the step model schedules it
# (dist/comm/step_model.h; arithmetic on the dry run's log, no clock), compute over
# communication, DDP and ZeRO-3 within a node (N = 8) and across nodes (N = 64).
"$bench/zero_memory" --model 124m --simulate --world-size 8,64 --stage 0,3 --seq 1024 --batch 4 \
  --schedule-svg "$out/overlap.svg" >/dev/null

# 15. Building a model already sharded: Llama 2 7B's shape at ZeRO-3, rank 0 of 8, built
# eagerly then sharded, or deferred; one step after each (examples/own_model --figure).
"$bench/../examples/own_model" --figure "$out/building-sharded.svg" >/dev/null

# 16. Tensor parallelism: GPT 7.5B cut over T = 1, 2, 4, 8 ranks (Megatron's plan, no data
# parallelism), beside ZeRO-3 over the same 8 ranks.
for t in 1 2 4 8; do
  zero_memory tp$t --model 7.5b --world-size $t --tp $t --stage 0
done
zero_memory zero3-8 --model 7.5b --world-size 8 --stage 3
side_by_side tensor-parallel.svg "GPT 7.5B, batch 1 x 1024, one step, rank 0: cut over T ranks, or ZeRO-3 over 8" \
  "$work/tp1/stage-0.json" "one rank" "$work/tp2/stage-0.json" "T = 2" "$work/tp4/stage-0.json" "T = 4" \
  "$work/tp8/stage-0.json" "T = 8" "$work/zero3-8/stage-3.json" "ZeRO-3, N = 8"

# 18. ZeRO++: GPT 7.5B at ZeRO-3 over 64 ranks in nodes of 8, then with qwZ, hpZ, qgZ and all three:
# the bytes a rank sends within its node and across nodes.
"$bench/zero_memory" --model 7.5b --world-size 64 --zeropp-svg "$out/zeropp.svg" >/dev/null

# 17. Pipeline parallelism: every schedule at p = 4 ranks, m = 8 micro-batches, on the
# idealised machine of dist::simulate (F = I = W): ranks in rows, the bubble left empty.
"$bench/pipeline_schedules" --pp 4 --micro-batches 8 --svg "$out/pipeline-schedules.svg" >/dev/null

# 20. The planner: Llama 3 8B (its config.json) on one node of 8 GPUs and on 64, every setting's
# peak against its predicted tokens/s a GPU (bench/plan.h: dry runs and the step model).
llama3_8b="$here/../../tests/fixtures/llama3_8b/config.json"
"$bench/zero_memory" --plan --config "$llama3_8b" --gpus 8 --global-batch 128K-tokens --plan-svg "$out/planner-8.svg" >/dev/null
"$bench/zero_memory" --plan --config "$llama3_8b" --gpus 64 --global-batch 1M-tokens --plan-svg "$out/planner-64.svg" >/dev/null

# 21. Context parallelism: Llama 3.1 8B (its config.json) on one sequence of 131,072 tokens,
# ZeRO-3 over C = 1, 2, 4, 8 cp ranks, each variant: who sends what to whom, a rank's
# activation peak and the bytes its cp group sends a step (bench/context_figure.h).
"$bench/zero_memory" --config "$here/../../tests/fixtures/llama3.1_8b/config.json" --seq 131072 \
  --cp-svg "$out/context-parallel.svg" >/dev/null
