"""The batch-1 fp4 GEMVs (mxfp4, nvfp4) on Llama-3-8B's linear shapes: benchmarks/gemv8_sweep.py
(cycled weights in a CUDA graph, variants alternated in one process, min over reps, each
output checked against the dequantized fp32 product) with its variants, where "old" and
"new" are choose_config's picks and the fp4 decode with MLXRUN_GEMV4=old (before this
work) and with the current code, and "mm" the tensor-core GEMM of the batched decode on one row.

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
_KERNELS: dict = {}  # "old" / "new" -> (_gemv_kernel, _gemv_stream_kernel)
_VARIANT: dict = {}  # id(KernelConfig) -> "old" / "new"


def _kernels(which: str):
    """The GEMV kernels compiled from triton_gemv with GEMV4 = which: the fp4 decode (nvfp4's
    E4M3 scales by cvt; with MLXRUN_E2M1_PAIR=1 E2M1 positions 3 and 7 sharing a mask) is
    fixed at import, so the modules are loaded once more for each."""
    if which not in _KERNELS:
        import importlib

        from mlxrun.quant import triton_launch

        saved = triton_launch.GEMV4
        triton_launch.GEMV4 = which
        try:
            importlib.reload(importlib.import_module("mlxrun.quant.triton_decode"))
            importlib.reload(importlib.import_module("mlxrun.quant.triton_gemv_step"))
            g = importlib.reload(importlib.import_module("mlxrun.quant.triton_gemv"))
            st = importlib.reload(importlib.import_module("mlxrun.quant.triton_gemv_stream"))
        finally:
            triton_launch.GEMV4 = saved
        _KERNELS[which] = (g._gemv_kernel, st._gemv_stream_kernel)
    return _KERNELS[which]


def config(name: str, m: int, w, device):
    """choose_config's pick with MLXRUN_GEMV4=old / new (launch and decode); "mm": the
    tensor-core GEMM as choose_config launches it for 32 rows of x (the batched decode: wgmma
    on bf16x2 weights decoded in registers), here on one row; else gemv8_sweep's variant
    (with the new decode)."""
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
        cfg = tk.choose_config(m, w, device, torch.bfloat16)
    finally:
        triton_launch.GEMV4 = saved
    _VARIANT[id(cfg)] = name
    return cfg


def run(x, w, cfg, silu):
    """qmatmul with the kernels of cfg's variant (the new decode unless it is "old")."""
    from mlxrun.quant import triton_kernels as tk

    _kernels("new")
    tk._gemv_kernel, tk._gemv_stream_kernel = _kernels(_VARIANT.get(id(cfg), "new"))
    return tk.qmatmul(x, w, cfg, silu=silu)


gemv8_sweep.run = run
gemv8_sweep.config = config

if __name__ == "__main__":
    if "--formats" not in sys.argv:
        sys.argv += ["--formats", "mxfp4,nvfp4"]
    if "--warm" in sys.argv and "--shapes" in sys.argv:  # compile those shapes only
        idx = sys.argv[sys.argv.index("--shapes") + 1]
        if idx != "all":
            gemv8_sweep.SHAPES = [gemv8_sweep.SHAPES[int(i)] for i in idx.split(",")]
    gemv8_sweep.main()
