"""DeepSpeed's CPU Adam (ZeRO-Offload's optimizer step) on N f32 parameters: the
reference bench/adamw --device cpu --grad f32 is measured against (same bytes: read
grad, param, m, v; write param, m, v; AdamW with weight decay).

    python3 bench/deepspeed_adam.py --params 10000000 [--iters 20] [--json]

Needs torch and deepspeed (pip, in a virtual environment; DeepSpeed builds its CPU op
on first use, without a GPU). Threads: OpenMP's, OMP_NUM_THREADS (default: all cores).
"""
import argparse
import json
import time

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

parser = argparse.ArgumentParser()
parser.add_argument("--params", type=int, default=10_000_000)
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--json", action="store_true")
args = parser.parse_args()

param = torch.nn.Parameter(torch.randn(args.params))
param.grad = torch.randn(args.params)
optimizer = DeepSpeedCPUAdam([param], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True)
for _ in range(3):  # warm-up: the state is allocated on the first step
    optimizer.step()
start = time.perf_counter()
for _ in range(args.iters):
    optimizer.step()
ms = (time.perf_counter() - start) * 1e3 / args.iters
gbps = args.params * 28 / (ms * 1e6)
if args.json:
    print(json.dumps({"params": args.params, "iters": args.iters, "deepspeed_ms": ms, "deepspeed_gbps": gbps}))
else:
    print(f"DeepSpeedCPUAdam over {args.params} f32 parameters: {ms:.3f} ms, {gbps:.1f} GB/s (28 bytes a parameter)")
