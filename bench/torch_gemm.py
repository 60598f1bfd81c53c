#!/usr/bin/env python3
"""torch_gemm: bench/gemm's rows with torch.matmul, the reference for its "vs torch".

The same square sizes, dtypes and GPT-2 124M products as bench/gemm.cpp (which says
where each comes from), timed the same way: 3 untimed products, then --iters products
between two CUDA events on the current stream with no host synchronisation in between
(time.perf_counter on the cpu).

    flops = 2 * M * N * K per product

f32 products run in full f32 (no TF32), as zerograd's cuBLAS call computes them.
--json FILE writes the records that `bench/gemm --reference FILE` reads.

    python3 bench/torch_gemm.py --dtype bf16 --sizes 1024,2048,4096,8192 --gpt2 --json torch_gemm.json
    build/bench/gemm --dtype bf16 --sizes 1024,2048,4096,8192 --gpt2 --reference torch_gemm.json
"""
import argparse
import json
import sys
import time

import torch

WARMUP = 3  # untimed products per row, as in bench/gemm
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def square(n):
    return {"name": f"square {n}", "product": "A B", "m": n, "n": n, "k": n, "trans_a": False, "trans_b": False}


def gpt2_products(tokens):
    """Each linear layer y = x W^T of GPT-2 124M: forward, input grad, weight grad (as bench/gemm.cpp)."""
    layers = [("qkv", 768, 2304), ("attn proj", 768, 768), ("fc", 768, 3072), ("mlp proj", 3072, 768),
              ("lm head", 768, 50304)]
    products = []
    for name, fan_in, fan_out in layers:
        products += [
            {"name": f"gpt2 {name} fwd", "product": "x W^T", "m": tokens, "n": fan_out, "k": fan_in,
             "trans_a": False, "trans_b": True},
            {"name": f"gpt2 {name} dx", "product": "dy W", "m": tokens, "n": fan_in, "k": fan_out,
             "trans_a": False, "trans_b": False},
            {"name": f"gpt2 {name} dW", "product": "x^T dy", "m": fan_in, "n": fan_out, "k": tokens,
             "trans_a": True, "trans_b": False},
        ]
    return products


def time_product(p, dtype, device, iters):
    """Milliseconds per product; A is stored [K, M] when trans_a, B [N, K] when trans_b (read as views)."""
    a = torch.randn((p["k"], p["m"]) if p["trans_a"] else (p["m"], p["k"]), dtype=dtype, device=device)
    b = torch.randn((p["n"], p["k"]) if p["trans_b"] else (p["k"], p["n"]), dtype=dtype, device=device)
    a = a.t() if p["trans_a"] else a
    b = b.t() if p["trans_b"] else b
    for _ in range(WARMUP):
        torch.matmul(a, b)
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.matmul(a, b)
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / iters
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    return (time.perf_counter() - start) * 1e3 / iters


def counts(text):
    values = [int(word) for word in text.split(",")]
    if any(v < 1 for v in values):
        raise ValueError(text)
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32", "all"])
    parser.add_argument("--sizes", type=counts, help="square sizes, default 1024,2048,4096,8192 (128,256,512 on cpu)")
    parser.add_argument("--gpt2", action="store_true", help="add GPT-2 124M's products")
    parser.add_argument("--tokens", type=int, default=16384, help="rows of the GPT-2 products (B * T)")
    parser.add_argument("--iters", type=int, default=20, help="timed products per row")
    parser.add_argument("--json", metavar="FILE", help="write the records bench/gemm --reference reads")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got '{args.device}'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("torch_gemm: --device cuda needs a GPU and a CUDA build of torch; --device cpu runs on the CPU")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    if args.iters < 1 or args.tokens < 1:
        parser.error("--iters and --tokens must be at least 1")
    torch.set_float32_matmul_precision("highest")  # f32 in f32, not TF32 (zerograd's CUBLAS_COMPUTE_32F)
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    sizes = args.sizes or ([128, 256, 512] if device.type == "cpu" else [1024, 2048, 4096, 8192])
    products = [square(n) for n in sizes] + (gpt2_products(args.tokens) if args.gpt2 else [])

    library = f"torch {torch.__version__}"
    where = f"{device}, {torch.cuda.get_device_name(device)}" if device.type == "cuda" else str(device)
    print(f"torch.matmul ({library}) on {where}: {args.iters} timed products per row after {WARMUP} untimed; "
          "flops = 2 M N K\n")
    print(f"{'shape':<22} {'product':<7} {'M':>6} {'N':>6} {'K':>6} {'dtype':>5} {'ms':>10} {'TFLOP/s':>9}")
    records = []
    for dtype in dtypes:
        for p in products:
            ms = time_product(p, DTYPES[dtype], device, args.iters)
            tflops = 2.0 * p["m"] * p["n"] * p["k"] / (ms * 1e-3) / 1e12
            records.append({"name": p["name"], "product": p["product"], "m": p["m"], "n": p["n"], "k": p["k"],
                            "dtype": dtype, "device": str(device), "library": library, "iters": args.iters,
                            "ms": ms, "tflops": tflops})
            print(f"{p['name']:<22} {p['product']:<7} {p['m']:>6} {p['n']:>6} {p['k']:>6} {dtype:>5} {ms:>10.4f} "
                  f"{tflops:>9.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in records) + "\n]\n")


if __name__ == "__main__":
    main()
