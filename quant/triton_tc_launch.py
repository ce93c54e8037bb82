"""How the fp4 GEMVs at batch 1 run on tensor cores (triton_gemv_tc.py): which weights the
kernel takes, its splits of K, and whether choose_config picks it (MLXRUN_GEMV4_TC).
Plain Python (no Triton), for triton_launch.choose_config and the benchmarks.
"""

from __future__ import annotations

import dataclasses
import os

BM_TC = 16  # the fp4 tensor-core GEMV's x tile columns: groups kept apart (triton_gemv_tc.py)


def tc_fits(w, block_n: int, ng: int, silu: bool = False) -> bool:
    """Whether _gemv_tc_kernel takes w (a QLinear, or anything with its n, k, mode and
    group_size) in BLOCK_N-row tiles of k-steps of ng groups: fp4, whole tiles (gate/up
    halves with silu), whole windows of BM_TC groups a row."""
    kg = w.k // w.group_size
    rows = w.n // 2 if silu else w.n
    tile = block_n // 2 if silu else block_n
    return (
        w.mode in ("mxfp4", "nvfp4")
        and rows % tile == 0
        and kg % BM_TC == 0
        and BM_TC % ng == 0
        and (not silu or w.n % 2 == 0)
    )


def tc_split(w, block_n: int, ng: int, sms: int, waves: float = 4.0) -> int:
    """Splits of K for _gemv_tc_kernel: the fewest (a divisor of the windows of BM_TC groups,
    so every split has whole windows) that give about waves * sms programs."""
    windows = w.k // w.group_size // BM_TC
    tiles = w.n // block_n
    for d in range(1, windows + 1):
        if windows % d == 0 and tiles * d >= waves * sms:
            return d
    return windows


def tc_config(w, cfg, sms: int, silu: bool = False):
    """A "tc" KernelConfig by name (launch_from_name: ng holds BK inputs) made concrete for w:
    ng = BK / G groups a k-step, the splits from tc_split where 0; None where
    _gemv_tc_kernel does not take w."""
    ng = max(1, cfg.ng // w.group_size)
    if not tc_fits(w, cfg.block_n, ng, silu):
        return None
    sk = cfg.split_k or tc_split(w, cfg.block_n, ng, sms)
    return dataclasses.replace(cfg, ng=ng, split_k=sk)


# The fp4 GEMVs at batch 1 on tensor cores (triton_gemv_tc.py) where they fit: MLXRUN_GEMV4_TC
# = 1 (TC_LAUNCH's launch per linear) or a launch name (that one everywhere); off by default
# until measured in the decode step
GEMV4_TC = os.environ.get("MLXRUN_GEMV4_TC", "0")
# launch_from_name's "tBNwWkBKsS[d2]" per Llama linear (triton_launch.role8); "": the
# CUDA-core GEMV there
TC_LAUNCH = {
    "qkv": "t64w4k128s0",
    "o": "t64w4k128s0",
    "gu": "t64w4k128s0",
    "down": "t64w4k128s0",
    "head": "t64w4k128s0",
}
