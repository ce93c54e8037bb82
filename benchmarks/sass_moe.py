"""Offline SASS statistics of the MoE expert kernels (backends/cuda_moe.py), no GPU needed:
registers, spills and instructions per weight of the k-loop, for sm_90 (H100), of the packed
kernel `_moe_qgemv` (as moe_experts launches it) and the per-slot `_moe_gemv` it replaces.

    python benchmarks/sass_moe.py                          # gpt-oss-20b / qwen3-30b-a3b shapes
    python benchmarks/sass_moe.py --fmt mxfp4 --dump /tmp/moe.sass
    python benchmarks/sass_moe.py --fused --no-old       # down summing the slots itself

Compiled with triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) as
sass_count.py does for the dense GEMV (pointers 16-byte aligned, ints as the launcher
specialises them). The loop is read from a build with 8 k-steps (prefetch: 2 a trip).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from kernels import FORMATS  # noqa: E402
from sass_count import compile_sm90, main_loop, parse, sass_of  # noqa: E402

import mlxrun.backends.cuda_moe as cm  # noqa: E402

# name -> (N outputs of one expert, K inputs, gated) of each launch
SHAPES = {
    "gpt-oss-20b": {"gate_up": (2880, 2880, True), "down": (2880, 2880, False)},
    "qwen3-30b-a3b": {"gate_up": (768, 2048, True), "down": (2048, 768, False)},
}


def _compile(fn, ptrs, ints, consts, warps):
    # the constexprs not given (PDL and other switches) off
    cx = {n: consts.get(n, False) for n in fn.arg_names if n not in ptrs and n not in ints}
    return compile_sm90(fn, ptrs, cx, ints, num_warps=warps, num_stages=1)


def _stats(kernel, elems_per_step, unroll):
    sass, res = sass_of(kernel)
    body = main_loop(parse(sass))
    import re  # noqa: PLC0415

    regs = int(re.search(r"REG:(\d+)", res).group(1))
    spill = int(re.search(r"STACK:(\d+)", res).group(1)) + int(
        re.search(r"LOCAL:(\d+)", res).group(1)
    )
    per_step = len(body) / unroll
    return regs, spill, per_step, per_step / elems_per_step


def packed(fmt, n, k, gated, kstep_override=8, fused=False, top_k=8):
    mode, bits, g = FORMATS[fmt]
    from types import SimpleNamespace  # noqa: PLC0415

    p = SimpleNamespace(w=SimpleNamespace(mode=mode, bits=bits, group_size=g), n=n, k=k,
                        gated=gated)  # fmt: skip
    cfg = cm.choose_qconfig(p)
    kw = k * bits // 32
    step = 128 * cfg.warps
    ksteps = math.ceil(kw / step)
    per_prog = cfg.block_n // 2 if gated else cfg.block_n
    even = n % per_prog == 0 and kw % step == 0
    sdt = "bf16" if mode == "affine" else "u8"
    ptrs = dict(X="*bf16", IDS="*i32", OUT="*bf16" if gated else "*fp32", RW="*fp32",
                W="*i32", S=f"*{sdt}", B=f"*{sdt}", BIAS1="*bf16", BIAS2="*bf16")  # fmt: skip
    ints = dict(N=n, K=k, X_DIV=4 if gated else 1, limit=7.0, alpha=1.702)
    extra = {}  # cuda_moe.FUSED: down sums the token's slots (_slot_sum)
    if fused and not gated:
        ptrs.update(PART="*fp32", CNT="*i32")
        extra = dict(TOP_K=top_k)
    out = []
    for ks in (ksteps, kstep_override):
        consts = dict(MODE=cm._MODE_ID[mode], BITS=bits, G=g, GATED=gated, ACT=0,
                      HAS_BIAS=False, SCALED=not gated, BLOCK_N=cfg.block_n, KSTEPS=ks,
                      PREFETCH=cfg.prefetch, EVEN=even, KWC=kw if even else 0,
                      WARPS=cfg.warps, PDL=True, **extra)  # fmt: skip
        out.append(_compile(cm._moe_qgemv, ptrs, ints, consts, cfg.warps))
    # weights a lane decodes per k-step: block_n rows x 4 words x (32 / bits)
    elems = cfg.block_n * 4 * (32 // bits)
    regs, spill, _, _ = _stats(out[0], elems, 1)
    _, _, per_step, per_elem = _stats(out[1], elems, 2 if cfg.prefetch else 1)
    return cfg, ksteps, regs, spill, per_step, per_elem


def old(fmt, n, k, gated):
    mode, bits, g = FORMATS[fmt]
    sdt = "bf16" if mode == "affine" else "u8"
    ptrs = dict(X="*bf16", IDS="*i32", OUT="*bf16" if gated else "*fp32", RW="*fp32",
                W1="*i32", S1=f"*{sdt}", B1=f"*{sdt}", BIAS1="*bf16", W2="*i32", S2=f"*{sdt}",
                B2=f"*{sdt}", BIAS2="*bf16")  # fmt: skip
    ints = dict(N=n, K=k, X_DIV=4 if gated else 1, limit=7.0, alpha=1.702)
    consts = dict(MODE={"affine": 1, "mxfp4": 2, "nvfp4": 3, "mxfp8": 4}[mode], BITS=bits, G=g,
                  GATED=gated, ACT=0, HAS_BIAS=False, SCALED=not gated, BLOCK_N=16, BW=32)  # fmt: skip
    kern = _compile(cm._moe_gemv, ptrs, ints, consts, 4)
    # a program's k-step: 16 rows x 32 words x (32 / bits) values over 128 lanes
    elems = 16 * 32 * (32 // bits) * (2 if gated else 1) / 128
    return _stats(kern, elems, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--fmt", default="affine4g64,mxfp4,nvfp4,mxfp8,affine8g64")
    ap.add_argument("--shape", default=",".join(SHAPES))
    ap.add_argument("--no-old", action="store_true", help="skip the per-slot kernel")
    ap.add_argument("--fused", action="store_true",
                    help="down as cuda_moe.FUSED launches it (summing the slots)")  # fmt: skip
    a = ap.parse_args()
    print(f"sm_90, triton {triton.__version__}; /elem: loop instructions per weight a lane")
    for shape in a.shape.split(","):
        for launch, (n, k, gated) in SHAPES[shape].items():
            for fmt in a.fmt.split(","):
                top_k = 4 if shape == "gpt-oss-20b" else 8
                cfg, ks, regs, spill, per_step, per_elem = packed(fmt, n, k, gated, 8, a.fused,
                                                                  top_k)  # fmt: skip
                line = (f"{shape:<14} {launch:<8} {fmt:<11} packed: w{cfg.warps} bn{cfg.block_n}"
                        f"{' pf' if cfg.prefetch else '   '} ksteps {ks:2d} regs {regs:3d} "
                        f"spill {spill:4d} /kstep {per_step:6.1f} /elem {per_elem:5.2f}")  # fmt: skip
                if not a.no_old:
                    oregs, ospill, _, oper = old(fmt, n, k, gated)
                    line += f" | per-slot: regs {oregs:3d} spill {ospill:4d} /elem {oper:5.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
