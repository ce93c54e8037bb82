"""The quantized KV cache on MLX (`--kv-quant int8|fp8`), in mlx-lm's layout: keys and
values packed by mx.quantize in groups along head_dim (int8: affine 8-bit, groups of 64;
fp8: mxfp8, groups of 32), and an attention that reads them through mx.quantized_matmul
without expanding them, as mlx-lm's quantized_scaled_dot_product_attention does.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from mlxrun.backends.base import ring_slices
from mlxrun.backends.mlx_cache import MLXCache
from mlxrun.backends.slots import MLXSlotCache, SlotCache
from mlxrun.kvquant import MLX_GROUP, MLX_MODE


class MLXQuantKV(NamedTuple):
    """Packed keys or values: the parts mx.quantize returns, (B, H, S, *) each."""

    parts: tuple
    group_size: int
    mode: str

    @property
    def shape(self):
        return self.parts[0].shape


class MLXQuantCache(MLXCache):
    """MLXCache holding its k, v as mx.quantize parts (allocated at `max_len` once, grown in
    steps past it; rings as MLXCache's)."""

    def __init__(self, num_layers, batch, kv_heads, head_dim, dtype, max_len=None, windows=None,
                 chunk=None, kind="int8"):  # fmt: skip
        super().__init__(num_layers, batch, kv_heads, head_dim, dtype, max_len, windows, chunk)
        self.kv_quant = kind
        self.group = min(MLX_GROUP[kind], head_dim)
        self.mode = MLX_MODE[kind]

    def _quantize(self, x) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group, bits=8, mode=self.mode))

    def _zeros(self, n: int) -> tuple:
        b, h, _, d = self._shape
        return tuple(mx.zeros(p.shape, p.dtype) for p in self._quantize(mx.zeros((b, h, n, d))))

    def update_and_fetch(self, layer, k, v):
        T, o = k.shape[2], self.offset
        end, cap = o + T, self.rings[layer]
        if cap is not None:
            # a longer pass would overwrite keys its own first queries still see
            assert T <= self._chunk, "a pass longer than the cache's chunk"
            runs, held = ring_slices(o, T, cap), min(end, cap)
            if self.keys[layer] is None:
                self.keys[layer], self.values[layer] = self._zeros(cap), self._zeros(cap)
        else:
            runs, held = [(o, 0, T)], end
            cur = self.keys[layer]
            if cur is None or end > cur[0].shape[2]:
                first = cur is None and self._first is not None and self._first >= end
                n = self._first if first else -(-T // self.step) * self.step
                grow = [self._zeros(n), self._zeros(n)]
                if cur is not None:  # keep what is written, then the new room
                    for i, old in enumerate((cur, self.values[layer])):
                        grow[i] = tuple(
                            mx.concatenate([a[:, :, :o], g], axis=2) for a, g in zip(old, grow[i])
                        )
                self.keys[layer], self.values[layer] = grow
        for bufs, x in ((self.keys, k), (self.values, v)):
            for buf, q in zip(bufs[layer], self._quantize(x)):
                for s, t, n in runs:
                    buf[:, :, s : s + n] = q[:, :, t : t + n]
        return tuple(
            MLXQuantKV(tuple(a[:, :, :held] for a in bufs[layer]), self.group, self.mode)
            for bufs in (self.keys, self.values)
        )


def quantized_attention(q, k: MLXQuantKV, v: MLXQuantKV, scale, mask, sinks=None):
    """Attention over packed keys and values: q (B, NH, T, D) -> (B, NH, T, D). The scores
    and the weighted sum are mx.quantized_matmul products of the codes (mlx-lm's
    quantized_scaled_dot_product_attention); softmax in float32. mask: None, "causal" or
    bool (B or 1, 1, T, S); sinks (NH,) or None, a logit per head joining the softmax."""
    B, NH, T, D = q.shape
    NKV = k.shape[1]
    rep = NH // NKV
    kw = dict(group_size=k.group_size, bits=8, mode=k.mode)
    qs = (q * scale).reshape(B, NKV, rep, T, D)
    kp = tuple(mx.expand_dims(a, -3) for a in k.parts)  # (B, NKV, 1, S, *)
    vp = tuple(mx.expand_dims(a, -3) for a in v.parts)
    s = mx.quantized_matmul(qs, *kp, transpose=True, **kw).astype(mx.float32)  # (B,NKV,rep,T,S)
    S = s.shape[-1]
    if isinstance(mask, str):  # queries aligned to the last keys
        mask = mx.arange(S - T, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if mask.ndim == 4:  # (B or 1, 1, T, S) -> over the (NKV, rep) heads
            mask = mx.expand_dims(mask, 2)
        s = mx.where(mask, s, -mx.inf)
    if sinks is not None:
        z = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, NKV, rep, 1, 1), (B, NKV, rep, T, 1)
        )
        p = mx.softmax(mx.concatenate([s, z], axis=-1), axis=-1)[..., :-1]
    else:
        p = mx.softmax(s, axis=-1)
    o = mx.quantized_matmul(p.astype(q.dtype), *vp, transpose=False, **kw)
    return o.reshape(B, NH, T, D)


class MLXQuantSlotCache(MLXSlotCache):
    """The serving engine's slot cache (backends/slots.py) with its rows packed as
    MLXQuantCache packs them: per layer k, v as mx.quantize parts (slots, kv_heads, cap, *)."""

    def __init__(self, num_layers, slots, kv_heads, head_dim, max_len, dtype, windows=None,
                 chunk=None, kind="int8"):  # fmt: skip
        SlotCache.__init__(self, slots, max_len, num_layers, windows, chunk)
        self._mx = mx
        self.kv_quant = kind
        self.group, self.mode = min(MLX_GROUP[kind], head_dim), MLX_MODE[kind]

        def zeros(cap):
            x = mx.zeros((slots, kv_heads, cap, head_dim), dtype)
            return tuple(mx.zeros(p.shape, p.dtype) for p in self._quantize(x))

        self.keys = [zeros(c) for c in self.caps]
        self.values = [zeros(c) for c in self.caps]
        mx.eval(self.keys, self.values)

    def _quantize(self, x) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group, bits=8, mode=self.mode))

    def update_and_fetch(self, layer, k, v):
        T = k.shape[2]
        L = self._check(T)
        cap = self.ring(layer) or self.max_len
        for bufs, x in ((self.keys, k), (self.values, v)):
            for buf, q in zip(bufs[layer], self._quantize(x)):
                for b, r in enumerate(self.rows.tolist()):
                    for s, t, n in ring_slices(int(L[b]), T, cap):  # one run unless it wraps
                        buf[r, :, s : s + n] = q[b, :, t : t + n]
        return tuple(
            MLXQuantKV(tuple(self._take(a, L, T) for a in bufs[layer]), self.group, self.mode)
            for bufs in (self.keys, self.values)
        )

    def _parts(self):
        return [a for bufs in (self.keys, self.values) for kv in bufs for a in kv]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        for buf in self._parts():
            m = n if buf.shape[2] == self.max_len else buf.shape[2]  # a ring: whole
            buf[dst, :, :m] = buf[src, :, :m]
        mx.eval(self.keys, self.values)
        self.lengths[dst] = n

    def clear(self, slot: int) -> None:
        for buf in self._parts():
            buf[slot] = 0
        mx.eval(self.keys, self.values)
        self.lengths[slot] = 0
