"""A/B timing of the K-quant lane GEMV's variants (MLXRUN_KQ_VARIANT) on one GPU, batch 1.

    python3 benchmarks/kq_ab.py --kinds Q6_K,Q4_K --variants 0,1,2,2w2 --reps 3
    python3 benchmarks/kq_ab.py --warm 2w2 --regs      # compile one variant, print registers
    TRITON_INTERPRET=1 python3 benchmarks/kq_ab.py --dry    # CPU: tiny shapes, no timing

For each kind and Llama-3-8B linear shape (qkv, o, gate+up, down, the head): random weights
in the kernels' layout (quant/kquant_layout.py random_kquant), enough copies to cycle past
the L2, one kqmatmul per copy captured in a CUDA graph and replayed; the variants alternate
within each repetition and the minimum is kept. A variant is MLXRUN_KQ_VARIANT's value, with
"wN" capping the warps a program at N (triton_launch.GEMV_WARPS) and "rN" the registers a
thread at N (every warp count; else the shipped cap), a final "p" the next k-step's words
loaded during this one (prefetch), "xF" the split-K of lane_config times F, "fN" N warps a
program whatever the shape (lane_config's warps; a launch sweep), "h" 16 rows a program. Each output is checked
against x @ the dequantized weight in fp32 (relative to its largest value).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import mlxrun.quant.triton_kquant as kq  # noqa: E402
import mlxrun.quant.triton_launch as tch  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
DRY_SHAPES = [(16, 2048), (24, 768)]


_MAXNREG = kq._maxnreg


def _set(variant: str) -> tuple[bool, float, int, bool]:
    """'2w2r128p': MLXRUN_KQ_VARIANT=2, at most 2 warps, at most 128 registers a thread,
    the next k-step's words in flight (prefetch); "x2" twice lane_config's split-K; "f2"
    two warps a program on every shape; "h" 16 rows a program (two halves of 8). Returns
    whether to prefetch, the split-K factor, the forced warps (0: lane_config's) and
    whether 16 rows are forced."""
    m = re.fullmatch(
        r"(\d)(?:w(\d+))?(?:f(\d+))?(?:r(\d+))?(p?)(h?)(?:x([\d.]+))?(?:s(\d+))?", variant
    )
    if m is None:
        raise SystemExit(
            f"variant {variant!r}: V[wWARPS][fWARPS][rREGS][p][h][xSPLITFACTOR][sSTREAM]"
        )
    os.environ["MLXRUN_KQ_VARIANT"] = m[1]
    os.environ["MLXRUN_KQ_STREAM"] = m[8] or "0"  # "s3": the stream, 3 programs a SM
    tch.GEMV_WARPS = int(m[2]) if m[2] else 4
    if m[4]:
        kq._maxnreg = lambda w, warps: {"maxnreg": int(m[4])}
    else:
        kq._maxnreg = _MAXNREG
    return m[5] == "p", float(m[7]) if m[7] else 1.0, int(m[3] or 0), m[6] == "h"


def _regs(out, label: str) -> None:
    """Registers and spills of every lane GEMV compiled in this process."""
    fn = kq.kk._kq_lane_gemv_kernel
    for caches in getattr(fn, "device_caches", {}).values():
        for k in caches[0].values():
            try:
                k._init_handles()
                nw = k.metadata.num_warps
                kind = {0: "Q4_K", 1: "Q5_K", 2: "Q6_K"}.get(k.src.constants.get("KIND"), "?")
            except Exception:  # noqa: BLE001 (the fields differ between Triton versions)
                nw, kind = "?", "?"
            line = f"[{label}] lane GEMV {kind} {nw} warps: {k.n_regs} registers, {k.n_spills} B spilled"
            print(line, file=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="Q6_K,Q4_K")
    ap.add_argument("--variants", default="0,1,2,2w2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warm", help="compile this variant only (every shape), then stop")
    ap.add_argument("--regs", action="store_true", help="print registers of the kernels built")
    ap.add_argument("--dry", action="store_true", help="tiny shapes, no graphs (CPU check)")
    ap.add_argument("--shapes", help="NxK,... instead of Llama-3-8B's five (e.g. 1024x4096)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.dry else "cuda")
    shapes = DRY_SHAPES if a.dry else SHAPES
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    variants = [a.warm] if a.warm else a.variants.split(",")
    results = []
    for kind in a.kinds.split(","):
        for n, k in shapes:
            w0 = kq.random_kquant(kind, n, k, dev, seed=1)
            copies = 1 if a.dry or a.warm else max(1, math.ceil((256 << 20) / w0.nbytes))
            ws = [w0] + [kq.random_kquant(kind, n, k, dev, seed=2 + i) for i in range(copies - 1)]
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16().to(dev)
            refs = {}  # by Q6_K's layout (hi_spread, variant 6): the same words read two ways
            row = {"kind": kind, "shape": f"{n}x{k}", "mb": w0.nbytes / 1e6, "runs": {}}
            graphs = {}
            for v in variants:
                pf, fs, fw, rows16 = _set(v)
                sp = kind == "Q6_K" and kq.q6_spread()
                w0, *_ = wv = [dataclasses.replace(wi, hi_spread=sp) for wi in ws]
                if sp not in refs:
                    refs[sp] = x.float() @ kq.dequantize_kquant(w0, torch.float32).T
                ref = refs[sp]
                cfg = kq.lane_config(1, w0, dev, fw)
                sk = max(1, round(cfg.split_k * fs))
                cfg = dataclasses.replace(cfg, prefetch=pf or cfg.prefetch, split_k=sk)
                if rows16:
                    cfg = dataclasses.replace(cfg, block_n=16)
                y = kq.kqmatmul(x, w0, cfg)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                row["runs"][v] = {
                    "rows": cfg.block_n,
                    "warps": cfg.num_warps,
                    "split": cfg.split_k,
                    "err": err,
                    "us": [],
                }
                if a.dry or a.warm:
                    continue
                for wi in wv:  # compiled and the split-K tickets touched before capture
                    kq.kqmatmul(x, wi, cfg)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for wi in wv:
                        kq.kqmatmul(x, wi, cfg)
                graphs[v] = g
            for _ in range(0 if a.dry or a.warm else a.reps):
                for v in variants:
                    g = graphs[v]
                    g.replay()
                    torch.cuda.synchronize()
                    reps = max(3, int(2e9 / (w0.nbytes * len(ws))))  # ~2 GB read a timing
                    t0, t1 = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    t0.record()
                    for _ in range(reps):
                        g.replay()
                    t1.record()
                    torch.cuda.synchronize()
                    row["runs"][v]["us"].append(t0.elapsed_time(t1) * 1e3 / (reps * len(ws)))
            del graphs, ws
            parts = []
            for v, r in row["runs"].items():
                t = min(r["us"]) if r["us"] else float("nan")
                gbs = w0.nbytes / t / 1e3 if r["us"] else float("nan")
                parts.append(f"v{v} w{r['warps']} s{r['split']} r{r['rows']} {t:.1f} us {gbs:.0f} GB/s "
                             f"err {r['err']:.1e}")  # fmt: skip
            print(f"{kind} {row['shape']} ({row['mb']:.1f} MB): " + " | ".join(parts), flush=True)
            results.append(row)
    if a.regs:
        _regs(sys.stdout, a.warm or a.variants)
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
