"""The batched-decode GEMM (4 < M <= 64) under several launches, on one layer's linear shapes
and the head (Llama-3-8B by default), int4 g64: each launch timed alone, cycled weights in a
CUDA graph (nothing stays in L2 between calls, as in a decode step), launches alternated,
min over reps; every launch's output checked against x @ the dequantized weight first.

    python3 benchmarks/gemm_smallm.py [--m 32,64] [--reps 3] [--json out.json]
    python3 benchmarks/gemm_smallm.py --warm 128,4,4,2,1   # compile one launch's kernels only
    TRITON_INTERPRET=1 python3 benchmarks/gemm_smallm.py --dry   # CPU: small shapes, no timing

A launch is triton_launch.SMALL_M_GEMM's numbers, "BLOCK_N,warps,stages,groups,waves[,l2[,tma]]"
(the form MLXRUN_SMALL_M_GEMM takes): W rows a program, warps, pipeline stages, groups of G
inputs a k-step (at least 128 inputs), split-K to that many waves of programs, k-steps
of weights prefetched into L2 before the PDL wait (0: none), 1 for the words and x loaded by
TMA (triton_gemm_tma.py; 0 or left out: cp.async). The step
estimate is 32 x (the four layer shapes) + the head, as in an 8B decode step's GEMMs.
Two reference rows take the place of a launch: "gemv1", the batch-1 GEMV (choose_config's
launch for one row) on the same weights, and "copy", a device copy of as many bytes as the
weight holds (words, scales, biases; it reads and writes them, twice a GEMM's traffic),
both cycled the same way: what the batch-1 kernel reaches on the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profile_decode import _events_ms, _graphed  # noqa: E402  (this script's directory)

from mlxrun.quant import triton_kernels as tk  # noqa: E402
from mlxrun.quant import triton_launch as launch  # noqa: E402

# Llama-3-8B: q/k/v joint, o, gate/up joint, down, head ([N, K]); layers
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
LAYERS = 32
SPECS = [
    "128,4,4,2,1",  # shipped before 2026-11-26
    "128,4,4,2,2",  # two programs a SM (the split doubled)
    "128,4,3,2,3",
    "256,8,3,2,1",  # two warpgroups of 128 rows
    "256,8,4,2,1",
    "128,8,4,2,1",  # two warpgroups of 64 rows
    "64,4,4,2,2",  # 64-row tiles, twice the programs
    "64,4,3,4,2",
    "64,2,3,2,4",  # two warps: mma.sync (v2), not wgmma
    "128,4,3,4,1",  # 256 inputs a step: 128 contiguous bytes of each row
    "128,4,4,4,1",
    "128,4,6,2,1",  # a deeper pipeline
    "128,8,4,4,1",  # two warpgroups of 64 rows, 256 inputs a step (128 registers)
    "128,4,4,2,1,4",  # shipped, the first 4 k-steps into L2 before the PDL wait
    "128,4,4,2,1,8",
    "128,4,3,4,1,2",
]


def config_for(spec: str, m: int, w, sms: int):
    """The KernelConfig choose_config gives x [m, K] @ W^T under launch `spec` on `sms` SMs."""
    saved = launch.SMALL_M_GEMM, launch.SMALL_M_GEMM_64, launch._num_sms
    launch.SMALL_M_GEMM = launch.SMALL_M_GEMM_64 = launch._small_m_gemm(spec)
    launch._num_sms = lambda device: sms
    try:
        cfg = launch.choose_config(m, w, types.SimpleNamespace(type="cuda"), torch.bfloat16)
    finally:
        launch.SMALL_M_GEMM, launch.SMALL_M_GEMM_64, launch._num_sms = saved
    assert cfg.kernel == "gemm", cfg
    return cfg


REFS = ("gemv1", "copy")


def _ref_fn(spec: str, x, wq, cfg):
    """fn(i) for a launch, or for a reference row (x's first row through the GEMV; a copy of
    the weight's bytes, the copies cycled as the weights are)."""
    if spec == "gemv1":
        return lambda i: tk.qmatmul(x[:1], wq[i % len(wq)])
    if spec == "copy":
        bufs = [torch.empty(w.nbytes // 2, dtype=torch.int16, device=x.device) for w in wq]
        dst = torch.empty_like(bufs[0])
        return lambda i: dst.copy_(bufs[i % len(bufs)])
    return lambda i: tk.qmatmul(x, wq[i % len(wq)], cfg)


def make_weight(n, k, device, seed=0):
    """Random int4 g64 weight (bf16 scales and biases) in prepare's layout."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=gen, device=device)
    s = (torch.rand(n, k // 64, generator=gen, device=device) * 0.01 + 1e-3).to(torch.bfloat16)
    b = (-8 * s.float()).to(torch.bfloat16)
    return tk.prepare(w.to(torch.int32), s, b, "affine", 4, 64)


def rel_err(x, w, cfg, ref=None) -> float:
    """Max |ours - x @ W^T (fp32, dequantized)| / max |reference|."""
    if ref is None:
        ref = x.float() @ tk.dequantize_torch(w).float().T
    y = tk.qmatmul(x, w, cfg).float()
    return ((y - ref).abs().max() / ref.abs().max()).item()


def warm(spec: str, ms, shapes, sms: int) -> None:
    """Run every (shape, M) launch of `spec` once, so Triton's cache holds its kernels."""
    t0 = time.time()
    for n, k in shapes:
        w = make_weight(n, k, "cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            try:
                if spec == "gemv1":
                    tk.qmatmul(x[:1], w)
                else:
                    tk.qmatmul(x, w, config_for(spec, m, w, sms))
            except Exception as e:  # reported again by the timing run
                print(f"{spec} M={m} {n}x{k}: {type(e).__name__} {str(e)[:120]}")
        torch.cuda.synchronize()
    print(f"warm {spec}: {time.time() - t0:.1f} s")


def dry(specs, ms) -> None:
    """CPU (TRITON_INTERPRET=1): every launch's output on small shapes against the reference."""
    for n, k in [(256, 512), (128, 1024)]:
        w = make_weight(n, k, "cpu")
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for spec in specs:
                cfg = config_for(spec, m, w, 4)
                print(f"{n}x{k} M={m} {spec}: split {cfg.split_k} err {rel_err(x, w, cfg):.1e}")


def summary(res, ms, specs, weights, reps) -> None:
    """Per M: each launch's us per shape (min over reps), the step estimate, its ratio to
    the first launch, and the layer's GB/s of weight bytes."""
    for m in ms:
        print(f"M = {m}: us (min of {reps}) per shape " + " ".join(f"{n}x{k}" for n, k in SHAPES)
              + "; step = 32 layers + head, ms")  # fmt: skip
        base = None
        for spec in specs:
            t = [min(res.get(f"{spec}|{m}|{n}x{k}", [math.inf])) for n, k in SHAPES]
            step = (LAYERS * sum(t[:4]) + t[4]) / 1e3
            base = base or step
            gbs = sum(weights[s][0].nbytes for s in SHAPES[:4]) / sum(t[:4]) / 1e3
            print(f"  {spec:<14} " + " ".join(f"{u:7.1f}" for u in t)
                  + f"  step {step:6.3f} ms ({step / base:5.3f}x)  layer {gbs:5.0f} GB/s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="32,64")
    ap.add_argument("--specs", default=";".join(SPECS),
                    help="launches, ';'-separated (and the reference rows gemv1, copy)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=24, help="calls a graph")
    ap.add_argument("--warm", default=None, help="compile this launch's kernels only")
    ap.add_argument("--dry", action="store_true", help="CPU interpreter check, no timing")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ms = [int(m) for m in a.m.split(",")]
    specs = a.specs.split(";")
    if a.dry:
        dry([s for s in specs if s not in REFS][:4], ms)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if a.warm:
        warm(a.warm, ms, SHAPES, sms)
        return
    print(torch.cuda.get_device_name(), "triton", tk.triton.__version__, "SMs", sms)
    res: dict = {}  # (spec, m, shape) -> [us, ...]
    errs: dict = {}
    weights, xs = {}, {}
    for n, k in SHAPES:
        w0 = make_weight(n, k, "cuda")
        copies = max(2, math.ceil(400e6 / w0.nbytes))
        weights[n, k] = [w0] + [make_weight(n, k, "cuda", s) for s in range(1, copies)]
        for m in ms:
            xs[m, k] = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = xs[m, k].float() @ tk.dequantize_torch(w0).float().T
            for spec in specs:
                if spec == "copy":
                    errs[spec, m, n, k] = 0.0
                    continue
                if spec == "gemv1":  # x's first row through the batch-1 GEMV
                    y = tk.qmatmul(xs[m, k][:1], w0).float()
                    errs[spec, m, n, k] = ((y - ref[:1]).abs().max() / ref[:1].abs().max()).item()
                    continue
                cfg = config_for(spec, m, w0, sms)
                try:
                    errs[spec, m, n, k] = rel_err(xs[m, k], w0, cfg, ref)
                except Exception as e:  # e.g. more shared memory than an SM has
                    print(f"{spec} M={m} {n}x{k}: {type(e).__name__} {str(e)[:120]}")
                    errs[spec, m, n, k] = float("inf")
            del ref
    bad = {key: e for key, e in errs.items() if not e < 1e-2}
    print(f"checked {len(errs)} launches against the dequantized weight: "
          f"max rel err {max(errs.values()):.1e}, {len(bad)} over 1e-2 {list(bad)[:4]}")  # fmt: skip
    t0 = time.time()
    for rep in range(a.reps):
        for n, k in SHAPES:
            wq = weights[n, k]
            for m in ms:
                x = xs[m, k]
                for spec in specs if rep % 2 == 0 else specs[::-1]:
                    if errs[spec, m, n, k] == float("inf") or (spec in REFS and m != ms[0]):
                        continue  # (a reference row does not depend on M)
                    cfg = None if spec in REFS else config_for(spec, m, wq[0], sms)
                    rep_fn = _graphed(_ref_fn(spec, x, wq, cfg), a.calls)
                    us = _events_ms(rep_fn, reps=10) * 1e3 / a.calls
                    res.setdefault(f"{spec}|{m}|{n}x{k}", []).append(us)
        print(f"rep {rep} done at {time.time() - t0:.0f} s", flush=True)
        summary(res, ms, specs, weights, rep + 1)
        if a.json:  # after every rep: a timeout keeps what was measured
            with open(a.json + ".tmp", "w") as f:
                json.dump(
                    {"us": res, "err": {"|".join(map(str, k)): v for k, v in errs.items()}}, f
                )
            os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
