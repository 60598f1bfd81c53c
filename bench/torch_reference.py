#!/usr/bin/env python3
"""The PyTorch side of bench/train_step: the same GPT, the same weights and tokens
(read from the file `train_step --write-init` wrote), the same AdamW with fp32
weights and moments, the same global-norm clipping, timed the same way, in eager
mode or under torch.compile. Run both in one session on one GPU:

    build/bench/train_step --model 124m --device cuda --write-init /tmp/init.safetensors --json > zg.json
    python3 bench/torch_reference.py --init /tmp/init.safetensors --mode eager --compare zg.json
    python3 bench/torch_reference.py --init /tmp/init.safetensors --mode compile --compare zg.json

Mixed precision is PyTorch's usual way: fp32 parameters, bf16 autocast for the
forward (zerograd keeps bf16 weights and an fp32 master; both hold 16 bytes of
model state per parameter). Figures printed:

    tokens/s = timed_steps * batch * seq / seconds
    MFU      = tokens/s * flops_per_token / peak,  flops_per_token = 6 N + 12 L C T
"""
import argparse
import json
import math
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)); names as zerograd's (and Hugging Face's) GPT-2."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab_size, block_size):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab_size, n_embd)
        self.transformer.wpe = nn.Embedding(block_size, n_embd)
        self.transformer.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.transformer.ln_f = nn.LayerNorm(n_embd, eps=1e-5)

    def forward(self, idx, targets):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in t.h:
            x = block(x)
        logits = t.ln_f(x) @ t.wte.weight.t()  # the LM head is the token embedding (tied)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool}


def read_safetensors(path):
    """The metadata and tensors of a safetensors file, read here (an 8-byte little-endian
    header length, the JSON header, then each tensor's bytes) so that this script needs
    torch alone: the GPU machines it runs on have no network to install packages."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(entry["shape"])
    return metadata, tensors


def load(path, device):
    metadata, state = read_safetensors(path)
    # Beside the run's numbers (shape, lr) the metadata holds each tensor's checksum ("crc32c/<name>").
    meta = {k: int(v) if v.isdigit() else float(v) for k, v in metadata.items() if not k.startswith("crc32c/")}
    tokens = state.pop("tokens").to(device)
    model = GPT(meta["n_layer"], meta["n_head"], meta["n_embd"], meta["vocab_size"], meta["block_size"])
    model.load_state_dict(state, strict=True)
    return model.to(device), tokens, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="weights and tokens written by train_step --write-init")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (compile happens here)")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", help="train_step --json output to print ratios and loss differences against")
    a = ap.parse_args()
    assert a.steps > a.warmup >= 0, "need --steps > --warmup >= 0"
    device = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = a.dtype != "f32"
    torch.backends.cudnn.allow_tf32 = a.dtype != "f32"

    model, tokens, meta = load(a.init, device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    batch, seq = inputs.shape
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=meta.get("lr", 6e-4), betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    forward = torch.compile(model) if a.mode == "compile" else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")

    losses = []  # kept on the device until the timing is over, as in train_step

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = forward(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # foreach, no host read
        opt.step()
        losses.append(loss.detach())

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(a.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(a.warmup, a.steps):
        step()
    sync()
    seconds = time.perf_counter() - start

    timed = a.steps - a.warmup
    params = sum(p.numel() for p in model.parameters())
    tokens_per_s = timed * batch * seq / seconds
    flops_per_token = 6 * params + 12 * meta["n_layer"] * meta["n_embd"] * seq
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = a.peak_tflops or (756.0 if "H100" in name and "PCIe" in name else
                             989.4 if ("H100" in name or "H200" in name) else 0.0)
    record = {
        "impl": f"torch-{a.mode}", "device": name, "dtype": a.dtype, "batch": batch, "seq": seq, "params": params,
        "steps": a.steps, "timed_steps": timed, "ms_per_step": 1e3 * seconds / timed, "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token, "mfu": tokens_per_s * flops_per_token / (peak * 1e12) if peak else 0.0,
        "peak_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
        "reserved": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0,
        "losses": [l.item() for l in losses],
    }
    if a.json:
        print(json.dumps(record))
    else:
        print(f"PyTorch {torch.__version__} ({a.mode}) train step: GPT ({params} parameters), batch {batch} x {seq} "
              f"tokens, {a.dtype}, on {name}")
        for i, l in enumerate(record["losses"]):
            print(f"step {i + 1:3d}  loss {l:.6f}{'  (warm-up)' if i < a.warmup else ''}")
        print(f"{record['ms_per_step']:.2f} ms/step, {tokens_per_s:.0f} tokens/s over {timed} timed steps")
        print(f"flops/token = 6*{params} + 12*{meta['n_layer']}*{meta['n_embd']}*{seq} = {flops_per_token:.4g}"
              + (f"; MFU {100 * record['mfu']:.1f}% of {peak:.1f} TFLOP/s" if peak else ""))
        print(f"peak allocated {record['peak_allocated'] / 2**20:.1f} MiB, reserved {record['reserved'] / 2**20:.1f} MiB")
    if a.compare:
        with open(a.compare) as f:
            ours = json.loads(f.read().strip().splitlines()[-1])
        gaps = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(ours["losses"], record["losses"])]
        memory = (f"peak memory ratio {ours['peak_allocated'] / record['peak_allocated']:.3f}, "
                  if record["peak_allocated"] else "")  # PyTorch counts no CPU memory
        print(f"zerograd vs {record['impl']}: tokens/s ratio {ours['tokens_per_s'] / tokens_per_s:.3f}, {memory}"
              f"loss after step {len(gaps)}: {ours['losses'][-1]:.6f} vs {record['losses'][-1]:.6f} "
              f"(largest relative gap over the steps {max(gaps):.2e})")
    return 0 if all(math.isfinite(l) for l in record["losses"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
