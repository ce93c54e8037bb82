"""The key and value buffers of the PyTorch caches (StaticCache, TorchSlotCache), plain or
quantized (`--kv-quant`, mlxrun/kvquant.py): one place that knows how a layer's k, v are
stored, written and read back.

Quantized, a layer holds codes (rows, kv_heads, capacity, D) int8 / uint8 E4M3 and scales
(rows, kv_heads, capacity) float32, one per head and position. A write quantizes the new
vectors and stores codes and scales through the same index; a read gives them back in the
compute dtype, or (`QuantKV`) as they are, for the CUDA kernels that dequantize in
registers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import torch

from mlxrun.kvquant import torch_code_dtype, torch_dequantize, torch_quantize


class QuantKV(NamedTuple):
    """A quantized key or value buffer as the Triton decode attention reads it."""

    codes: torch.Tensor  # (rows, kv_heads, S, D) int8, or uint8 E4M3 bytes
    scales: torch.Tensor  # (rows, kv_heads, S) float32
    kind: str  # "int8" | "fp8"

    @property
    def shape(self):
        return self.codes.shape


class KVStore:
    """Per layer k, v buffers (rows, kv_heads, caps[layer], D), quantized when `kind`;
    `rows` is one count for every layer or a list of one per layer."""

    def __init__(self, caps, rows, kv_heads, head_dim, dtype, device, kind=None):
        self.kind, self.dtype = kind, dtype
        code = dtype if kind is None else torch_code_dtype(kind)
        rows = rows if isinstance(rows, list) else [rows] * len(caps)

        def buf(i, *tail, dt=code):
            return torch.zeros((rows[i], kv_heads, caps[i], *tail), dtype=dt, device=device)

        n = range(len(caps))
        self.keys = [buf(i, head_dim) for i in n]
        self.values = [buf(i, head_dim) for i in n]
        f32 = torch.float32
        self.kscales = [buf(i, dt=f32) for i in n] if kind else []
        self.vscales = [buf(i, dt=f32) for i in n] if kind else []

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor of the store (for whole-row copies and clears)."""
        return self.keys + self.values + self.kscales + self.vscales

    def write(self, layer: int, k, v, put) -> None:
        """Store k, v (B, kv_heads, T, D) through put(buffer, x), which writes x at the pass's
        slots along dim 2 (scales are put with the same index, one dim less)."""
        if self.kind is None:
            put(self.keys[layer], k.to(self.dtype))
            put(self.values[layer], v.to(self.dtype))
            return
        for codes, scales, x in ((self.keys, self.kscales, k), (self.values, self.vscales, v)):
            c, s = torch_quantize(x, self.kind)
            put(codes[layer], c)
            put(scales[layer], s)

    def read(self, layer: int, end: int | None = None, rows=None):
        """Keys and values of slots [0, end) (all with None) of `rows` (a slice or an index
        tensor; all with None), in the compute dtype."""
        sel = slice(None) if rows is None else rows
        ks = self.keys[layer][sel, :, :end]
        vs = self.values[layer][sel, :, :end]
        if self.kind is None:
            return ks, vs
        k_s = self.kscales[layer][sel, :, :end]
        v_s = self.vscales[layer][sel, :, :end]
        return (
            torch_dequantize(ks, k_s, self.kind, self.dtype),
            torch_dequantize(vs, v_s, self.kind, self.dtype),
        )

    def stored(self, layer: int, start: int = 0, end: int | None = None):
        """The layer's k, v over slots [start, end) as they are stored, for the CUDA kernels:
        views of the plain buffers, or QuantKV views of codes and scales."""
        k, v = self.keys[layer][:, :, start:end], self.values[layer][:, :, start:end]
        if self.kind is None:
            return k, v
        return (
            QuantKV(k, self.kscales[layer][:, :, start:end], self.kind),
            QuantKV(v, self.vscales[layer][:, :, start:end], self.kind),
        )


def dequantize(x, dtype):
    """A QuantKV in the compute `dtype` (a plain tensor passes through)."""
    if isinstance(x, QuantKV):
        return torch_dequantize(x.codes, x.scales, x.kind, dtype)
    return x


def take_rows(x, rows):
    """Rows `rows` of a cache buffer, plain or QuantKV."""
    if isinstance(x, QuantKV):
        return QuantKV(x.codes[rows], x.scales[rows], x.kind)
    return x[rows]


# Decode attention rotates q and stores the new k, v itself (rope_qkv's work, one launch less
# a layer); MLXRUN_ROPE_FUSED=0 keeps the separate rope_qkv launch (for A/B timing)
ROPE_FUSED = os.environ.get("MLXRUN_ROPE_FUSED", "1") != "0"


@dataclasses.dataclass
class RopeStep:
    """A decode step's q (B, NH, 1, D), k, v (B, NKV, 1, D) before rope_qkv, with what it
    takes (positions, inverse frequencies, the slot: StaticCache's (1,) or a slot cache's
    (B,) with `rows`): decode_attention does that work in its kernel; anything else calls
    `run()` first, which is rope_qkv itself."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    inv_freq: torch.Tensor
    k_cache: object
    v_cache: object
    slot: torch.Tensor
    rows: torch.Tensor | None = None

    def run(self) -> torch.Tensor:
        from mlxrun.backends.cuda_rope import rope_qkv  # noqa: PLC0415

        return rope_qkv(self.q, self.k, self.v, self.positions, self.inv_freq, self.k_cache,
                        self.v_cache, self.slot, rows=self.rows)  # fmt: skip
