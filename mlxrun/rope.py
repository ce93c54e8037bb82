"""Rotary embedding parameters for each rope type Hugging Face configs name.

One place turns a config's `rope_scaling` / `rope_parameters` into what every backend uses:
the inverse frequencies (head_dim/2,) and the attention factor (YaRN's mscale: transformers
multiplies cos and sin by it, so q.k grows by its square, which the model folds into the
softmax scale). The arithmetic follows transformers' `modeling_rope_utils` step by step in
float32, as it runs it: at position 10,000 one ulp of an inverse frequency moves the angle
by ~1e-3 rad, so computing in float64 and rounding once would not give transformers' logits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import MlxrunError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
F32 = np.float32


def rope_type(scaling: dict | None) -> str:
    """The type a `rope_scaling` dict names ("rope_type", or the older "type")."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def check(scaling: dict | None) -> None:
    """Refuse a rope type mlxrun does not compute, in one line naming it."""
    t = rope_type(scaling)
    if t not in ROPE_TYPES:
        raise MlxrunError(
            f"unsupported rope_scaling type {t!r}: mlxrun supports "
            f"{', '.join(repr(x) for x in ROPE_TYPES)}; use a checkpoint with one of these"
        )


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    # 1 / theta^(2i/dim) in float32, as torch computes it (numpy's float32 pow and torch's
    # differ by an ulp or two, by CPU; float64-then-round is no closer to torch's)
    exps = np.arange(0, dim, 2).astype(F32) / F32(dim)
    return F32(1.0) / (F32(theta) ** exps)


def _llama3(inv: np.ndarray, s: dict, max_pos: int) -> np.ndarray:
    # Long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    factor = F32(s["factor"])
    low = F32(s.get("low_freq_factor", 1.0))
    high = F32(s.get("high_freq_factor", 4.0))
    old = F32(s["original_max_position_embeddings"])
    low_wl, high_wl = old / low, old / high
    # transformers' `2 * math.pi / inv` is torch's __rtruediv__: reciprocal, then multiply
    wavelen = (F32(1) / inv) * F32(2 * math.pi)
    out = np.where(wavelen > low_wl, inv / factor, inv).astype(F32)
    smooth = ((F32(1) / wavelen) * old - low) / (high - low)
    smoothed = (F32(1) - smooth) * out / factor + smooth * out
    mid = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(mid, smoothed, out).astype(F32)


def _yarn(theta: float, dim: int, s: dict, max_pos: int) -> np.ndarray:
    # Interpolated (slowed by `factor`) below the beta_slow rotations over the original
    # context, extrapolated (kept) above beta_fast, a linear ramp over the dimensions between.
    old = s["original_max_position_embeddings"]
    factor = s["factor"]
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):  # gpt-oss ships truncate: false
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero width: transformers' guard
    pos_freqs = F32(theta) ** (np.arange(0, dim, 2).astype(F32) / F32(dim))
    extra = F32(1.0) / pos_freqs
    inter = F32(1.0) / (F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2).astype(F32) - F32(low)) / F32(high - low), 0, 1)
    keep = F32(1) - ramp.astype(F32)
    return (inter * (F32(1) - keep) + extra * keep).astype(F32)


def normalise(scaling: dict | None, config: dict) -> dict | None:
    """`scaling` with what transformers derives filled in (None for plain rope): llama3 and
    yarn's original context (the config's top-level original_max_position_embeddings, as
    Phi-3 ships it, else the rope dict's, else max_position_embeddings), yarn's factor when
    null (the ratio of the two contexts)."""
    t = rope_type(scaling)
    check(scaling)
    if t == "default":
        return None
    s = dict(scaling or {})
    s["rope_type"] = t
    max_pos = config.get("max_position_embeddings", 4096)
    if t in ("llama3", "yarn"):
        old = config.get("original_max_position_embeddings")
        if old is not None:
            s["original_max_position_embeddings"] = old
        s.setdefault("original_max_position_embeddings", max_pos)
    if t == "yarn" and s.get("factor") is None:
        s["factor"] = max_pos / s["original_max_position_embeddings"]
    if t in ("linear", "dynamic", "llama3") and s.get("factor") is None:
        raise MlxrunError(f"config.json rope_scaling of type {t!r} has no factor; fix the config")
    return s


def inv_freq(
    theta: float, dim: int, scaling: dict | None, max_pos: int, seq_len: int | None = None
) -> np.ndarray:
    """Inverse frequencies (dim/2,) float32 of the rope `scaling` names (a `normalise`d dict).

    `seq_len` matters to "dynamic" (NTK) alone: transformers recomputes its base for each
    forward pass from that pass's largest position + 1, once past max_position_embeddings.
    """
    t = rope_type(scaling)
    if t == "default":
        return _base_inv_freq(theta, dim)
    s = scaling or {}
    if t == "linear":
        return (_base_inv_freq(theta, dim) / F32(s["factor"])).astype(F32)
    if t == "llama3":
        return _llama3(_base_inv_freq(theta, dim), s, max_pos)
    if t == "yarn":
        return _yarn(theta, dim, s, max_pos)
    if t == "dynamic":
        n = max(seq_len or max_pos, max_pos)
        factor = s["factor"]
        base = theta * ((factor * n / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim)
    check(scaling)
    raise AssertionError(t)  # pragma: no cover (check refused it)


def attention_factor(scaling: dict | None) -> float:
    """The factor transformers multiplies cos and sin by (YaRN's mscale; 1 otherwise)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    s: dict[str, Any] = scaling or {}
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = s.get("mscale"), s.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)
