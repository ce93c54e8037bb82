"""The MLX backend's KV cache (MLXBackend.make_cache): buffers allocated once at the
generation's length, sliding-window layers in rings. The quantized cache (`--kv-quant`) builds
on it in mlx_kv.py; the serving engine's per-row cache is slots.MLXSlotCache."""

from __future__ import annotations

import numpy as np

from mlxrun.backends.base import causal_mask_np, ring_capacity, ring_mask_np, ring_slices

try:
    import mlx.core as mx
except ImportError:  # reported by get_backend with the extra to install
    mx = None


class MLXCache:
    """KV cache, per layer k, v: (B, kv_heads, capacity, D), written at `offset`.

    Generation knows its final length, so the buffers are allocated once at `max_len`: no
    step rounding and no copy-on-grow, which would briefly double the cache (mlx-lm grows
    in steps of 256 because it does not know the length). Past `max_len` it grows in
    steps, for callers that keep decoding.

    With `windows` (each layer's attention window or None) and `chunk` (the most tokens a
    pass brings), a sliding-window layer holds a ring of window + chunk - 1 slots
    (base.ring_capacity) instead of the whole sequence, position p at slot p % capacity.
    """

    step = 256

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, dtype,
                 max_len: int | None = None, windows=None, chunk: int | None = None):  # fmt: skip
        self.offset = 0
        self._shape = (batch, kv_heads, 0, head_dim)
        self._dtype = dtype
        self._first = max_len
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers
        windows = windows or [None] * num_layers
        # per layer: the ring's slots, or None for a layer that holds every position
        self.rings = [
            None if max_len is None or ring_capacity(w, max_len, chunk) >= max_len
            else ring_capacity(w, max_len, chunk)
            for w in windows
        ]  # fmt: skip
        self._ring_of = {w: r for w, r in zip(windows, self.rings)}
        self._chunk = chunk

    def mask(self, length, pads, window=None):
        cap = self._ring_of.get(window)
        if cap is not None:
            m = ring_mask_np(self.offset, length, pads, window, cap)
            return None if m is None else mx.array(m)
        if window is None and (pads is None or not pads.any()):
            # sdpa's own causal mode (queries aligned to the last keys, as the cache holds
            # them): no (T, offset+T) mask array to build, copy and read, and the fused
            # kernels that take no mask array stay in play (mlx-lm passes "causal" too).
            return None if length == 1 else "causal"
        m = causal_mask_np(self.offset, length, pads, window)
        return None if m is None else mx.array(m)

    def positions(self, length, pads):
        # mx.fast.rope takes the start offset: an int, or (B,) for left-padded batches.
        if pads is None or not pads.any():
            return self.offset
        return mx.array((self.offset - pads).astype(np.int32))

    def update_and_fetch(self, layer: int, k, v):
        cap = self.rings[layer]
        if cap is not None:
            return self._ring_update(layer, k, v, cap)
        end = self.offset + k.shape[2]
        cur = self.keys[layer]
        if cur is None or end > cur.shape[2]:
            need = end - self.offset
            if cur is None and self._first is not None and self._first >= end:
                grow = self._first
            else:
                grow = ((need + self.step - 1) // self.step) * self.step
            b, h, _, d = self._shape
            new_k = mx.zeros((b, h, grow, d), self._dtype)
            new_v = mx.zeros((b, h, grow, d), self._dtype)
            if cur is not None:
                new_k = mx.concatenate([cur[:, :, : self.offset], new_k], axis=2)
                new_v = mx.concatenate([self.values[layer][:, :, : self.offset], new_v], axis=2)
            self.keys[layer], self.values[layer] = new_k, new_v
        self.keys[layer][:, :, self.offset : end] = k
        self.values[layer][:, :, self.offset : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def _ring_update(self, layer, k, v, cap):
        T = k.shape[2]
        if self.keys[layer] is None:
            b, h, _, d = self._shape
            self.keys[layer] = mx.zeros((b, h, cap, d), self._dtype)
            self.values[layer] = mx.zeros((b, h, cap, d), self._dtype)
        end = self.offset + T
        # a longer pass would overwrite keys its own first queries still see
        assert T <= self._chunk, "a pass longer than the cache's chunk (Transformer splits it)"
        for s, t, n in ring_slices(self.offset, T, cap):
            self.keys[layer][:, :, s : s + n] = k[:, :, t : t + n]
            self.values[layer][:, :, s : s + n] = v[:, :, t : t + n]
        n = min(end, cap)  # slots written so far
        return self.keys[layer][:, :, :n], self.values[layer][:, :, :n]

    def advance(self, n: int) -> None:
        self.offset += n
