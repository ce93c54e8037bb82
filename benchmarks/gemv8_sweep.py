"""The 8-bit GEMVs (int8 = affine 8-bit g64, fp8 = mxfp8) on Llama-3-8B's batch-1 linear
shapes: launch variants alternated in one process, cycled weights in a CUDA graph (as a
decode step sees them: nothing stays in L2), min over reps; each variant's output checked
against the dequantized fp32 product.

    python3 benchmarks/gemv8_sweep.py [--formats mxfp8,affine8g64] [--variants old,s8w4p3]
        [--reps 3] [--json out.json]
    python3 benchmarks/gemv8_sweep.py --warm s8w4p3 [--shapes 2,3]  # compile one variant only

A variant is "old" (choose_config's one-shot GEMV), "new" (its pick with MLXRUN_GEMV8=stream),
"rules" (that pick without the per-linear table: MLXRUN_GEMV8_LAUNCH=none), "gBNwWsS[nopf]" (the one-shot GEMV:
BN rows, W warps, S splits, prefetch off), "sBNwWpP" (the streaming GEMV of
quant/triton_gemv_stream.py: P programs a SM, a trailing b: fewer where that gives every
program the same number of tiles), "cBNwWpP" (the same, mxfp8 decoded a word at a time) or
"aBNwWpP" (c with the next tile's words issued ahead, KernelConfig.ahead). The gate/up shape (28672x4096) runs with the
SiLU epilogue, as in the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import FORMATS, copy_bandwidth, make_weight  # noqa: E402

# by their share of a token's time (32 layers): gate/up, down, q/k/v, o, the head
SHAPES = [(28672, 4096, True), (4096, 14336, False), (6144, 4096, False), (4096, 4096, False),
          (128256, 4096, False)]  # fmt: skip


def config(name: str, m: int, w, device):
    """The KernelConfig of a variant name (None: choose_config's)."""
    from mlxrun.quant import triton_kernels as tk

    if name in ("old", "new", "rules"):  # choose_config: one-shot, its pick, without its table
        from mlxrun.quant import triton_launch

        saved = triton_launch.GEMV8, triton_launch.GEMV8_LAUNCH
        triton_launch.GEMV8 = "old" if name == "old" else "stream"
        if name == "rules":
            triton_launch.GEMV8_LAUNCH = {}
        try:
            return tk.choose_config(m, w, device, torch.bfloat16)
        finally:
            triton_launch.GEMV8, triton_launch.GEMV8_LAUNCH = saved
    try:
        return tk.launch_from_name(name)
    except ValueError:
        pass
    raise SystemExit(f"unknown variant {name!r}")


def sane(w):
    """No E4M3 NaN codes (0x7F, 0xFF: no quantizer writes them) in random mxfp8 words."""
    if w.mode == "mxfp8":
        u = w.weight.view(torch.uint8)
        u[(u & 0x7F) == 0x7F] -= 1
    return w


def run(x, w, cfg, silu):
    from mlxrun.quant import triton_kernels as tk

    return tk.qmatmul(x, w, cfg, silu=silu)


def graphed(fn, calls: int):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return g


def time_us(g, calls: int, reps: int = 5) -> float:
    g.replay()
    torch.cuda.synchronize()
    ev = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in ev)
    return ms[len(ms) // 2] * 1e3 / calls


def warm(variant: str, formats, shapes=SHAPES) -> None:
    """Compile a variant's kernels (small N, the real K and constexprs)."""
    for fmt in formats:
        mode, bits, g = FORMATS[fmt]
        for n, k, silu in shapes:
            nn = 256 if not silu else 512
            w = make_weight(nn, k, mode, bits, g)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            cfg = config(variant, 1, type("W", (), dict(n=n, k=k, bits=bits, group_size=g,
                                                        mode=mode))(), x.device)  # fmt: skip
            t = time.time()
            run(x, w, cfg, silu)
            torch.cuda.synchronize()
            print(f"warm {variant} {fmt} {n}x{k} {cfg} {time.time() - t:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="mxfp8,affine8g64")
    ap.add_argument("--variants", default="old")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--shapes", default="all", help="indices into SHAPES, e.g. 0,2")
    ap.add_argument("--warm", default=None, help="compile this variant only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    formats = a.formats.split(",")
    shapes = SHAPES if a.shapes == "all" else [SHAPES[int(i)] for i in a.shapes.split(",")]
    if a.warm:
        warm(a.warm, formats, shapes)
        return
    variants = a.variants.split(",")
    bw = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s (read + write)", flush=True)
    rows = []
    for n, k, silu in shapes:
        for fmt in formats:
            mode, bits, g = FORMATS[fmt]
            w0 = sane(make_weight(n, k, mode, bits, g))
            copies = max(2, math.ceil(400e6 / w0.nbytes))
            ws = [w0] + [sane(make_weight(n, k, mode, bits, g, seed=s)) for s in range(1, copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            from mlxrun.quant import triton_kernels as tk

            dense = tk.dequantize_torch(w0)
            ref = x.float() @ dense.T
            if silu:
                h = ref.shape[-1] // 2
                ref = torch.nn.functional.silu(ref[:, :h]) * ref[:, h:]
            del dense
            graphs, res = {}, {}
            for v in variants:
                cfg = config(v, 1, w0, x.device)
                y = run(x, w0, cfg, silu).float()
                err = ((y - ref).norm() / ref.norm()).item()
                fn = lambda i, c=cfg, x=x, ws=ws, nc=copies, s=silu: run(x, ws[i % nc], c, s)  # noqa: E731
                graphs[v] = graphed(fn, a.calls)
                res[v] = dict(cfg=str(cfg), err=err, us=[])
            for _ in range(a.reps):  # alternated
                for v in variants:
                    res[v]["us"].append(time_us(graphs[v], a.calls))
            line = [f"{fmt} {n}x{k}{' silu' if silu else ''} ({w0.nbytes / 1e6:.1f} MB)"]
            for v in variants:
                us = min(res[v]["us"])
                gbs = w0.nbytes / us / 1e3
                line.append(f"{v} {us:6.1f} us {gbs:5.0f} GB/s {100 * gbs / bw:3.0f}% "
                            f"err {res[v]['err']:.1e}")  # fmt: skip
                rows.append(dict(fmt=fmt, n=n, k=k, silu=silu, variant=v, bytes=w0.nbytes,
                                 copy_gbs=bw, **res[v]))  # fmt: skip
            print(" | ".join(line), flush=True)
            del graphs, ws, w0
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
