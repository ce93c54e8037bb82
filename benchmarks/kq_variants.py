"""A/B of the Q6_K lane GEMV's variants (MLXRUN_KQ_VARIANT, quant/triton_kquant.py) at batch
1 on CUDA, on Llama-3-8B's linear shapes, in one process: each variant's launch, alternated
and repeated, inside a CUDA graph that cycles through enough weight copies that nothing stays
in L2 (as profile_decode.py --linears times them). Every variant's output is first checked
against the fp32 product with the dequantized weight (rel_err: max error / max |y|; bf16
output rounding is ~4e-3).

    python3 benchmarks/kq_variants.py [--reps 3] [--json out.json]
    python3 benchmarks/kq_variants.py --warm old      # compile one variant's kernels only
    python3 benchmarks/kq_variants.py --kind Q6_K,Q4_K    # Q4_K too: old against xlane
    python3 benchmarks/kq_variants.py --kind Q4_K --warm xlane

Variants: old (x as [LANES, 2] pairs, 1 warp), xlane (_lane_x4's 1-D x loads and one uint16
scale load, 1 warp), new-w2 / new-w4 (xlane on 2 / 4 warps a program, lane_config's split
for that many); -rN: compiled with at most N registers a thread (MLXRUN_KQ_MAXNREG; r0:
Triton's choice; without -r, the default: 128 for Q6_K on one warp).
Q4_K: old against xlane (its scale loads in the lane layout: no shared-memory move of the
partial sums every k-step on several warps). --warm runs each launch once (Triton's on-disk cache then holds it): run
one --warm per variant in parallel before timing to spend less time compiling.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from profile_decode import _events_ms, _graphed  # noqa: E402

from mlxrun.quant import triton_kquant as kq  # noqa: E402
from mlxrun.quant import triton_launch as tch  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
VARIANTS = {
    "Q6_K": ["old", "xlane", "xlane-r0", "xlane-r96", "xlane-r112", "xlane-r144"],
    "Q4_K": ["old", "xlane"],  # xlane: the scale offsets opaque (no p conversion a k-step)
}


def config(name: str, w, x):
    """(MLXRUN_KQ_VARIANT value, KernelConfig) of a variant name."""
    env = name.split("-")[0]
    os.environ["MLXRUN_KQ_VARIANT"] = env
    cap = re.search(r"-r(\d+)$", name)  # -rN: at most N registers (0: Triton's choice)
    os.environ["MLXRUN_KQ_MAXNREG"] = cap.group(1) if cap else "0" if env == "old" else ""
    saved = tch.GEMV_WARPS
    if "-w2" in name:
        tch.GEMV_WARPS = 2
    try:
        cfg = kq.lane_config(1, w, x.device)
    finally:
        tch.GEMV_WARPS = saved
    return env, cfg


def run(x, w, name):
    env, cfg = config(name, w, x)
    os.environ["MLXRUN_KQ_VARIANT"] = env
    return kq.kqmatmul(x, w, cfg)


def registers(out) -> None:
    """Registers, spills, layout conversions and barriers of every lane GEMV this process
    compiled (this Triton, this GPU), printed; the TTGIR and SASS of the multi-warp ones
    for the first shape written to `out`, gzipped."""
    from mlxrun.quant import kquant_kernels as kk

    fn = kk._kq_lane_gemv_kernel
    for dev_cache in getattr(fn, "device_caches", {}).values():
        for i, ck in enumerate(dev_cache[0].values()):
            try:
                ck._init_handles()
                ttgir = ck.asm["ttgir"] if "ttgir" in ck.asm else ""
                try:
                    sass = ck.asm["sass"]
                except Exception:  # no disassembler here
                    sass = ""
                warps = ck.metadata.num_warps
                name = f"{os.getpid()}-{i}-w{warps}-r{ck.n_regs}"
                print(f"  lane GEMV {name}: {ck.n_regs} registers, {ck.n_spills} spilled, "
                      f"{ttgir.count('convert_layout')} convert_layout, {sass.count(' BAR')} "
                      f"BAR, {sass.count('STL')} STL, {sass.count('LDL')} LDL, "
                      f"{sass.count('LDG')} LDG", flush=True)  # fmt: skip
                if out and warps > 1 and i == 0:  # the first shape's, gzipped (~100 KB)
                    Path(out).mkdir(parents=True, exist_ok=True)
                    Path(out, f"{name}.ttgir.gz").write_bytes(gzip.compress(ttgir.encode()))
                    if sass:
                        Path(out, f"{name}.sass.gz").write_bytes(gzip.compress(sass.encode()))
            except Exception as e:
                print(f"  regs: {type(e).__name__} {str(e)[:120]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--warm", help="compile (run once) this variant's launches, then exit")
    ap.add_argument("--regs", help="write registers, spills, TTGIR and SASS of the "
                    "compiled lane GEMVs to this folder")  # fmt: skip
    ap.add_argument("--kind", default="Q6_K", help="kinds, comma-separated (Q6_K,Q4_K)")
    ap.add_argument("--dry", action="store_true",
                    help="check the script on the CPU (TRITON_INTERPRET=1): one tiny shape, "
                         "wall-clock times")  # fmt: skip
    a = ap.parse_args()
    dev = "cpu" if a.dry else "cuda"
    shapes = [(16, 2048)] if a.dry else SHAPES
    results = {}
    for kind, (n, k) in [(kd, sh) for kd in a.kind.split(",") for sh in shapes]:
        names = [a.warm] if a.warm else VARIANTS[kind]
        t0 = time.time()
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w0 = kq.random_kquant(kind, n, k, dev, 0)
        if a.warm:
            for nm in names:
                run(x, w0, nm)
            if not a.dry:
                torch.cuda.synchronize()
            print(f"warm {a.warm} {n}x{k} {time.time() - t0:.1f} s", flush=True)
            continue
        # every variant against the fp32 product with the dequantized weight (up to 512 rows)
        sel = torch.arange(0, n, max(1, n // 512), device=dev)
        ref = x.float() @ kq.dequantize_kquant(kq.rows(w0, sel)).T
        err = {}
        for nm in list(names):
            try:
                y = run(x, w0, nm).float()[:, sel]
            except Exception as e:  # a variant this Triton cannot build: time the others
                print(f"{kind} {n}x{k} {nm}: {type(e).__name__} {str(e)[:200]}", flush=True)
                names = [v for v in names if v != nm]
                continue
            err[nm] = ((y - ref).abs().max() / ref.abs().max()).item()
        copies = 2 if a.dry else max(2, math.ceil(400e6 / w0.nbytes))
        wq = [w0] + [kq.random_kquant(kind, n, k, dev, s) for s in range(1, copies)]
        times = {nm: [] for nm in names}
        for _ in range(a.reps):
            for nm in names:  # alternated: a drift in clocks hits every variant alike
                env, cfg = config(nm, w0, x)
                os.environ["MLXRUN_KQ_VARIANT"] = env
                if a.dry:
                    t1 = time.perf_counter()
                    kq.kqmatmul(x, wq[1], cfg)
                    times[nm].append((time.perf_counter() - t1) * 1e6)
                    continue
                rep = _graphed(
                    lambda i, c=cfg, x=x, wq=wq, nc=copies: kq.kqmatmul(x, wq[i % nc], c), 24
                )
                times[nm].append(_events_ms(rep) * 1e3 / 24)
        row = {}
        for nm in names:
            _, cfg = config(nm, w0, x)
            us = min(times[nm])
            row[nm] = dict(us=us, all_us=times[nm], gbs=w0.nbytes / us / 1e3, rel_err=err[nm],
                           warps=cfg.num_warps, split_k=cfg.split_k)  # fmt: skip
        results[f"{kind} {n}x{k}"] = row
        print(f"{kind} {n}x{k} ({w0.nbytes / 1e6:.1f} MB, {time.time() - t0:.1f} s): "
              + " | ".join(f"{nm} w{r['warps']} s{r['split_k']} {r['us']:.1f} us "
                           f"{r['gbs']:.0f} GB/s err {r['rel_err']:.1e}" for nm, r in row.items()),
              flush=True)  # fmt: skip
        if a.json:  # after every shape: a run cut short keeps what it measured
            Path(a.json).write_text(json.dumps(results, indent=1))
        del wq, w0
        if not a.dry:
            torch.cuda.empty_cache()
    if a.regs and not a.dry:
        try:
            registers(a.regs)
        except Exception as e:  # another Triton's kernel cache
            print(f"  regs: {type(e).__name__} {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
