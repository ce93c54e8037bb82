"""Offline SASS statistics of the K-quant GEMV (quant/triton_kquant.py) for sm_90, no GPU
needed: instructions of the k-loop per weight element, registers, spills.

    python benchmarks/sass_kquant.py                         # Q4_K, Q5_K, Q6_K, default tiles
    python benchmarks/sass_kquant.py --kinds Q4_K --tiles 16x2,32x2 --hist

A tile is ROWSxSB (rows a program, super-blocks a k-step); 4 warps. Compiled as sass_count.py
compiles the affine GEMV (pointers divisible by 16, PDL on), for a 4096x4096 weight.
Q4_K runs its own GEMV (_q4k_gemv_kernel, the int4 GEMV's loop): counted as sass_count.py
counts that one, 8 rows a program, whole k-steps, --q4k-warps warps (a lane: 4 words of
each of 8 rows, 256 weights, a k-step; two k-steps a loop iteration).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from sass_count import main_loop, opcode_histogram, parse, sass_of  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import mlxrun.quant.triton_kquant as kq  # noqa: E402


def compile_gemv(kind: str, bn: int, sb: int, warps: int = 4, n=4096, k=4096, x="bf16"):
    fn = kq._kq_gemv_kernel
    ints = dict(N=n, KW=k // 8, KB=k // 256, stride_xm=k, stride_ym=n,
                stride_w=k // 8 + k * kq.HIGH_BITS[kind] // 32)  # fmt: skip
    ptrs = dict(x_ptr=f"*{x}", w_ptr="*i32", s_ptr="*i8" if kind == "Q6_K" else "*u8",
                b_ptr="*fp16", y_ptr=f"*{x}", part_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
    params = dict(KIND=kq.KINDS[kind], BLOCK_N=bn, SB=sb, SPLIT_K=1, KB_PER_SPLIT=8, PDL=True)
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ints:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "constexpr"
            consts[name] = params[name]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1}
    )


def compile_q4k(warps: int, n=4096, k=4096, x="bf16", silu=False):
    fn = kq._q4k_gemv_kernel
    ints = dict(N=n, KS=k // 32, stride_xm=k, stride_ym=n, stride_w=k // 8)
    ptrs = dict(x_ptr=f"*{x}", w_ptr="*i32", s_ptr="*u8", b_ptr="*fp16", y_ptr=f"*{x}",
                part_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
    params = dict(M=1, SPLIT_K=1, KB_PER_SPLIT=8, EVEN=True, KW=k // 8, PDL=True, SILU=silu,
                  WARPS=warps)  # fmt: skip
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ints:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "constexpr"
            consts[name] = params[name]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1}
    )


def report_q4k(warps: int, hist: bool) -> None:
    sass, res = sass_of(compile_q4k(warps))
    body = main_loop(parse(sass))
    per_step = len(body) / 2  # two k-steps an iteration
    regs = re.search(r"REG:(\d+)", res).group(1)
    spill = int(re.search(r"STACK:(\d+)", res).group(1)) + int(
        re.search(r"LOCAL:(\d+)", res).group(1)
    )
    print(f"Q4_K q4k-gemv 8 rows, {warps} warps: {len(body)} loop instructions, "
          f"{per_step / 256:.2f} a weight, {regs} registers, {spill} B spilled")  # fmt: skip
    if hist:
        print(" ", opcode_histogram(body))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--tiles", default="32x2")
    ap.add_argument("--hist", action="store_true", help="print the loop's opcode histogram")
    ap.add_argument("--q4k-warps", default="1,2,4", help="warps of the Q4_K GEMV builds")
    a = ap.parse_args()
    for kind in a.kinds.split(","):
        if kind == "Q4_K":
            for warps in a.q4k_warps.split(","):
                report_q4k(int(warps), a.hist)
            continue
        for tile in a.tiles.split(","):
            bn, sb = (int(v) for v in tile.split("x"))
            sass, res = sass_of(compile_gemv(kind, bn, sb))
            body = main_loop(parse(sass))
            per_thread = bn * 256 * sb / 128  # weights a thread handles each k-step
            regs = re.search(r"REG:(\d+)", res).group(1)
            spill = int(re.search(r"STACK:(\d+)", res).group(1)) + int(
                re.search(r"LOCAL:(\d+)", res).group(1)
            )
            print(f"{kind} {bn}x{sb}: {len(body)} loop instructions, "
                  f"{len(body) / per_thread:.2f} a weight, {regs} registers, {spill} B spilled")  # fmt: skip
            if a.hist:
                print(" ", opcode_histogram(body))


if __name__ == "__main__":
    main()
