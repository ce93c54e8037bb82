"""Offline sm_90 SASS statistics of the streaming 8-bit GEMV (quant/triton_gemv_stream.py):
registers, spills, instructions of the tile loop and its opcode histogram, per launch
variant (no GPU needed; the Triton on the path decides: the H100 runs 3.6).

    python benchmarks/sass_gemv8.py                    # mxfp8 and int8 at the 8B shapes' K
    python benchmarks/sass_gemv8.py --variants c16w4,s8w4 --k 4096 --hist

A variant is sBNwW (E4M3 decoded a k-step's tile at once, as the one-shot GEMV does),
cBNwW (a word at a time in PTX; the int8 (affine 8-bit g64) kernel is the same for both) or
aBNwW (c, with the next tile's loads issued ahead: KernelConfig.ahead).
The "loop" is the tile loop (all k-steps of a tile unrolled), prologue and epilogue outside.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton  # noqa: E402
from sass_count import compile_sm90, main_loop, opcode_histogram, parse, sass_of  # noqa: E402

import mlxrun.quant.triton_kernels as tk  # noqa: E402

FORMATS = {"mxfp8": ("mxfp8", 8, 32), "int8": ("affine", 8, 64), "nvfp4": ("nvfp4", 4, 16)}


def compile_stream(mode, bits, g, bn, warps, k, silu=False, cvt=0, ahead=False):
    """The cubin qmatmul launches on an H100 for this variant (pointers and the
    multiple-of-16 ints specialised as Triton's launcher does)."""
    fn = tk._gemv_stream_kernel
    kw = k * bits // 32
    consts = dict(MODE=tk._MODE_ID[mode], BITS=bits, G=g, BLOCK_N=bn,
                  KSTEPS=kw // (128 * warps), KW=kw, PDL=True, SILU=silu, WARPS=warps,
                  CVT=cvt, AHEAD=ahead)  # fmt: skip
    sdt = "*bf16" if mode == "affine" else "*u8"
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": sdt, "b_ptr": sdt, "y_ptr": "*bf16"}
    # N, K, strides: multiples of 16 at the 8B shapes
    return compile_sm90(fn, ptrs, consts, other_int=16, num_warps=warps, num_stages=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="mxfp8,int8")
    ap.add_argument("--variants", default="s8w4,c8w4,s16w4,c16w4,c8w2")
    ap.add_argument("--k", default="4096,14336")
    ap.add_argument("--silu", action="store_true", help="with the SiLU epilogue")
    ap.add_argument("--hist", action="store_true")
    a = ap.parse_args()
    print(f"sm_90, triton {triton.__version__}; instructions a weight = loop / (BN * 16 "
          f"bytes * weights a byte * k-steps): a lane's share")  # fmt: skip
    for fmt in a.formats.split(","):
        mode, bits, g = FORMATS[fmt]
        for v in a.variants.split(","):
            mt = re.fullmatch(r"(s|c|a)(\d+)w(\d+)", v)
            if not mt:
                raise SystemExit(f"unknown variant {v!r}")
            if fmt != "mxfp8" and mt[1] == "c":
                continue  # the same kernel as s
            bn, warps = int(mt[2]), int(mt[3])
            for k in (int(s) for s in a.k.split(",")):
                cvt = 2 * (mt[1] != "s" and fmt == "mxfp8")
                kern = compile_stream(mode, bits, g, bn, warps, k, a.silu, cvt, mt[1] == "a")
                sass, res = sass_of(kern)
                regs = int(re.search(r"REG:(\d+)", res).group(1))
                spill = sum(int(re.search(rf"{f}:(\d+)", res).group(1)) for f in ("STACK", "LOCAL"))
                body = main_loop(parse(sass))
                ksteps = k * bits // 32 // (128 * warps)
                per = len(body) / (bn * 16 * 8 // bits * ksteps)  # 16 bytes a lane a row
                print(f"{fmt:<6} {v:<6} K={k:<6} regs {regs:3d} spill {spill:4d} B  loop "
                      f"{len(body):5d} ({ksteps} k-steps, {per:.2f} a weight)")  # fmt: skip
                if a.hist:
                    print("   ", " ".join(f"{o}:{n}" for o, n in opcode_histogram(body).items()))


if __name__ == "__main__":
    main()
