"""zerograd's CPU AdamW against DeepSpeedCPUAdam (ZeRO-Offload's optimizer step), on
the same sizes in one run, alternating the two sides; prints both and their ratio as
a Markdown table (bench/results/adamw.md keeps one).

    python3 bench/adamw_vs_deepspeed.py [--build build] [--params 10000000 100000000] [--rounds 3]

Each side runs `--rounds` times per size, alternating (a noisy neighbour hits both
alike), and its best round counts. Both update f32 parameters with f32 gradients, m
and v, AdamW with weight decay: 28 bytes moved a parameter. DeepSpeed comes from a
virtual environment this script creates (ZG_DEEPSPEED_VENV, default .venv-deepspeed;
pip installs torch for the CPU and deepspeed, whose CPU Adam op builds without a GPU).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("ZG_DEEPSPEED_VENV", ROOT / ".venv-deepspeed"))


def venv_python():
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    probe = subprocess.run([str(python), "-c", "import deepspeed, torch"], capture_output=True)
    if probe.returncode != 0:
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + ["torch", "--index-url", "https://download.pytorch.org/whl/cpu"], check=True)
        subprocess.run(pip + ["deepspeed"], check=True)
    return str(python)


def last_json(output):
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build", help="the build folder holding bench/adamw")
    parser.add_argument("--params", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    python = venv_python()
    adamw = str(ROOT / args.build / "bench" / "adamw")
    print("| parameters | DeepSpeedCPUAdam | zerograd | zerograd / DeepSpeed speed |")
    print("|---|---|---|---|")
    for n in args.params:
        best = {"deepspeed": float("inf"), "zerograd": float("inf")}
        for _ in range(args.rounds):
            ds = subprocess.run([python, str(ROOT / "bench" / "deepspeed_adam.py"), "--params", str(n), "--iters",
                                 str(args.iters), "--json"], capture_output=True, text=True, check=True)
            best["deepspeed"] = min(best["deepspeed"], last_json(ds.stdout)["deepspeed_ms"])
            zg = subprocess.run([adamw, "--device", "cpu", "--grad", "f32", "--params", str(n), "--iters",
                                 str(args.iters), "--json"], capture_output=True, text=True, check=True)
            best["zerograd"] = min(best["zerograd"], last_json(zg.stdout)["adamw_ms"])
        gbps = {side: n * 28 / (ms * 1e6) for side, ms in best.items()}
        print(f"| {n:,} | {best['deepspeed']:.2f} ms ({gbps['deepspeed']:.1f} GB/s) | "
              f"{best['zerograd']:.2f} ms ({gbps['zerograd']:.1f} GB/s) | "
              f"{best['deepspeed'] / best['zerograd']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
