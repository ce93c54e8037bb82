"""The attention half's batch-1 GEMVs of the MoE shapes (qwen3-30b-a3b int4 g64, gpt-oss-20b
mxfp4): q/k/v joint, o, and the head, under launch variants alternated in one process, each
in a CUDA graph cycling copies of its weight (nothing stays in L2, as in the decode step), min
over reps; every output (with a bias, as gpt-oss's q/k/v/o take it in the epilogue) checked
against the float32 product of the dequantized weight.

    python3 benchmarks/moe_gemv_sweep.py [--shapes q3-qkv,q3-o,go-qkv,go-o] [--reps 3]
        [--variants auto,g8w2s1,...] [--json out.json]
    python3 benchmarks/moe_gemv_sweep.py --warm              # compile every variant only

Without --variants each shape runs its own list (SWEEP). A variant is "auto" (choose_config's
pick), or "gBNwWsS" (the one-shot GEMV: BN rows a program, W warps, S splits of K) with an
optional trailing "e" (each k-step's scales loaded with its words: KernelConfig.early).
On the CPU (no GPU) it runs each shape's first rows under the interpreter: a check of the
script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv8_sweep import graphed, time_us  # noqa: E402
from kernels import FORMATS, copy_bandwidth, make_weight  # noqa: E402

# name -> (N, K, format, bias): the joint q/k/v (heads * D + 2 * kv heads * D), o, the head
SHAPES = {
    "q3-qkv": (5120, 2048, "affine4g64", False),
    "q3-o": (2048, 4096, "affine4g64", False),
    "q3-head": (151936, 2048, "affine4g64", False),
    "go-qkv": (5120, 2880, "mxfp4", True),
    "go-o": (2880, 4096, "mxfp4", True),
    "go-head": (201088, 2880, "mxfp4", False),
}
SWEEP = {
    "q3-qkv": "auto,g8w2s1e,g8w1s2,g16w1s2,g8w1s1e,g16w1s1e",
    "q3-o": "auto,g8w4s1e,g8w2s2,g16w2s2,g8w2s1,g8w1s4,g16w1s4",
    "q3-head": "auto,g8w2s1e,g16w1s2",
    "go-qkv": "auto,g8w1s3,g8w1s1,g8w2s2,g8w4s1,g16w2s1",
    "go-o": "auto,g8w2s2,g8w1s4,g8w2s1,g16w4s1",
    "go-head": "auto,g8w1s1,g8w4s1",
}


def config(name: str, w, device):
    """The KernelConfig of a variant name."""
    from mlxrun.quant import triton_kernels as tk

    if name == "auto":
        return tk.choose_config(1, w, device, torch.bfloat16)
    mt = re.fullmatch(r"g(8|16)w([124])s([1-9])(e?)", name)
    if not mt:
        raise SystemExit(f"unknown variant {name!r}")
    bn, nw, sk = (int(v) for v in mt.groups()[:3])
    return tk.KernelConfig("gemv", 1, bn, sk, num_warps=nw, early=mt[4] == "e")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="q3-qkv,q3-o,go-qkv,go-o")
    ap.add_argument("--variants", default=None, help="for every shape (else SWEEP's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--warm", action="store_true", help="compile every variant only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from mlxrun.quant import triton_kernels as tk

    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    bw = copy_bandwidth() / 1e9 if gpu and not a.warm else float("nan")
    if gpu:
        print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s (read + write)", flush=True)
    rows = []
    for name in a.shapes.split(","):
        n, k, fmt, has_bias = SHAPES[name]
        mode, bits, g = FORMATS[fmt]
        if not gpu or a.warm:
            n = min(n, 64)  # compile / check at the real K and constexprs
        w0 = make_weight(n, k, mode, bits, g, device=dev.type)
        variants = (a.variants or SWEEP[name]).split(",")
        gen = torch.Generator(device=dev.type).manual_seed(1)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16 if gpu else torch.float32)
        bias = torch.randn(n, device=dev, generator=gen).to(x.dtype) if has_bias else None
        ref = x.float() @ tk.dequantize_torch(w0).float().T
        ref = ref if bias is None else ref + bias.float()
        cfgs = {}
        for v in variants:
            # the launch as qmatmul takes it for the real N (the rule reads N)
            wn = type("W", (), dict(n=SHAPES[name][0], k=k, bits=bits, group_size=g, mode=mode))
            cfgs[v] = config(v, wn(), dev)
            t = time.time()
            y = tk.qmatmul(x, w0, cfgs[v], bias=bias).float()
            err = ((y - ref).norm() / ref.norm()).item()
            print(f"{name} {v}: {cfgs[v].block_n} rows, {cfgs[v].num_warps} warps, "
                  f"{cfgs[v].split_k} splits, early {cfgs[v].early}: err {err:.1e} "
                  f"({time.time() - t:.1f} s)", flush=True)  # fmt: skip
            if err > 2e-2:
                raise SystemExit(f"{name} {v}: output off by {err:.1e}")
        if not gpu or a.warm:
            continue
        copies = max(2, math.ceil(400e6 / w0.nbytes))
        ws = [w0] + [make_weight(n, k, mode, bits, g, seed=s) for s in range(1, copies)]
        graphs, res = {}, {}
        for v in variants:

            def fn(i, c=cfgs[v], x=x, ws=ws, nc=copies, b=bias):
                return tk.qmatmul(x, ws[i % nc], c, bias=b)

            graphs[v] = graphed(fn, a.calls)
            res[v] = []
        for r in range(a.reps):  # alternated, reversed every other round
            for v in variants if r % 2 == 0 else variants[::-1]:
                res[v].append(time_us(graphs[v], a.calls))
        line = [f"{name} {n}x{k} {fmt} ({w0.nbytes / 1e6:.1f} MB)"]
        for v in variants:
            us = min(res[v])
            gbs = w0.nbytes / us / 1e3
            line.append(f"{v} {us:.2f} us {100 * gbs / bw:.0f}%")
            rows.append(dict(shape=name, n=n, k=k, fmt=fmt, variant=v, us=res[v],
                             cfg=str(dataclasses.asdict(cfgs[v])), bytes=w0.nbytes,
                             copy_gbs=bw))  # fmt: skip
        print(" | ".join(line), flush=True)
        del graphs, ws, w0
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
