"""Offline SASS statistics of the GEMV kernel (no GPU needed): instructions per k-step of the
main loop, per weight element, registers and spills, for sm_90 (H100).

    python benchmarks/sass_count.py                       # default formats, 4096x4096, M=1
    python benchmarks/sass_count.py --fmt affine4g64 --dump /tmp/a.sass   # keep the SASS

Builds the cubin with triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) using
the launch parameters qmatmul would pick on an H100 (choose_config with 132 SMs) and the
specialisations Triton's launcher applies there (pointers and multiple-of-16 ints divisible
by 16, M == 1 a constant), then disassembles it with the cuobjdump shipped with Triton.
The main loop is the body between the loop's label and its backward branch; per k-step =
its instruction count / k-steps per iteration (1, or KSTEP_UNROLL where the kernel has it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

# name -> (mode, bits, group size), the kernel benchmark's table
from kernels import FORMATS  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import mlxrun.quant.triton_kernels as tk  # noqa: E402
import mlxrun.quant.triton_launch as launch  # noqa: E402

DEFAULT = ["affine4g64", "affine4g32", "affine4g128", "mxfp4", "nvfp4", "mxfp8", "affine8g64"]


def gemv_params(mode, bits, g, n, k, m=1, sms=132, kb_per_split=None, block_n=None, seq=False):
    """(constexprs, KernelConfig) as qmatmul would launch them on a GPU with `sms` SMs."""
    w = types.SimpleNamespace(n=n, k=k, bits=bits, group_size=g, mode=mode)
    # choose_config reads the SM count through triton_launch's own name
    saved = launch._num_sms
    launch._num_sms = lambda device: sms
    try:
        cfg = tk.choose_config(m, w, types.SimpleNamespace(type="cuda"))
    finally:
        launch._num_sms = saved
    if block_n:
        cfg = dataclasses.replace(cfg, block_n=block_n)
    if seq:
        cfg = dataclasses.replace(cfg, seq=True)
    params = dict(tk._gemv_constexprs(w, cfg), PDL=True)  # as launched on an H100 (Triton 3.3+)
    if kb_per_split is not None:
        params["KB_PER_SPLIT"] = kb_per_split
    return params, cfg


def compile_sm90(fn, ptrs, consts, ints=None, other_int=None, **options):
    """The cubin of Triton kernel `fn` for sm_90 (H100), its arguments specialised as Triton's
    launcher specialises them there: `ptrs` (name -> "*bf16"...) 16-byte aligned; `ints`
    (name -> its value at the compiled shape): a float an fp32, 1 a constant, an int that is a
    multiple of 16 divisible by 16; `consts` the constexprs (names fn does not take are left
    out); any other argument an int of value `other_int` (None: every one must be named)."""
    ints = ints or {}
    sig, cx, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        if name in consts and name not in ints:
            sig[name], cx[name] = "constexpr", consts[name]
            continue
        v = ints[name] if name in ints else other_int
        if v is None:
            raise KeyError(f"{fn.__name__}: no value for argument {name!r}")
        if isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:  # the launcher specialises 1 as a constant
            sig[name], cx[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


BIAS = False  # --bias: compile the GEMV with its bias epilogue (HAS_BIAS)


def compile_gemv(params, n, k, m=1, x_dtype="bf16", scale_dtype=None):
    ints = {
        "M": m,
        "N": n,
        "K": k,
        "stride_xm": k,
        "stride_ym": n,
        "stride_wn": k * params["BITS"] // 32,
    }
    mode = params["MODE"]
    sdt = scale_dtype or ("bf16" if mode == 0 else "u8")
    ptr_types = {
        "x_ptr": f"*{x_dtype}",
        "w_ptr": "*i32",
        "s_ptr": f"*{sdt}",
        "b_ptr": f"*{sdt}",
        "y_ptr": f"*{x_dtype}",
        "part_ptr": "*fp32",
        "cnt_ptr": "*i32",
        "bias_ptr": f"*{x_dtype}",
    }
    params = {"HAS_BIAS": BIAS, **params}  # the bias epilogue (--bias)
    return compile_sm90(
        tk._gemv_kernel, ptr_types, params, ints, num_warps=params.get("WARPS", 1), num_stages=1
    )


def sass_of(kernel) -> tuple[str, str]:
    """(SASS text, resource usage text) of a compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    try:
        out = []
        for flag in ("-sass", "-res-usage"):
            run = subprocess.run([tool, flag, path], capture_output=True, text=True, check=True)
            out.append(run.stdout)
        return out[0], out[1]
    finally:
        os.unlink(path)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def parse(sass: str):
    """[(address, text)] of the instructions, in order."""
    out = []
    for line in sass.splitlines():
        mt = _INSTR.search(line)
        if mt:
            out.append((int(mt.group(1), 16), mt.group(2).strip()))
    return out


def main_loop(instrs):
    """The largest backward-branch range [target, branch] (the k-loop): its instructions."""
    best = None
    for idx, (addr, txt) in enumerate(instrs):
        if "BRA" not in txt:
            continue
        tgt = re.search(r"0x([0-9a-f]+)", txt)
        if not tgt:
            continue
        t = int(tgt.group(1), 16)
        if t <= addr:
            start = next(j for j, (a, _) in enumerate(instrs) if a >= t)
            body = instrs[start : idx + 1]
            if best is None or len(body) > len(best):
                best = body
    return best or []


def opcode_histogram(body):
    hist = {}
    for _, txt in body:
        op = txt.split()[0]
        if op.startswith("@"):
            op = txt.split()[1]
        op = op.split(".")[0]
        hist[op] = hist.get(op, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: -kv[1]))


def stats(
    name, n=4096, k=4096, m=1, kb_per_split=None, dump=None, hist=False, block_n=None, seq=False
):
    """Registers/spills of the default launch; the loop is read from a build with 8 k-steps
    per split (a default of 2-3 k-steps can leave no loop: prefetch runs 2 steps/iteration)."""
    mode, bits, g = FORMATS[name]
    params, cfg = gemv_params(mode, bits, g, n, k, m, block_n=block_n, seq=seq)
    sass, res = sass_of(compile_gemv(params, n, k, m))
    lparams = dict(params, KB_PER_SPLIT=kb_per_split or 8)
    lparams["PREFETCH"] = cfg.prefetch
    lsass, lres = sass_of(compile_gemv(lparams, n, k, m))
    if dump:
        with open(dump, "w") as f:
            f.write(lsass)
    body = main_loop(parse(lsass))
    # k-steps per loop iteration: the prefetching (and the early-scales) loop runs two
    unroll = 2 if lparams["PREFETCH"] or (lparams.get("EARLY") and lparams["MODE"] != 3) else 1
    block_n = params["BLOCK_N"]
    # weight elements per lane per k-step (one warp of 32 lanes per program)
    elems = block_n * 128 * (32 // bits) // 32
    per_step = len(body) / unroll
    regs = [int(re.search(r"REG:(\d+)", r).group(1)) for r in (res, lres)]
    spills = [
        int(re.search(r"STACK:(\d+)", r).group(1)) + int(re.search(r"LOCAL:(\d+)", r).group(1))
        for r in (res, lres)
    ]
    row = dict(
        fmt=name,
        bn=block_n,
        split=params["SPLIT_K"],
        kbps=params["KB_PER_SPLIT"],
        total=len(parse(sass)),
        loop=len(body),
        per_kstep=per_step,
        per_elem=per_step / elems,
        regs=max(regs),
        spills=max(spills),
    )
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
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument(
        "--kbps", type=int, default=None, help="override KB_PER_SPLIT (loop trip count)"
    )
    ap.add_argument("--bn", type=int, default=None, help="override BLOCK_N (rows per program)")
    ap.add_argument("--dump", default=None, help="write the SASS of the (last) format here")
    ap.add_argument("--hist", action="store_true", help="opcode histogram of the loop body")
    ap.add_argument("--seq", action="store_true", help="16-row tiles' halves in sequence")
    ap.add_argument("--bias", action="store_true", help="with the bias epilogue (HAS_BIAS)")
    a = ap.parse_args()
    global BIAS
    BIAS = a.bias
    print(f"N={a.n} K={a.k} M={a.m}, sm_90, triton {triton.__version__}")
    print(f"{'format':<12} {'BN':>3} {'split':>5} {'kb/sp':>5} {'total':>6} {'loop':>5} "
          f"{'/kstep':>7} {'/elem':>6} {'regs':>5} {'spill':>5}")  # fmt: skip
    for name in a.fmt.split(","):
        r = stats(name, a.n, a.k, a.m, a.kbps, a.dump, a.hist, a.bn, a.seq)
        print(f"{r['fmt']:<12} {r['bn']:>3} {r['split']:>5} {r['kbps']:>5} {r['total']:>6} "
              f"{r['loop']:>5} {r['per_kstep']:>7.1f} {r['per_elem']:>6.2f} {r['regs']:>5} "
              f"{r['spills']:>5}")  # fmt: skip
        if a.hist:
            print("   ", " ".join(f"{k}:{v}" for k, v in r["hist"].items()))


if __name__ == "__main__":
    main()
