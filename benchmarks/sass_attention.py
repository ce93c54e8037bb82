"""Offline SASS statistics of the decode attention kernel (backends/cuda_attention.py), no GPU
needed: instructions of the loop over key blocks, per cached value read, by opcode, for sm_90.

    python benchmarks/sass_attention.py                  # bf16, int8, fp8 caches, G=4, D=128
    python benchmarks/sass_attention.py --hist --dump /tmp/attn.sass

Compiles _decode_attn_kernel with triton.compile for GPUTarget("cuda", 90, 32), with the
constexprs decode_attention passes on an H100 (PDL on, a mask, Llama-3-8B's GQA: 4 query
heads a kv head), as sass_count.py does for the GEMV.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from sass_count import compile_sm90, main_loop, opcode_histogram, parse, sass_of  # noqa: E402

from mlxrun.backends import cuda_attention as ca  # noqa: E402

CODE = {"bf16": ("*bf16", 0), "int8": ("*i8", 1), "fp8": ("*u8", 2)}


def compile_attn(kind: str, launch: ca.AttnLaunch, g: int = 4, d: int = 128, rope=False):
    ptr, quant = CODE[kind]
    fn = ca._decode_attn_kernel
    f16 = quant == 2 and launch.fp8_f16 is not False  # bf16 q: float16 dots by default
    params = dict(
        BL=launch.block_quant if quant else launch.block, NSTAGES=launch.stages, MB=1024, F16=f16
    )
    ptrs = {"q_ptr": "*bf16", "k_ptr": ptr, "v_ptr": ptr, "mask_ptr": "*i1",
            "rows_ptr": "*i64", "part_ptr": "*fp32", "stat_ptr": "*fp32", "ks_ptr": "*fp32",
            "vs_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16", "pos_ptr": "*i64",
            "inv_ptr": "*fp32", "slot_ptr": "*i64"}  # fmt: skip
    consts = dict(NKV=8, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, HAS_MASK=True,
                  F32_DOT=False, ROWS=False, PDL=True, LINES=1 if quant else 2,
                  EPL=128 if quant else 64, QUANT=quant, ROPE=rope, RN=rope,
                  ROPE_EARLY=rope and launch.rope_early,
                  EARLY_KV=rope and launch.early_kv and not quant, **params)  # fmt: skip
    # sizes and strides: multiples of 16 at these shapes
    kern = compile_sm90(fn, ptrs, consts, {"scale": 1.0 / d**0.5}, other_int=16, num_warps=4)
    return kern, consts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="bf16,int8,fp8")
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--launch", default="", help="AttnLaunch fields: block=128,stages=2")
    ap.add_argument("--rope", action="store_true", help="rope_qkv's work in the kernel")
    ap.add_argument("--hist", action="store_true")
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    print(f"G={a.g} D={a.d}, sm_90, triton {triton.__version__}")
    for kind in a.kinds.split(","):
        k, consts = compile_attn(kind, ca.AttnLaunch.from_spec(a.launch), a.g, a.d, a.rope)
        sass, res = sass_of(k)
        if a.dump:
            with open(f"{a.dump}.{kind}", "w") as f:
                f.write(sass)
        body = main_loop(parse(sass))
        vals = 2 * consts["BL"] * a.d  # keys and values of one block
        regs = re.search(r"REG:(\d+)", res).group(1)
        print(f"{kind:5s} BL={consts['BL']:4d} loop {len(body):5d} instr, "
              f"{len(body) / vals * 128:6.1f} / 128 values, {regs} registers, "
              f"{k.metadata.shared} bytes shared, {len(parse(sass))} instr in all")  # fmt: skip
        if a.hist:
            print("   ", " ".join(f"{k}:{v}" for k, v in opcode_histogram(body).items()))


if __name__ == "__main__":
    main()
