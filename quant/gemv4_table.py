"""Batch-1 launches of the 4-bit GEMV (int4 = affine 4-bit, fp4 = mxfp4, nvfp4) fixed by
exact shape, where a sweep beat choose_config's rules (benchmarks/moe_gemv_sweep.py): the
rules were tuned on Llama-3-8B's shapes, and the MoE models' attention half (q/k/v 5120
rows, o 2048 or 2880 rows) is smaller than any of them.

MLXRUN_GEMV4_LAUNCH="FMT:NxK=LAUNCH,..." replaces the table (FMT int4, fp4 or nvfp4;
LAUNCH "gBNwWsS" with an optional trailing "e", see launch_of); "none" empties it (the rules
alone, for the A/B).
"""

from __future__ import annotations

import os
import re

# FMT:NxK -> launch name. Empty until measured in the decode step.
DEFAULT = ""
TABLE: dict | None = None  # parsed from MLXRUN_GEMV4_LAUNCH (or DEFAULT) at first use

_FMT = {"affine": "int4", "mxfp4": "fp4", "nvfp4": "nvfp4"}


def launch_of(name: str):
    """ "gBNwWsS[e]" -> the one-shot GEMV's KernelConfig: BN rows a program (8, 16), W warps
    (1, 2, 4), S splits of K; "e": each k-step's scales loaded with its words (early)."""
    from .triton_launch import KernelConfig

    mt = re.fullmatch(r"g(8|16)w([124])s([1-9])(e?)", name)
    if not mt:
        raise ValueError(name)
    bn, nw, sk = (int(v) for v in mt.groups()[:3])
    return KernelConfig("gemv", 1, bn, sk, num_warps=nw, early=mt[4] == "e")


def parse(spec: str) -> dict:
    """MLXRUN_GEMV4_LAUNCH's value -> {"FMT:NxK": KernelConfig}."""
    from mlxrun.errors import MlxrunError

    out = {}
    for part in [] if spec in ("", "none") else spec.split(","):
        key, _, name = part.partition("=")
        try:
            if not re.fullmatch(r"(int4|fp4|nvfp4):\d+x\d+", key):
                raise ValueError(key)
            out[key] = launch_of(name)
        except ValueError:
            raise MlxrunError(
                f"MLXRUN_GEMV4_LAUNCH: {part!r} is not FMT:NxK=LAUNCH (FMT: int4, fp4, nvfp4; "
                "LAUNCH like g8w2s1 or g16w2s1e, see benchmarks/moe_gemv_sweep.py), or set it "
                "to none"
            ) from None
    return out


def lookup(w):
    """The fixed batch-1 launch of a 4-bit weight w (n, k, bits, mode), or None."""
    global TABLE
    if TABLE is None:  # read here, not at import: a bad value is a run's error
        TABLE = parse(os.environ.get("MLXRUN_GEMV4_LAUNCH") or DEFAULT)
    fmt = _FMT.get(w.mode) if w.bits == 4 else None
    return TABLE.get(f"{fmt}:{w.n}x{w.k}") if fmt and TABLE else None
