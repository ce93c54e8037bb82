"""The PyTorch backend's preallocated KV cache (TorchBackend.make_cache): static shapes, so a
decode step can be captured in a CUDA graph (cuda_graph.py), with sliding-window layers in
rings."""

from __future__ import annotations

import numpy as np
import torch

from mlxrun.backends.base import (
    causal_mask_np,
    positions_np,
    ring_capacity,
    ring_mask_np,
    ring_slices,
)
from mlxrun.backends.torch_kv import KVStore
from mlxrun.errors import MlxrunError

# A plain causal mask from slot 0: SDPA applies it itself (flash attention), no mask tensor.
CAUSAL = "causal"


class StaticCache:
    """Preallocated KV cache: per layer k, v (B, kv_heads, max_len, D) written at `offset`.

    Eager passes read the filled prefix. In graph mode (CUDA-graph decode) the write
    position lives on the device in `pos`, writes go through index_copy_ and attention spans
    the whole buffer under a mask, so one captured step serves every position. The mask and
    the rope positions are buffers that `advance` moves on with `pos` (with `fused`, one
    Triton kernel: building them per step took three launches more).

    With `windows` (each layer's attention window or None) and `chunk` (the most tokens a
    pass brings), a sliding-window layer holds a ring of window + chunk - 1 slots
    (base.ring_capacity), position p at slot p % capacity, and its mask follows the ring.
    """

    def __init__(self, num_layers, batch, kv_heads, head_dim, max_len, dtype, device, fused=False,
                 windows=None, chunk=None, kv_quant=None):  # fmt: skip
        windows = windows or [None] * num_layers
        self.caps = [ring_capacity(w, max_len, chunk) for w in windows]
        self._cap_of = {w: c for w, c in zip(windows, self.caps)}
        self.chunk = chunk
        self.kv = KVStore(self.caps, batch, kv_heads, head_dim, dtype, device, kv_quant)
        self.keys, self.values = self.kv.keys, self.kv.values
        self.kv_quant = kv_quant
        self.max_len = max_len
        self.offset = 0
        self.device = device
        self.graph = False
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)  # graph mode only
        self._zero = torch.zeros(1, dtype=torch.int64, device=device)
        self._slots = torch.arange(max_len, device=device)
        self._pads = self._key_ok = self._mask = self._positions = None
        self._windowed: dict[int, torch.Tensor] = {}  # window -> graph-mode sliding mask
        self._ring_pos: dict[int, torch.Tensor] = {}  # capacity -> graph-mode pos % capacity
        self._ring_slot: dict[int, torch.Tensor] = {}  # capacity -> this eager pass's slot
        self._fused = fused

    def reset(self) -> None:
        """Empty again for a new generation. Stale keys and values may stay: every read is
        of the filled prefix, or masked to it in graph mode."""
        self.offset = 0
        self.graph = False
        self._ring_slot.clear()

    def enter_graph(self, pads: np.ndarray | None) -> None:
        self.graph = True
        self.pos.fill_(self.offset)
        pad = (
            torch.zeros(len(self.keys[0]), dtype=torch.int64)
            if pads is None
            else torch.from_numpy(pads.astype(np.int64))
        ).to(self.device)  # (B,)
        key_ok = self._slots[None, :] >= pad[:, None]  # (B, max_len)
        if self._pads is None:
            self._pads, self._key_ok = pad, key_ok
            self._mask, self._positions = key_ok.clone(), pad.clone().view(-1, 1)
        else:  # a captured graph reads these very tensors: update them in place
            self._pads.copy_(pad)
            self._key_ok.copy_(key_ok)
        self.rewind()

    def rewind(self) -> None:
        """Graph mode: the device-side position, mask and rope positions at `offset` again
        (after warm-up or capture runs moved them on)."""
        self.pos.fill_(self.offset)
        self._follow_pos()

    def _follow_pos(self) -> None:
        """The mask and rope positions of a query at slot pos (in place: a graph reads them)."""
        # keys <= pos that are not padding
        torch.logical_and(self._key_ok, self._slots[None, :] <= self.pos, out=self._mask)
        torch.sub(self.pos, self._pads, out=self._positions[:, 0])
        for w, m in self._windowed.items():
            cap = self._cap_of[w]
            if cap == self.max_len:  # and within the window: slot > pos - w
                torch.logical_and(self._mask, self._slots[None, :] > self.pos - w, out=m)
            else:  # a ring: slot s holds position pos - d, d = (pos - s) mod cap
                d = torch.remainder(self.pos - self._slots[:cap], cap)
                p = self.pos - d
                ok = (d < w)[None, :] & (p[None, :] >= self._pads[:, None])
                m.copy_(ok)
        for cap, r in self._ring_pos.items():
            torch.remainder(self.pos, cap, out=r)

    def mask(self, length, pads, window=None):
        if self.graph:
            if window is None:
                return self._mask[:, None, None, :]
            if window not in self._windowed:  # made in a warm-up pass, before the capture
                cap = self._cap_of[window]
                self._windowed[window] = torch.empty_like(self._mask[:, :cap])
                self._follow_pos()
            return self._windowed[window][:, None, None, :]
        cap = self._cap_of.get(window, self.max_len)
        if cap < self.max_len and self.offset + length > cap:
            m = ring_mask_np(self.offset, length, pads, window, cap)
            return torch.from_numpy(m).to(self.device)
        plain = window is None or self.offset + length <= window
        if self.offset == 0 and length > 1 and (pads is None or not pads.any()) and plain:
            return CAUSAL
        m = causal_mask_np(self.offset, length, pads, window)
        return None if m is None else torch.from_numpy(m).to(self.device)

    def positions(self, length, pads):
        if self.graph:
            return self._positions  # (B, 1)
        return torch.from_numpy(positions_np(self.offset, length, pads)).to(self.device)

    def update_and_fetch(self, layer, k, v):
        cap, T, kv = self.caps[layer], k.shape[2], self.kv
        if self.graph:
            at = self.pos if cap == self.max_len else self._ring(cap)
            kv.write(layer, k, v, lambda buf, x: buf.index_copy_(2, at, x))
        elif cap < self.max_len:
            self._check(T, cap)
            for s, t, n in ring_slices(self.offset, T, cap):
                kv.write(layer, k[:, :, t : t + n], v[:, :, t : t + n],
                         lambda buf, x, s=s, n=n: buf[:, :, s : s + n].copy_(x))  # fmt: skip
        else:
            self.slots(layer, T)  # checks the length
            o = self.offset
            kv.write(layer, k, v, lambda buf, x: buf[:, :, o : o + T].copy_(x))
        return self.fetch(layer, T)

    def _ring(self, cap: int) -> torch.Tensor:
        """Graph mode: the device slot pos % cap of a ring (made before the capture)."""
        if cap not in self._ring_pos:
            self._ring_pos[cap] = torch.remainder(self.pos, cap)
        return self._ring_pos[cap]

    def _check(self, length: int, cap: int) -> None:
        if self.offset + length > self.max_len:
            raise MlxrunError(
                f"the KV cache holds {self.max_len} positions and generation "
                f"needs {self.offset + length}; raise the context / max tokens"
            )
        # a longer pass would overwrite keys that its own first queries still see
        assert length <= self.chunk, "a pass longer than the cache's chunk"

    def slots(self, layer: int, length: int):
        """(keys, values, slot): where `length` new positions of `layer` go, position t at
        index (slot[0] + t) mod the buffer's length along dim 2 (slot a device int64, so a
        captured graph reads it; the modulus wraps a sliding-window layer's ring)."""
        cap = self.caps[layer]
        if self.graph:
            return *self.kv.stored(layer), self.pos
        if cap < self.max_len:
            self._check(length, cap)
            slot = self._ring_slot.get(cap)
            if slot is None:  # one host-to-device copy per ring size and pass
                slot = self._ring_slot[cap] = torch.tensor([self.offset % cap], device=self.device)
            return *self.kv.stored(layer), slot
        end = self.offset + length
        if end > self.max_len:
            raise MlxrunError(
                f"the KV cache holds {self.max_len} positions and generation "
                f"needs {end}; raise the context / max tokens"
            )
        return *self.kv.stored(layer, self.offset), self._zero

    def fetch(self, layer: int, length: int, stored: bool = False):
        """The keys and values to attend to once `length` new positions are written: the
        filled prefix, or a whole ring once it has wrapped (its mask says which). `stored`:
        as the buffers hold them (a quantized cache's QuantKV), for the decode kernel."""
        end = self.caps[layer]  # graph mode: the whole buffer, masked to the filled prefix
        if not self.graph:
            end = min(self.offset + length, end)
        if stored:
            return self.kv.stored(layer, 0, end)
        return self.kv.read(layer, end)

    def advance(self, n: int) -> None:
        if self.graph:  # recorded in the graph; the host offset is kept by the caller
            if self._fused and n == 1 and not self._windowed:  # the kernel moves one mask
                from .cuda_ops import graph_advance  # noqa: PLC0415

                graph_advance(self.pos, self._pads, self._key_ok, self._mask, self._positions)
            else:
                self.pos += n
                self._follow_pos()
        else:
            self.offset += n
            self._ring_slot.clear()
