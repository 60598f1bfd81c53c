#!/usr/bin/env python3
"""One markdown row per run of a training example: its mean loss over windows of steps.

    bench/loss_table.py "build/examples/train_zero --ranks 4 --steps 300" --stage 3 "--stage 3 --qwz" ...

The first argument is the command every run shares; each further one is a run's own flags.
Reads the examples' `step S/T | loss L | ...` lines (bench/results/zeropp-loss-curves.md).
"""
import re
import shlex
import subprocess
import sys

WINDOWS = [(1, 50), (101, 150), (201, 250), (251, 300)]


def losses(command):
    out = subprocess.run(shlex.split(command), capture_output=True, text=True, check=True).stdout
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step\s+(\d+)/\d+ \| loss ([0-9.]+)", out, re.M)}


def main():
    base, runs = sys.argv[1], sys.argv[2:]
    print("| flags | " + " | ".join(f"mean loss {a}-{b}" for a, b in WINDOWS) + " | last step |")
    print("|---" * (len(WINDOWS) + 2) + "|")
    for flags in runs:
        by_step = losses(f"{base} {flags}")
        means = [sum(by_step[s] for s in range(a, b + 1)) / (b - a + 1) for a, b in WINDOWS]
        last = by_step[max(by_step)]
        print(f"| `{flags}` | " + " | ".join(f"{m:.4f}" for m in means) + f" | {last:.4f} |", flush=True)


if __name__ == "__main__":
    main()
