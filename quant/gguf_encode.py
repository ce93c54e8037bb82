"""Min-max numpy encoders for GGUF's Q4_K and Q6_K blocks, for tests and benchmark files.

Not llama.cpp's quantizer (which searches each sub-block's scale and min to minimize the
error): these put each sub-block's range on the grid directly. The bytes are valid blocks
that `gguf.quants.dequantize` and `gguf_blocks.dequantize` read; use them to build files laid
out like llama.cpp's K-quant mixes, not to judge K-quant quality.
"""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> np.ndarray:
    """float -> fp16 (returned as float32 values) and its 2 bytes (..., 2)."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h[..., None].view(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / b, 0.0)


def q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> Q4_K blocks uint8 [rows, n/256*144]."""
    rows = w.shape[0]
    x = w.reshape(rows, -1, 8, 32).astype(np.float32)  # (rows, nb, sub, 32)
    lo = np.minimum(x.min(-1), 0)
    scale, mn = (x.max(-1) - lo) / 15, -lo  # w ~ scale * q - mn, q in 0..15
    d, d_b = _f16(scale.max(-1) / 63)
    dmin, dmin_b = _f16(mn.max(-1) / 63)
    sc = np.clip(np.rint(_div(scale, d[..., None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(mn, dmin[..., None])), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.rint(_div(x + (dmin[..., None] * m)[..., None], step))
    q = np.clip(q, 0, 15).astype(np.uint8)  # (rows, nb, 8, 32)
    packed = np.concatenate(
        [sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6)]
        + [(sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)],
        axis=-1,
    )  # the 12 scale bytes (gguf_blocks._k_scales reads them back)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, -1, 128)
    return np.concatenate([d_b, dmin_b, packed, qs], axis=-1).reshape(rows, -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> Q6_K blocks uint8 [rows, n/256*210]."""
    rows = w.shape[0]
    x = w.reshape(rows, -1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31  # w ~ scale * (q - 32), q - 32 in -32..31
    d, d_b = _f16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_div(scale, d[..., None])), -128, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.rint(_div(x, step)), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 128)
    low, high = q & 15, q >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(rows, -1, 128)
    h = high.reshape(rows, -1, 2, 4, 32)
    qh = (h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)).reshape(
        rows, -1, 64
    )
    return np.concatenate([ql, qh, sc.view(np.uint8), d_b], axis=-1).reshape(rows, -1)


ENCODERS = {"Q4_K": q4_k, "Q6_K": q6_k}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers (of n) whose attn_v / ffn_down get more bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def kquant_type(mix: str, name: str, n_layers: int, tied: bool) -> str | None:
    """The block type llama.cpp's quantizer (src/llama-quant.cpp) gives matrix `name`
    (GGUF names: token_embd.weight, blk.3.attn_v.weight, output.weight) of a model of
    `n_layers` layers quantized to `mix` ("q4_k_m" or "q6_k"), rows a multiple of 256; None
    for a tensor it keeps as it is (norms). q4_k_m: Q6_K for the head (the tied embedding)
    and for attn_v / ffn_down where use_more_bits holds, Q4_K for the other matrices."""
    parts = name.split(".")
    matrix = name in ("token_embd.weight", "output.weight") or (
        parts[0] == "blk" and parts[-1] == "weight" and not parts[2].endswith("norm")
    )
    if not matrix:
        return None
    if mix == "q6_k":
        return "Q6_K"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        return "Q6_K" if use_more_bits(int(parts[1]), n_layers) else "Q4_K"
    return "Q4_K"
