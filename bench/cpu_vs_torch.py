#!/usr/bin/env python3
"""A CPU training step, zerograd next to PyTorch eager, on the same sizes in one run.

For each model and sequence length: bench/train_step --device cpu writes its weights and
tokens (--write-init) and times its steps; bench/torch_reference.py loads the same
weights and tokens and times PyTorch's (f32, the same AdamW and clipping). The two
alternate, `--rounds` times each, and the medians are compared:

    ratio = PyTorch's ms/step / zerograd's ms/step      (>= 1: zerograd is as fast or faster)

    python3 bench/cpu_vs_torch.py --build build [--rounds 3] [--write bench/results/train_step.md]

PyTorch comes from ZG_TORCH_PYTHON (a python with torch), else a virtual environment
this script makes in .venv-torch (pip install torch: the CPU wheel, else PyPI's). --write replaces
the table between the markers in the file (or appends it).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

# The sizes: (train_step --model, sequence length, batch), as a laptop user would pick them.
SIZES = [("tiny", 64, 8), ("tiny", 256, 8), ("tiny", 1024, 2),
         ("small", 64, 8), ("small", 256, 4), ("small", 1024, 2)]
BEGIN, END = "<!-- cpu_vs_torch table -->", "<!-- /cpu_vs_torch table -->"


def torch_python():
    if os.environ.get("ZG_TORCH_PYTHON"):
        return os.environ["ZG_TORCH_PYTHON"]
    venv = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".venv-torch")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0:
        # The CPU wheel where PyTorch's index is reachable, else PyPI's (it runs on the CPU too).
        if subprocess.run([python, "-m", "pip", "install", "-q", "torch", "--index-url",
                           "https://download.pytorch.org/whl/cpu"]).returncode != 0:
            subprocess.run([python, "-m", "pip", "install", "-q", "torch"], check=True)
    return python


def run_json(command):
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--write", help="a Markdown file to put the table in")
    a = ap.parse_args()
    python = torch_python()
    torch_version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, seq, batch in SIZES:
            init = os.path.join(tmp, f"{model}-{seq}.safetensors")
            common = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
            zg = [f"{a.build}/bench/train_step", "--device", "cpu", "--dtype", "f32", "--model", model,
                  "--batch", str(batch), "--seq", str(seq), "--json"] + common
            run_json(zg + ["--write-init", init])
            ours, theirs = [], []
            for _ in range(a.rounds):  # alternating, so both see the machine's same moods
                ours.append(run_json(zg + ["--init", init])["ms_per_step"])
                theirs.append(run_json([python, os.path.join(os.path.dirname(__file__), "torch_reference.py"),
                                        "--init", init, "--device", "cpu", "--dtype", "f32", "--json"] + common)
                              ["ms_per_step"])
            z, t = statistics.median(ours), statistics.median(theirs)
            rows.append(f"| {model} | {seq} | {batch} | {z:.2f} | {t:.2f} | {t / z:.2f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    table = "\n".join([
        BEGIN,
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} CPUs), PyTorch {torch_version} eager, f32; "
        f"`python3 bench/cpu_vs_torch.py --build {a.build} --rounds {a.rounds}` (medians of {a.rounds} alternating "
        f"runs of {a.steps - a.warmup} timed steps each)",
        "",
        "| model | T | batch | zerograd ms/step | PyTorch ms/step | ratio (PyTorch / zerograd) |",
        "|---|---|---|---|---|---|",
        *rows, END])
    print(table)
    if a.write:
        text = open(a.write).read() if os.path.exists(a.write) else ""
        if BEGIN in text and END in text:
            text = text[:text.index(BEGIN)] + table + text[text.index(END) + len(END):]
        else:
            text += "\n" + table + "\n"
        open(a.write, "w").write(text)


if __name__ == "__main__":
    main()
