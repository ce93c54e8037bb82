"""Offline SASS statistics of the K-quant GEMV (quant/triton_kquant.py) for sm_90, no GPU
needed: instructions of the k-loop per weight element, registers, spills.

    python benchmarks/sass_kquant.py                          # Q4_K, Q5_K, Q6_K; 1, 2, 4 warps
    python benchmarks/sass_kquant.py --kinds Q6_K --warps 2 --hist
    python benchmarks/sass_kquant.py --gemm                   # the tile GEMM at M=32

The GEMV is _kq_lane_gemv_kernel (the int4 GEMV's loop), compiled as sass_count.py compiles
the affine GEMV (pointers divisible by 16, PDL on), for a 4096 x (8192 x warps) weight (8
whole k-steps a program), 8 rows a program: a lane handles 4 low-nibble words (and their high bits) of each of
8 rows, 256 weights, a k-step; two k-steps a loop iteration.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mlxrun  # noqa: E402

# mlxrun.quant is this tree's quant/ (pyproject's package-dir): put first, else an editable
# install of another checkout (a Triton 3.6 venv's) supplies it and its kernels are compiled
mlxrun.__path__.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sass_count import compile_sm90, main_loop, opcode_histogram, parse, sass_of  # noqa: E402

import mlxrun.quant.kquant_kernels as kk  # noqa: E402
import mlxrun.quant.kquant_stream as kst  # noqa: E402
import mlxrun.quant.triton_kquant as kq  # noqa: E402

assert os.path.samefile(os.path.dirname(kq.__file__), os.path.join(mlxrun.__path__[0], "quant"))


def compile_gemv(kind: str, warps: int, n=4096, k=4096, x="bf16", silu=False, prefetch=True,
                 variant=1, maxnreg=0, halves=1, early=False, sce=False):  # fmt: skip
    fn = kk._kq_lane_gemv_kernel
    sw = kq._shapes(kind, n, k)["weight"][1]
    ks = k // (16 if kind == "Q6_K" else 32)
    ints = dict(N=n, KS=ks, stride_xm=k, stride_ym=n, stride_w=sw)
    ptrs = dict(x_ptr=f"*{x}", w_ptr="*i32", s_ptr="*i8" if kind == "Q6_K" else "*u8",
                b_ptr="*fp16", y_ptr=f"*{x}", part_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
    params = dict(M=1, KIND=kq.KINDS[kind], SPLIT_K=1, KB_PER_SPLIT=8, EVEN=True, KW=k // 8,
                  SW=sw, PDL=True, SILU=silu, WARPS=warps, PREFETCH=prefetch,
                  KSC=ks, V=variant, HALVES=halves, EARLY=early and not prefetch,
                  SCE=sce)  # fmt: skip
    opts = {"maxnreg": maxnreg} if maxnreg else {}
    return compile_sm90(fn, ptrs, params, ints, num_warps=warps, num_stages=1, **opts)


def compile_gemm(kind: str, bm: int, bn: int, warps: int, stages: int, n=4096, k=4096,
                 x="bf16", swap=True):  # fmt: skip
    """The tile GEMM (_kq_tile_gemm_kernel) as kqmatmul launches it at batch 32 (M=32)."""
    fn = kk._kq_tile_gemm_kernel
    sw = kq._shapes(kind, n, k)["weight"][1]
    ks = k // (16 if kind == "Q6_K" else 32)
    ints = dict(M=32, N=n, K=k, KS=ks, stride_xm=k, stride_ym=n, stride_wn=sw)
    ptrs = dict(x_ptr=f"*{x}", w_ptr="*i32", s_ptr="*i8" if kind == "Q6_K" else "*u8",
                b_ptr="*fp16", y_ptr=f"*{x}", part_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
    params = dict(KIND=kq.KINDS[kind], BLOCK_M=bm, BLOCK_N=bn, NG=8 if kind == "Q6_K" else 4,
                  SPLIT_K=1, KB_PER_SPLIT=32, GROUP_M=8, UPCAST=False, SWAP=swap, EVEN_N=True,
                  EVEN_K=True, PDL=True, HS=kind == "Q6_K" and kq.q6_spread())  # fmt: skip
    return compile_sm90(fn, ptrs, params, ints, num_warps=warps, num_stages=stages)


def compile_stream(kind: str, warps: int, n=28672, k=4096, x="bf16", silu=True):
    """The streaming GEMV (quant/kquant_stream.py) as lane_config launches it on the gate/up."""
    fn = kst._kq_stream_kernel
    sw = kq._shapes(kind, n, k)["weight"][1]
    ks = k // (16 if kind == "Q6_K" else 32)
    ints = dict(N=n, stride_xm=k, stride_ym=n)
    ptrs = dict(x_ptr=f"*{x}", w_ptr="*i32", s_ptr="*i8" if kind == "Q6_K" else "*u8",
                b_ptr="*fp16", y_ptr=f"*{x}")  # fmt: skip
    params = dict(
        KIND=kq.KINDS[kind],
        KSTEPS=k // 8 // (128 * warps),
        KW=k // 8,
        SW=sw,
        KSC=ks,
        PDL=True,
        SILU=silu,
        WARPS=warps,
        V=0 if kind == "Q4_K" and k <= 4096 else 1,
    )
    return compile_sm90(fn, ptrs, params, ints, num_warps=warps)


def report_gemm(kind: str, hist: bool) -> None:
    bm, bn, warps, stages = 32, 128, 8, 4  # tile_gemm_config at M=32, bf16
    sass, res = sass_of(compile_gemm(kind, bm, bn, warps, stages))
    body = main_loop(parse(sass))
    regs = re.search(r"REG:(\d+)", res).group(1)
    per = bn * 128 / (32 * warps)  # weights a thread decodes a k-step (128 of K)
    print(f"{kind} GEMM {bm}x{bn} swap, {warps} warps, {stages} stages: {len(body)} loop "
          f"instructions, {len(body) / per:.2f} a weight decoded, {regs} registers")  # fmt: skip
    if hist:
        print(" ", opcode_histogram(body))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--hist", action="store_true", help="print the loop's opcode histogram")
    ap.add_argument("--gemm", action="store_true", help="the tile GEMM at M=32 instead")
    ap.add_argument("--stream", action="store_true", help="the streaming GEMV (gate/up) instead")
    ap.add_argument("--variant", type=int, default=1, help="the GEMV's V (0: the old loads)")
    ap.add_argument("--maxnreg", type=int, default=0, help="register cap (0: none)")
    ap.add_argument("--prefetch", default="1,0", help="prefetch settings to compile")
    ap.add_argument("--rows", type=int, default=8, help="rows a program: 8 or 16 (no prefetch)")
    ap.add_argument("--early", action="store_true", help="first step's scales before the wait")
    ap.add_argument("--sce", action="store_true", help="scales loaded without masks (variant 9)")
    a = ap.parse_args()
    if a.gemm:
        for kind in a.kinds.split(","):
            report_gemm(kind, a.hist)
        return
    if a.stream:  # registers and spills (its loop is the tile loop: counted whole)
        for kind, warps in itertools.product(a.kinds.split(","), a.warps.split(",")):
            sass, res = sass_of(compile_stream(kind, int(warps)))
            regs = re.search(r"REG:(\d+)", res).group(1)
            spill = int(re.search(r"STACK:(\d+)", res).group(1)) + int(
                re.search(r"LOCAL:(\d+)", res).group(1)
            )
            n = len(parse(sass))
            print(f"{kind} stream, {warps} warps, gate/up 28672x4096 SiLU: {n} instructions, "
                  f"{regs} registers, {spill} B spilled")  # fmt: skip
        return
    runs = [(kd, int(wp)) for kd in a.kinds.split(",") for wp in a.warps.split(",")]
    pfs = [p == "1" for p in a.prefetch.split(",")]
    for (kind, warps), pf in itertools.product(runs, pfs):
        # 8 whole k-steps of 32 weights a lane: with KS a constant (KSC) the compiler sees
        # steps past K as masked, so K must hold them
        c = compile_gemv(kind, warps, k=8192 * warps, prefetch=pf, variant=a.variant,
                         maxnreg=a.maxnreg, halves=a.rows // 8, early=a.early,
                         sce=a.sce)  # fmt: skip
        sass, res = sass_of(c)
        body = main_loop(parse(sass))
        per_step = len(body) / (2 if pf else 1) / (a.rows // 8)  # a k-step of 8 rows
        regs = re.search(r"REG:(\d+)", res).group(1)
        spill = int(re.search(r"STACK:(\d+)", res).group(1)) + int(
            re.search(r"LOCAL:(\d+)", res).group(1)
        )
        mode = "" if pf else ", no prefetch"
        print(f"{kind} {a.rows} rows, {warps} warps{mode}: {len(body)} loop instructions, "
              f"{per_step / 256:.2f} a weight, {regs} registers, {spill} B spilled")  # fmt: skip
        if a.hist:
            print(" ", opcode_histogram(body))


if __name__ == "__main__":
    main()
