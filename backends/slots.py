"""Slot KV caches for continuous batching: each row (slot) of the cache holds one sequence
with its own length, so sequences join and leave the running batch independently.

A forward pass runs the rows chosen by `select(rows)`: ids (len(rows), T), each row's
queries at its own positions lengths[row] + t, its keys masked to its own filled prefix.
The host keeps the lengths (numpy), so the masks and rope positions are built per pass.

With `windows` (each layer's attention window or None) and `chunk` (the most tokens a pass
brings), a sliding-window layer's rows are rings of window + chunk - 1 slots
(base.ring_capacity): position p of a row at slot p % capacity.
"""

from __future__ import annotations

import numpy as np

from mlxrun.backends.base import ring_capacity, ring_slices
from mlxrun.errors import MlxrunError


class SlotCache:
    """Per-row lengths and the rows of the next pass; subclasses store k, v per backend."""

    def __init__(self, slots: int, max_len: int, num_layers: int = 0, windows=None, chunk=None):
        self.slots = slots
        self.max_len = max_len
        self.lengths = np.zeros(slots, dtype=np.int64)  # filled positions of each row
        self.rows = np.zeros(0, dtype=np.int64)
        windows = list(windows or [None] * num_layers)
        self.caps = [ring_capacity(w, max_len, chunk) for w in windows]  # slots per layer
        self._cap_of = {w: c for w, c in zip(windows, self.caps)}
        # how far a row's length may be cut back with its rings still holding what the
        # next pass sees (`keeps`): the fewest spare slots of any ring
        spare = [c - w + 1 for w, c in zip(windows, self.caps) if c < max_len]
        self._spare = min(spare) if spare else None
        self.chunk = chunk

    def ring(self, layer: int) -> int | None:
        """Layer `layer`'s ring size, or None when its rows hold every position."""
        c = self.caps[layer] if self.caps else self.max_len
        return c if c < self.max_len else None

    def keeps(self, slot: int, n: int) -> bool:
        """Whether `slot` (or a copy of it) can continue from its first n positions: the
        rings still hold the keys a query at n sees (none of them overwritten since)."""
        return self._spare is None or int(self.lengths[slot]) - n <= self._spare

    @property
    def offset(self) -> int:
        """The longest filled prefix among the selected rows (the KVCache protocol's offset)."""
        return int(self.lengths[self.rows].max()) if len(self.rows) else 0

    def select(self, rows) -> None:
        """The rows (slot indices, in batch order) that the next forward pass runs."""
        self.rows = np.asarray(rows, dtype=np.int64)

    def set_length(self, slot: int, n: int) -> None:
        """Keep only the first n positions of `slot` (0 empties it)."""
        self.lengths[slot] = n

    def _check(self, length: int) -> np.ndarray:
        L = self.lengths[self.rows]
        if int(L.max()) + length > self.max_len:
            raise MlxrunError(
                f"a sequence needs {int(L.max()) + length} positions and the cache holds "
                f"{self.max_len}; raise --context"
            )
        # a longer pass would overwrite ring keys its own first queries still see
        assert self._spare is None or length <= self.chunk, "a pass longer than the chunk"
        return L

    def mask_np(self, length: int, window: int | None = None) -> np.ndarray | None:
        """(B, 1, T, S) bool, True = may attend, S = longest row + T: row b's query t sits at
        lengths[b] + t and sees keys up to it (with a `window`, only its `window` latest).
        None when every key is visible to every query (one new token, rows of equal length,
        all in the window), as in a batch-1 decode step."""
        L = self.lengths[self.rows]
        cap = self._cap_of.get(window, self.max_len)
        if int(L.max()) + length > cap:  # a ring that has wrapped: (B, 1, T, cap)
            E = L[:, None] + length  # (B, 1): each row's length after this pass
            p = E - 1 - (E - 1 - np.arange(cap)[None, :]) % cap  # (B, cap) position held
            q = (L[:, None] + np.arange(length)[None, :])[:, :, None]  # (B, T, 1)
            p = p[:, None, :]
            return ((p <= q) & (p > q - window) & (p >= 0))[:, None]
        in_window = window is None or int(L.max()) + length <= window
        if length == 1 and (L == L[0]).all() and in_window:
            return None
        q = L[:, None] + np.arange(length)[None, :]  # (B, T)
        k = np.arange(int(L.max()) + length)
        m = k[None, None, :] <= q[:, :, None]
        if not in_window:
            m = m & (k[None, None, :] > q[:, :, None] - window)
        return m[:, None]

    def positions_np(self, length: int) -> np.ndarray:
        """Rope positions (B, T) int32: each row continues from its own length."""
        L = self.lengths[self.rows]
        return (L[:, None] + np.arange(length)[None, :]).astype(np.int32)

    def contiguous(self) -> int | None:
        """The first row when the selected rows are consecutive (their keys are a view)."""
        r = self.rows
        return int(r[0]) if (r == np.arange(r[0], r[0] + len(r))).all() else None

    def advance(self, n: int) -> None:
        self.lengths[self.rows] += n


class TorchSlotCache(SlotCache):
    """Per layer k, v: (slots, kv_heads, max_len, D) torch tensors; a ring layer's have one
    row more, (slots + 1, kv_heads, capacity, D): the scratch row the fixed-shape steps'
    dummy rows write (slot_graph.py), since every position of a ring may be in use."""

    def __init__(self, num_layers, slots, kv_heads, head_dim, max_len, dtype, device,
                 windows=None, chunk=None, kv_quant=None):  # fmt: skip
        import torch  # noqa: PLC0415

        from .torch_kv import KVStore  # noqa: PLC0415

        super().__init__(slots, max_len, num_layers, windows, chunk)
        self._torch, self.device = torch, device
        # plain, or quantized codes and scales (--kv-quant); rings get the scratch row
        rows = [slots + (cap < max_len) for cap in self.caps]
        self.kv = KVStore(self.caps, rows, kv_heads, head_dim, dtype, device, kv_quant)
        self.keys, self.values = self.kv.keys, self.kv.values
        self.kv_quant = kv_quant

    def mask(self, length, pads, window=None):
        from .torch_backend import CAUSAL  # noqa: PLC0415

        fresh = len(self.rows) == 1 and self.lengths[self.rows[0]] == 0 and length > 1
        if fresh and (window is None or length <= window):
            return CAUSAL  # a fresh prompt alone: SDPA's own causal mask, as `generate` runs it
        m = self.mask_np(length, window)
        return None if m is None else self._torch.from_numpy(m).to(self.device)

    def positions(self, length, pads):
        pos = self._torch.from_numpy(self.positions_np(length)).to(self.device)  # (B, T)
        # Where every layer writes this pass's k, v: (row, position) pairs, one scatter a
        # layer instead of one copy per row (a batch of 32 on CUDA: 32 launches a layer).
        rows = self._torch.from_numpy(self.rows).to(self.device)
        self._write = (rows[:, None].expand(pos.shape), pos.long())
        self._ring_write = {}  # ring size -> (rows, pos % size), made on first use
        return pos

    def update_and_fetch(self, layer, k, v):
        T = k.shape[2]
        L = self._check(T)
        rows, pos = self._write  # (B, T) each
        cap = self.ring(layer)
        if cap is not None:
            if cap not in self._ring_write:
                self._ring_write[cap] = (rows, pos % cap)
            rows, pos = self._ring_write[cap]
        # (B, T, kv_heads, D) codes or values, (B, T, kv_heads) scales
        self.kv.write(layer, k, v, lambda buf, x: buf.__setitem__((rows, slice(None), pos),
                                                                  x.transpose(1, 2)))  # fmt: skip
        S = min(int(L.max()) + T, self.keys[layer].shape[2])  # a wrapped ring: all of it
        r0 = self.contiguous()
        if r0 is not None:
            return self.kv.read(layer, S, slice(r0, r0 + len(self.rows)))
        return self.kv.read(layer, S, self._torch.from_numpy(self.rows).to(self.device))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row dst's first n positions := row src's (a prefix held by a running sequence);
        a ring is copied whole (`keeps(src, n)` says whether it still holds them)."""
        for buf in self.kv.buffers():
            m = n if buf.shape[2] == self.max_len else buf.shape[2]
            buf[dst, :, :m] = buf[src, :, :m]
        self.lengths[dst] = n

    def clear(self, slot: int) -> None:
        """Zero the slot's keys and values (a sequence whose activations went NaN leaves them
        behind: masked-out positions still meet the attention's product, 0 * NaN = NaN)."""
        for buf in self.kv.buffers():
            buf[slot].zero_()
        self.lengths[slot] = 0


class MLXSlotCache(SlotCache):
    """Per layer k, v: (slots, kv_heads, max_len, D) mx arrays."""

    def __init__(self, num_layers, slots, kv_heads, head_dim, max_len, dtype,
                 windows=None, chunk=None):  # fmt: skip
        import mlx.core as mx  # noqa: PLC0415

        super().__init__(slots, max_len, num_layers, windows, chunk)
        self._mx = mx
        self.keys = [mx.zeros((slots, kv_heads, c, head_dim), dtype) for c in self.caps]
        self.values = [mx.zeros((slots, kv_heads, c, head_dim), dtype) for c in self.caps]
        mx.eval(self.keys, self.values)

    def mask(self, length, pads, window=None):
        m = self.mask_np(length, window)
        return None if m is None else self._mx.array(m)

    def positions(self, length, pads):
        # mx.fast.rope takes each row's start offset: an int when all rows agree (as
        # `generate` passes it), else (B,)
        L = self.lengths[self.rows]
        if (L == L[0]).all():
            return int(L[0])
        return self._mx.array(L.astype(np.int32))

    def update_and_fetch(self, layer, k, v):
        T = k.shape[2]
        L = self._check(T)
        cap = self.ring(layer) or self.max_len
        for b, r in enumerate(self.rows.tolist()):
            for s, t, n in ring_slices(int(L[b]), T, cap):  # one run unless a ring wraps
                self.keys[layer][r, :, s : s + n] = k[b, :, t : t + n]
                self.values[layer][r, :, s : s + n] = v[b, :, t : t + n]
        return self._take(self.keys[layer], L, T), self._take(self.values[layer], L, T)

    def _take(self, buf, L, T):
        S = min(int(L.max()) + T, buf.shape[2])  # a wrapped ring: all of it
        r0 = self.contiguous()
        if r0 is not None:
            return buf[r0 : r0 + len(self.rows), :, :S]
        return buf[self._mx.array(self.rows.astype(np.int32)), :, :S]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        for bufs in (self.keys, self.values):
            for buf in bufs:
                m = n if buf.shape[2] == self.max_len else buf.shape[2]  # a ring: whole
                buf[dst, :, :m] = buf[src, :, :m]
        self._mx.eval(self.keys, self.values)
        self.lengths[dst] = n

    def clear(self, slot: int) -> None:
        for bufs in (self.keys, self.values):
            for buf in bufs:
                buf[slot] = 0
        self._mx.eval(self.keys, self.values)
        self.lengths[slot] = 0
