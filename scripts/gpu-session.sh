#!/usr/bin/env bash
# For a session that is lent a GPU (README, "With a GPU"): everything GPU correctness
# needs, in two halves, so the device's minutes go to running, not building.
#
#   scripts/gpu-session.sh build   here: configure and build build-gpu/ (sm_90a,
#                                  release + asserts), then copy what runs (library,
#                                  test and bench binaries, stripped) into gpu-carry/,
#                                  the folder to name in the device tool's carry (< 64 MiB)
#   scripts/gpu-session.sh run PART
#                                  on the device, one call per part (each < 10 minutes),
#                                  logs and JSON into $OUT:
#                                  tests     every test binary (four at a time)
#                                  memcheck  compute-sanitizer on the CUDA areas
#                                  bench     zero_memory on cuda (GPT-2 124M, 350M at
#                                            N = 1, 2, 4, 8), gemm against torch_gemm.py,
#                                            allocator, adamw, train_step against
#                                            torch_reference.py (eager and compile)
#                                  step      train_step and torch_reference.py alone (bench's last)
#                                  offload   GPT-2 1.5B trained on the one GPU with the optimizer
#                                            state (then the parameters too) in host memory, and
#                                            GPT-3 6.7B's shape with both;
#                                            GPT-2 124M at ZeRO-3 against stage 0 at N = 1
#                                  host      the CPU AdamW's loops (avx512, avx2, portable) on the
#                                            device machine's CPU: test_optim and bench/adamw
#                                            at 10M and 100M parameters
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    source scripts/env.sh
    mkdir -p .git/info
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
    part="${2:-tests}"
    [ -e build-gpu ] || ln -s gpu-carry build-gpu  # the carried copy stands where it was built
    # The binaries name fixtures and example binaries by the absolute paths of the machine
    # that built them: make those paths lead here.
    built_in="$(sed -n 's/^.*-DZG_TEST_FIXTURES="\([^"]*\)\/tests\/fixtures".*$/\1/p' build-gpu/build.ninja | head -n 1)"
    if [ -n "$built_in" ] && [ ! -e "$built_in" ]; then mkdir -p "$(dirname "$built_in")"; ln -s "$PWD" "$built_in"; fi
    libs="$(find / \( -name 'libcudnn.so*' -o -name 'libnccl.so*' -o -name 'libcublasLt.so*' -o -name 'libnvrtc.so*' \) -not -path '*/proc/*' \
            2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':' || true)"
    ld_library_path_before="${LD_LIBRARY_PATH:-}"  # torch brings its own CUDA libraries
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
    status=0
    note() { echo "$*" | tee -a "$OUT/summary.txt"; }
    case "$part" in
      tests)  # every test binary (issue 4 and 5's GPU items), four at a time, a log each
        mkdir -p "$OUT/tests"
        # OpenMPI is not on the device (CI runs test_mpi); the fuzzers are CI's too.
        ls build-gpu/tests/test_* | grep -v -e 'test_mpi$' | xargs -P 4 -I{} sh -c \
          't="{}"; log="$0/tests/$(basename "$t").log"; timeout 300 "$t" > "$log" 2>&1 || echo "FAILED: $t (exit $?)" >> "$log"' "$OUT"
        for log in "$OUT"/tests/*.log; do
          { echo "== $(basename "$log" .log)"; cat "$log"; } >> "$OUT/tests.log"
          grep -q '^FAILED' "$log" && status=1
        done
        grep -E '^== |^FAILED|^\[doctest\] test cases' "$OUT/tests.log" | tee -a "$OUT/summary.txt"
        ;;
      offload)  # issue 26 on a GPU: ZeRO-Offload at N = 1; issue 31: ZeRO-3 at N = 1 against stage 0
        for args in "--stage 0" "--stage 3"; do
          timeout 90 build-gpu/bench/train_step --model 124m --device cuda --steps 12 $args --json \
            > "$OUT/train_step_124m_${args// /_}.json" 2>&1 || note "train_step 124m $args failed"
        done
        for offload in optimizer optimizer+params; do
          timeout 180 build-gpu/bench/train_step --model 1.5b --device cuda --batch 8 --steps 6 --warmup 2 \
            --checkpointing --offload "$offload" > "$OUT/train_step_1.5b_offload_$offload.txt" 2>&1 ||
            note "train_step 1.5b --offload $offload failed"
          grep -E 'ms/step|MFU|peak' "$OUT/train_step_1.5b_offload_$offload.txt" >> "$OUT/summary.txt" || true
        done
        # Issue 48: the same 1.5B run with the CPU AdamW beside the backward, and delayed a step
        # (zero_memory --simulate --offload-schedule predicts 529 and 641 ms against 864 serial).
        for schedule in in-backward delayed; do
          timeout 180 build-gpu/bench/train_step --model 1.5b --device cuda --batch 8 --steps 6 --warmup 2 \
            --checkpointing --offload optimizer --offload-schedule "$schedule" \
            > "$OUT/train_step_1.5b_offload_optimizer_$schedule.txt" 2>&1 ||
            note "train_step 1.5b --offload optimizer --offload-schedule $schedule failed"
          grep -E 'ms/step|MFU|AdamW ran' "$OUT/train_step_1.5b_offload_optimizer_$schedule.txt" >> "$OUT/summary.txt" || true
        done
        # The largest GPT this machine's host memory holds the offloaded state of (14 bytes a parameter).
        timeout 240 build-gpu/bench/train_step --model 6.7b --device cuda --batch 4 --steps 3 --warmup 1 \
          --checkpointing --offload optimizer+params > "$OUT/train_step_6.7b_offload.txt" 2>&1 ||
          note "train_step 6.7b --offload optimizer+params failed"
        grep -E 'ms/step|MFU|peak' "$OUT/train_step_6.7b_offload.txt" >> "$OUT/summary.txt" || true
        ;;
      host)  # issue 26's CPU AdamW on this machine's CPU, each loop (ZG_CPU_ISA caps the widest)
        grep -m1 'model name' /proc/cpuinfo | tee -a "$OUT/summary.txt"
        grep -o -w -m1 -e avx512f /proc/cpuinfo | head -n 1 | tee -a "$OUT/summary.txt" || true
        for isa in avx512 avx2 portable; do
          ZG_CPU_ISA=$isa timeout 60 build-gpu/tests/test_optim -tc='*CPU AdamW*' > "$OUT/test_optim_$isa.log" 2>&1 ||
            { status=1; note "test_optim's CPU AdamW case failed with ZG_CPU_ISA=$isa"; }
          grep -E 'loop|test cases' "$OUT/test_optim_$isa.log" | sed "s/^/$isa: /" >> "$OUT/summary.txt"
          for n in 10000000 100000000; do
            ZG_CPU_ISA=$isa timeout 60 build-gpu/bench/adamw --device cpu --params $n --grad f32 --json \
              >> "$OUT/adamw_cpu.jsonl" 2>&1 || note "adamw cpu $isa $n failed"
          done
        done
        ;;
      memcheck)  # compute-sanitizer on the areas that launch kernels
        # (API errors are not reported: test_cuda_runtime asks cudaMalloc for 32 TiB on purpose.)
        for t in cuda cuda_runtime nccl ops; do
          timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 "build-gpu/tests/test_$t" \
            >> "$OUT/memcheck.log" 2>&1 || { status=1; echo "memcheck FAILED: test_$t" | tee -a "$OUT/memcheck.log"; }
        done
        grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tee -a "$OUT/summary.txt" || true
        ;;
      bench)  # the figures for bench/results: ZeRO memory, GEMM, allocator, the training step
        for model in 124m 350m; do
          for n in 1 2 4 8; do
            timeout 60 build-gpu/bench/zero_memory --model "$model" --world-size "$n" --device cuda --json \
              > "$OUT/zero_memory_${model}_n$n.json" 2>&1 || note "zero_memory $model N=$n failed"
          done
        done
        # GEMM TFLOP/s, next to torch.matmul's on the same GPU when torch is there; allocator pairs/s.
        gemm_args=(--device cuda --dtype bf16 --sizes 1024,2048,4096,8192 --gpt2)
        reference=""
        if LD_LIBRARY_PATH="$ld_library_path_before" timeout 120 python3 bench/torch_gemm.py "${gemm_args[@]}" \
            --json "$OUT/torch_gemm.json" > "$OUT/torch_gemm.txt" 2>&1; then
          reference="$OUT/torch_gemm.json"
        else
          note "torch_gemm failed (no torch on the device? see torch_gemm.txt): gemm runs without vs torch"
        fi
        timeout 60 build-gpu/bench/gemm "${gemm_args[@]}" ${reference:+--reference "$reference"} > "$OUT/gemm.txt" 2>&1 ||
          note "gemm failed"
        timeout 60 build-gpu/bench/allocator --json > "$OUT/allocator.json" 2>&1 || note "allocator failed"
        timeout 60 build-gpu/bench/adamw > "$OUT/adamw.txt" 2>&1 || note "adamw failed"
        tail -n 1 "$OUT/adamw.txt" >> "$OUT/summary.txt"
        bash "$0" run step || status=1
        ;;
      step)  # the training step against PyTorch (issue 31): also the last of `bench`
        # GPT-2 124M, batch 16 x 1024: zerograd, then PyTorch eager and torch.compile from the same
        # weights and tokens (the init file is 0.5 GB: it stays out of $OUT). At lr 1e-4: at the
        # default 6e-4, 20 steps of Adam without warm-up on one repeated batch are chaotic (loss
        # spikes at steps that differ from run to run; PyTorch eager and compile end 5% apart),
        # which leaves no losses to compare. The speed does not depend on it.
        init=/tmp/zg_init_124m.safetensors
        timeout 120 build-gpu/bench/train_step --model 124m --device cuda --lr 1e-4 --write-init "$init" --json \
          > "$OUT/train_step.json" 2> "$OUT/train_step.err" || note "train_step failed"
        timeout 60 build-gpu/bench/train_step --model 124m --device cuda --lr 1e-4 --init "$init" > "$OUT/train_step.txt" 2>&1 ||
          note "train_step (table) failed"
        for mode in eager compile; do
          LD_LIBRARY_PATH="$ld_library_path_before" timeout 240 python3 bench/torch_reference.py --init "$init" \
            --mode "$mode" --compare "$OUT/train_step.json" > "$OUT/torch_$mode.txt" 2>&1 || note "torch $mode failed"
          tail -n 1 "$OUT/torch_$mode.txt" >> "$OUT/summary.txt"
        done
        ;;
      *) echo "run: part must be tests, memcheck, bench, step, offload or host, got '$part'" >&2; exit 2 ;;
    esac
    exit $status
    ;;
  *)
    echo "usage: scripts/gpu-session.sh build | run tests|memcheck|bench|step|offload|host" >&2
    exit 2
    ;;
esac
