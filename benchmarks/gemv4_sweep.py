"""The batch-1 fp4 GEMVs (mxfp4, nvfp4) on Llama-3-8B's linear shapes: benchmarks/gemv8_sweep.py
(cycled weights in a CUDA graph, variants alternated in one process, min over reps, each
output checked against the dequantized fp32 product) with its variants, where "old" and
"new" are choose_config's picks with MLXRUN_GEMV4=old (the launches before the fp4 sweep)
and with the current rules, and "mm" the tensor-core GEMM of the batched decode on one row.

    python3 benchmarks/gemv4_sweep.py [--formats mxfp4,nvfp4] [--variants old,new,s16w4p4]
        [--reps 3] [--json out.json]
    python3 benchmarks/gemv4_sweep.py --formats mxfp4,nvfp4 --warm new   # compile only
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemv8_sweep  # noqa: E402

_config8 = gemv8_sweep.config


def config(name: str, m: int, w, device):
    """choose_config's pick with MLXRUN_GEMV4=old / new; "mm": the tensor-core GEMM as
    choose_config launches it for 32 rows of x (the batched decode: wgmma on bf16x2 weights
    decoded in registers), here on one row; else gemv8_sweep's variant."""
    import torch

    from mlxrun.quant import triton_kernels as tk

    if name == "mm":
        return tk.choose_config(32, w, device, torch.bfloat16)
    if name not in ("old", "new"):
        return _config8(name, m, w, device)
    from mlxrun.quant import triton_launch

    saved = triton_launch.GEMV4
    triton_launch.GEMV4 = name
    try:
        return tk.choose_config(m, w, device, torch.bfloat16)
    finally:
        triton_launch.GEMV4 = saved


gemv8_sweep.config = config

if __name__ == "__main__":
    if "--formats" not in sys.argv:
        sys.argv += ["--formats", "mxfp4,nvfp4"]
    if "--warm" in sys.argv and "--shapes" in sys.argv:  # compile those shapes only
        idx = sys.argv[sys.argv.index("--shapes") + 1]
        if idx != "all":
            gemv8_sweep.SHAPES = [gemv8_sweep.SHAPES[int(i)] for i in idx.split(",")]
    gemv8_sweep.main()
