"""Offline SASS statistics of the tensor-core GEMM kernel (no GPU needed): instructions per
k-step of the main loop, per weight element, registers and spills, for sm_90 (H100).

    python benchmarks/sass_gemm.py                    # M=32 swap config, 4096x4096
    python benchmarks/sass_gemm.py --m 2048           # prefill config (128x128 tiles)
    python benchmarks/sass_gemm.py --fmt affine4g64 --dump /tmp/g.sass --hist

Builds the cubin with triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) using
the launch parameters qmatmul picks on an H100 (choose_config with 132 SMs, bf16 x) and the
specialisations Triton's launcher applies (pointers and multiple-of-16 ints divisible by 16),
then disassembles it with the cuobjdump shipped with Triton. The main loop is the largest
backward-branch range; per k-step = its instruction count (the k-loop is not unrolled);
per element = per k-step / (BLOCK_N * BK / threads), i.e. per weight element per thread;
stack = spill space (bytes per thread), STL/LDL = spill stores + loads inside the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import re
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

# the SASS reading is the GEMV script's (benchmarks/ is this script's directory)
from sass_count import FORMATS, compile_sm90, main_loop, opcode_histogram, parse, sass_of  # noqa: E402

import mlxrun.quant.triton_launch as launch  # noqa: E402

DEFAULT = ["affine4g64", "affine4g32", "mxfp4", "mxfp8"]


def gemm_params(tk, mode, bits, g, n, k, m, sms=132):
    """(constexprs, KernelConfig) as qmatmul would launch the GEMM on a GPU with `sms` SMs."""
    import torch

    w = types.SimpleNamespace(n=n, k=k, bits=bits, group_size=g, mode=mode)
    # choose_config reads the SM count through triton_launch's own name
    saved = launch._num_sms
    launch._num_sms = lambda device: sms
    try:
        cfg = tk.choose_config(m, w, types.SimpleNamespace(type="cuda"), torch.bfloat16)
    finally:
        launch._num_sms = saved
    assert cfg.kernel == "gemm", cfg
    ksteps = math.ceil(k / (cfg.ng * g))
    per = math.ceil(ksteps / cfg.split_k)
    split = math.ceil(ksteps / per)
    params = dict(
        MODE=tk._MODE_ID[mode],
        BITS=bits,
        G=g,
        BLOCK_N=cfg.block_n,
        SPLIT_K=split,
        KB_PER_SPLIT=per,
        BLOCK_M=cfg.block_m,
        NG=cfg.ng,
        GROUP_M=cfg.group_m,
        UPCAST=False,
        SWAP=cfg.swap,
    )
    if "PACKED" in tk._gemm_kernel.arg_names:  # bf16 x and bf16 scales, as compiled here
        params["PACKED"] = bits == 4 or mode != "affine"  # affine8 keeps the old path
    if "EVEN_K" in tk._gemm_kernel.arg_names:
        params["EVEN_N"] = n % cfg.block_n == 0
        params["EVEN_K"] = k % (cfg.ng * g) == 0 and ksteps % per == 0
    if "PDL" in tk._gemm_kernel.arg_names:
        params["PDL"] = True  # as launched on an H100 (Triton 3.3+)
    if "L2_PF" in tk._gemm_kernel.arg_names:
        params["L2_PF"] = min(cfg.l2_prefetch, per)
    return params, cfg


def compile_gemm(tk, params, cfg, n, k, m, x_dtype="bf16"):
    fn = tk._gemm_kernel
    ints = {"M": m, "N": n, "K": k, "stride_xm": k, "stride_ym": n,
            "stride_wn": k * params["BITS"] // 32}  # fmt: skip
    sdt = "bf16" if params["MODE"] == 0 else "u8"
    ptr_types = {"x_ptr": f"*{x_dtype}", "w_ptr": "*i32", "s_ptr": f"*{sdt}",
                 "b_ptr": f"*{sdt}", "y_ptr": f"*{x_dtype}", "part_ptr": "*fp32",
                 "cnt_ptr": "*i32"}  # fmt: skip
    return compile_sm90(fn, ptr_types, params, ints, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)  # fmt: skip


def stats(tk, name, n, k, m, dump=None, hist=False, extra=None):
    mode, bits, g = FORMATS[name]
    params, cfg = gemm_params(tk, mode, bits, g, n, k, m)
    extra = dict(extra or {})
    if "num_warps" in extra:  # a launch option, not a constexpr
        cfg = dataclasses.replace(cfg, num_warps=extra.pop("num_warps"))
    params.update(extra)
    kern = compile_gemm(tk, params, cfg, n, k, m)
    sass, res = sass_of(kern)
    if dump:
        with open(dump, "w") as f:
            f.write(sass)
        with open(dump + ".ttgir", "w") as f:
            f.write(kern.asm["ttgir"])
        with open(dump + ".ptx", "w") as f:
            f.write(kern.asm["ptx"])
    body = main_loop(parse(sass))
    bk = params["NG"] * g
    elems = params["BLOCK_N"] * bk / (32 * cfg.num_warps)  # weight elements per thread per step
    row = dict(
        fmt=name,
        tile=f"{params['BLOCK_M']}x{params['BLOCK_N']}x{bk}{' swap' if params['SWAP'] else ''}",
        split=params["SPLIT_K"],
        loop=len(body),
        per_elem=len(body) / elems,
        regs=int(re.search(r"REG:(\d+)", res).group(1)),
        stack=int(re.search(r"STACK:(\d+)", res).group(1)),  # spill space, bytes per thread
        spills=sum(1 for _, t in body if re.match(r"(@\S+ )?(STL|LDL)\b", t)),  # in the loop
        smem=kern.metadata.shared,  # bytes a program (the pipeline's stages)
    )
    # programs a SM can hold: 64K registers, 228 KB of shared memory (1 KB of it per block
    # reserved), at most 32 blocks
    threads = 32 * cfg.num_warps
    by_regs = 65536 // (-(-row["regs"] * 32 // 256) * 256 * cfg.num_warps)
    by_smem = 233472 // (row["smem"] + 1024) if row["smem"] else 32
    row["per_sm"] = min(by_regs, by_smem, 32, 2048 // threads)
    if hist:
        row["hist"] = opcode_histogram(body)
    return row


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--fmt", default=",".join(DEFAULT), help="comma-separated: " + ",".join(FORMATS)
    )
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--module", default="mlxrun.quant.triton_kernels", help="kernel module")
    ap.add_argument("--dump", default=None, help="write SASS (+ .ttgir, .ptx) of the last format")
    ap.add_argument("--hist", action="store_true", help="opcode histogram of the loop body")
    ap.add_argument(
        "--const",
        action="append",
        default=[],
        help="NAME=INT constexpr override, e.g. PACKED=0 (the fp32 per-element path), "
        "BLOCK_N=256, num_warps=8",
    )
    a = ap.parse_args()
    extra = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in a.const}
    extra = {k: bool(v) if k in ("PACKED", "EVEN_N", "EVEN_K") else v for k, v in extra.items()}
    tk = importlib.import_module(a.module)
    print(f"N={a.n} K={a.k} M={a.m}, sm_90, triton {triton.__version__}")
    print(f"{'format':<12} {'tile':<18} {'split':>5} {'loop/kstep':>10} {'/elem':>6} "
          f"{'regs':>5} {'stack':>5} {'STL/LDL':>7} {'smem KB':>7} {'per SM':>6}")  # fmt: skip
    for name in a.fmt.split(","):
        r = stats(tk, name, a.n, a.k, a.m, a.dump, a.hist, extra)
        print(f"{r['fmt']:<12} {r['tile']:<18} {r['split']:>5} {r['loop']:>10} "
              f"{r['per_elem']:>6.2f} {r['regs']:>5} {r['stack']:>5} {r['spills']:>7} "
              f"{r['smem'] / 1024:>7.1f} {r['per_sm']:>6}")  # fmt: skip
        if a.hist:
            print("   ", " ".join(f"{k}:{v}" for k, v in r["hist"].items()))


if __name__ == "__main__":
    main()
