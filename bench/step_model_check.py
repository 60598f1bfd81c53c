#!/usr/bin/env python3
"""Checks the step-time model (dist/comm/step_model.h) against real multi-process runs.

For each N and stage: this machine's rates measured under `mpirun -n N` (zero_memory
--calibrate: a matrix product, a memory-bound add, an empty kernel, the mpi group's
latency and bandwidth), the model's prediction for train_zero's shape (zero_memory
--simulate with those rates), and train_zero's measured step under `mpirun -n N`
(the median of its steps after the first two). Prints a Markdown table, predicted /
measured per row.

    python3 bench/step_model_check.py --build build [--ranks 2,4] [--steps 10] > table.md
"""
import argparse
import re
import statistics
import subprocess
import sys


def run(command):
    out = subprocess.run(command, shell=True, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed: {command}\n{out.stdout}{out.stderr}")
    return out.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shape", default="--layers 4 --heads 4 --embd 128 --seq 64",
                        help="train_zero's model flags (vocabulary 256)")
    parser.add_argument("--rows", type=int, default=4, help="sequences per rank per step")
    args = parser.parse_args()
    mpirun = "mpirun --oversubscribe --allow-run-as-root -n"
    seq = int(re.search(r"--seq (\d+)", args.shape).group(1))
    model_flags = args.shape.replace(f"--seq {seq}", "").strip()
    print("| N | stage | measured ms | predicted ms | predicted / measured | predicted exposed comm ms |")
    print("|---|---|---|---|---|---|")
    for n in map(int, args.ranks.split(",")):
        rates = run(f"{mpirun} {n} {args.build}/bench/zero_memory --calibrate --model tiny {model_flags} --vocab 256 "
                    f"--batch {args.rows} --seq {seq}").strip().splitlines()[-1]
        print(f"<!-- N = {n}: {rates} -->")
        for stage in map(int, args.stages.split(",")):
            out = run(f"{mpirun} {n} {args.build}/examples/train_zero {args.shape} --batch {args.rows * n} "
                      f"--steps {args.steps} --stage {stage} --dtype bf16")
            tok_s = [float(m) for m in re.findall(r"\|\s+(\d+) tok/s", out)][2:]
            measured = args.rows * n * seq / statistics.median(tok_s)
            predicted = run(f"{args.build}/bench/zero_memory --simulate --model tiny {model_flags} --vocab 256 "
                            f"--world-size {n} --stage {stage} --batch {args.rows} --seq {seq} --json {rates}")
            step = float(re.search(r'"step_seconds": ([0-9.e+-]+)', predicted).group(1))
            exposed = float(re.search(r'"exposed_seconds": ([0-9.e+-]+)', predicted).group(1))
            print(f"| {n} | {stage} | {measured * 1e3:.2f} | {step * 1e3:.2f} | {step / measured:.2f} | "
                  f"{exposed * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
