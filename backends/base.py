"""The backend interface the model is written against, and the backend registry.

A backend owns arrays on one device in one compute dtype. The model calls only the
methods below plus `+`, `*`, `reshape`, `swapaxes` and basic slicing, which MLX arrays
and torch tensors both support, so the forward pass exists once.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mlxrun.weights import Tensor

Array = Any  # mx.array or torch.Tensor


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear or embedding weight in the canonical packed format, on a backend.

    weight: uint32 (out, in*bits/32); scales, biases: (out, in/group_size); biases is None
    for the floating-point modes. Stacked experts carry a leading E axis on all three. `kernel` is backend-specific prepared state (e.g. a Triton
    repack) or None.
    """

    weight: Array
    scales: Array
    biases: Array | None
    mode: str
    bits: int
    group_size: int
    kernel: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """(out, in), or (E, out, in) for stacked experts."""
        *lead, packed = self.weight.shape
        return (*(int(d) for d in lead), int(packed) * 32 // self.bits)


class KVCache(Protocol):
    """Keys and values of every layer for a batch of sequences.

    `offset` is the number of positions already written. For a forward pass of T tokens
    the model asks the cache for the attention masks (one per attention window its layers
    use) and rope positions (the cache knows its
    layout), stores k, v (B, kv_heads, T, head_dim) of each layer through the backend's
    `rope_and_cache` (by default `update_and_fetch(layer, k, v)`), then calls `advance(T)`.
    """

    offset: int

    def mask(
        self, length: int, pads: np.ndarray | None, window: int | None = None
    ) -> Array | None: ...
    def positions(self, length: int, pads: np.ndarray | None) -> Array: ...
    def update_and_fetch(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]: ...

    def advance(self, n: int) -> None: ...


class Backend(Protocol):
    name: str  # "mlx" or "torch"
    gguf_blocks: tuple[str, ...]  # GGUF block types whose linears it reads as stored
    device: str  # "gpu"/"cpu" for mlx; "cuda"/"mps"/"cpu" for torch
    dtype: str  # "float32", "bfloat16" or "float16"
    # rope_and_cache takes q with fewer rows than k, v (the pass's last ones): a prompt pass
    # that keeps only the last row's logits then projects the last layer's last query alone
    short_queries: bool

    def describe(self) -> str: ...
    def array(self, t: Tensor | np.ndarray, keep_dtype: bool = False) -> Array: ...
    def quantized(
        self,
        weight: Tensor,
        scales: Tensor,
        biases: Tensor | None,
        mode: str,
        bits: int,
        group_size: int,
    ) -> QuantizedWeight: ...
    def quantize(self, w: Array, mode: str, bits: int, group_size: int) -> QuantizedWeight: ...
    def ids(self, ids: np.ndarray) -> Array: ...
    def to_numpy(self, x: Array) -> np.ndarray: ...
    def linear(self, x: Array, w: Array | QuantizedWeight, bias: Array | None = None) -> Array: ...
    def linears(
        self, x: Array, ws: tuple, biases: tuple | None = None
    ) -> list[Array]: ...  # several linears of one input (a backend may run them as one)
    def embedding(self, ids: Array, w: Array | QuantizedWeight) -> Array: ...
    def rms_norm(self, x: Array, w: Array, eps: float) -> Array: ...
    def add_rms_norm(
        self, h: Array, y: Array | None, w: Array, eps: float
    ) -> tuple[Array, Array]: ...
    def rope_table(self, inv_freq: np.ndarray) -> Array: ...
    def rope(self, x: Array, positions: Array, table: Array) -> Array: ...
    def rope_and_cache(
        self, q: Array, k: Array, v: Array, positions: Array, table: Array, cache, layer: int
    ) -> tuple[Array, Array, Array]: ...  # rope q and k, store k, v: (q, keys, values)
    def attention(
        self, q: Array, k: Array, v: Array, scale: float, mask: Array | None, sinks=None
    ) -> Array: ...  # sinks (NH,) or None: a learned logit per head joining the softmax
    def silu_gated(self, x: Array, gate, up) -> Array: ...  # silu(x @ gate^T) * (x @ up^T)
    def all_sum(self, x: Array) -> Array: ...  # x summed over the ranks (tensor parallel)
    def all_gather(self, x: Array, width: int) -> Array: ...  # (..., k) from every rank ->
    # (..., width): the ranks' x side by side in rank order, the first `width` columns kept
    def embedding_sum(
        self, ids: Array, w: Array | QuantizedWeight, start: int, rows: int, partial=False
    ) -> Array: ...  # w: rows [start, start+rows) of the table; ids outside read zeros,
    # and the lookups are summed over the ranks (the table split by vocabulary); partial:
    # the sum may be left to the add_rms_norm that takes it as h (as linear_sum's)
    def linear_sum(
        self, x: Array, w: Array | QuantizedWeight, bias: Array | None = None
    ) -> Array: ...  # x @ w^T summed over the ranks (w split by input), then + bias; it may
    # come back in float32 (unrounded partial sums): add_rms_norm rounds it to h's dtype
    def gated_mlp(
        self, x: Array, gate, up, act: str, biases: tuple | None = None
    ) -> Array: ...  # act(x @ gate^T + bg) * (x @ up^T + bu); act one of config.ACTIVATIONS
    def sigmoid(self, x: Array) -> Array: ...  # 1 / (1 + exp(-x)), elementwise
    def moe(
        self, x: Array, logits: Array, experts, opts
    ) -> Array: ...  # x (B, T, H), router logits (B, T, E), mlxrun.moe.Experts and
    # MoEOptions -> (B, T, H): each token's top-k experts, weighted by the routing, summed;
    # logits None: the backend computes them, linear(x, experts.router, .router_bias)
    def moe_sum(
        self, x: Array, logits: Array, experts, opts, shared: tuple | None = None
    ) -> Array: ...  # moe with every expert split by its intermediate rows over the ranks:
    # the partial outputs summed over them (as linear_sum; it may come back in float32).
    # shared (Qwen2-MoE): (a (B, T, S), down (H, S), scale (B, T, 1)): + scale * a @ down^T,
    # down split by input like the experts' (its partial joins theirs in the one sum)
    def argmax(self, logits: Array) -> Array: ...
    def finite_rows(self, logits: Array) -> Array: ...  # (B, V) -> (B,) bool: no NaN or inf
    def thread_binder(self) -> Any: ...  # () -> None: gives a new thread this one's device
    def make_cache(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        windows=None,
        chunk: int | None = None,
    ) -> KVCache: ...  # windows (per layer) + chunk: sliding-window layers hold a ring
    def make_slot_cache(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        windows=None,
        chunk: int | None = None,
    ) -> KVCache: ...  # rows of their own lengths (backends/slots.py), for the engine
    def slot_decoder(
        self, model, cache: KVCache, max_batch: int
    ) -> Any: ...  # the engine's fixed-shape decode steps over a slot cache, or None
    def spec_passes(
        self, model, max_len: int, sizes: tuple[int, ...]
    ) -> Any: ...  # speculative decoding's fixed-shape passes of a few tokens, or None
    def random_normal(self, shape: tuple[int, ...], std: float, seed: int) -> Array: ...
    def random_bits(self, shape: tuple[int, ...], seed: int) -> Array: ...
    def wired(self, nbytes: int) -> AbstractContextManager: ...
    def start(self, *xs: Array) -> None: ...  # begin computing xs (and their copies to the
    # host), one point of the decode timeline; they must not be changed afterwards
    def queue(self, *xs: Array) -> None: ...  # begin computing xs where the backend is
    # lazy (MLX), so host work that follows overlaps it; no copy, no timeline point
    def synchronize(self) -> None: ...
    def peak_memory(self) -> int: ...
    def reset_peak_memory(self) -> None: ...


def causal_mask_np(
    offset: int, length: int, pads: np.ndarray | None, window: int | None = None
) -> np.ndarray | None:
    """Boolean attention mask (B or 1, 1, length, offset+length); True = may attend.

    Query t sits at absolute slot offset+t and sees slots <= its own; with a `window`, only
    the `window` latest of them (itself included: slot > own - window, as transformers'
    sliding_window_overlay). For left-padded batches, sequence b also hides its first
    pads[b] slots (padding shifts queries and keys alike, so slot distance is position
    distance). None when nothing needs masking (one new token, no padding, all in window).
    """
    total = offset + length
    in_window = window is None or total <= window
    if length == 1 and (pads is None or not pads.any()) and in_window:
        return None
    q = np.arange(offset, total)[:, None]
    k = np.arange(total)[None, :]
    m = (k <= q)[None, None]  # (1, 1, T, S)
    if not in_window:
        m = m & (k > q - window)
    if pads is not None and pads.any():
        # Real queries never see padding. A padding query sees only itself: a row with no
        # key at all would give NaN, which would reach real rows through the cache (0 * NaN).
        m = m & ((k >= pads[:, None, None, None]) | (k == q))
    return m


def ring_capacity(window: int | None, max_len: int, chunk: int | None) -> int:
    """Slots a layer's KV cache holds: all `max_len` positions, or for a sliding-window layer
    run in passes of at most `chunk` tokens a ring of window + chunk - 1 (the keys the
    pass's first query still sees, plus the pass's own), written at position % capacity."""
    if window is None or chunk is None:
        return max_len
    return min(max_len, window + chunk - 1)


def ring_slices(offset: int, length: int, cap: int) -> list[tuple[int, int, int]]:
    """Where positions offset .. offset+length-1 go in a ring of `cap` slots: (first slot,
    first new token, count) for each contiguous run (two when the pass wraps)."""
    s = offset % cap
    n = min(length, cap - s)
    return [(s, 0, n)] + ([(0, n, length - n)] if n < length else [])


def ring_mask_np(
    offset: int, length: int, pads: np.ndarray | None, window: int, cap: int
) -> np.ndarray | None:
    """causal_mask_np for keys in a ring of `cap` slots that holds the `cap` latest positions
    once this pass is written: (B or 1, 1, length, cap), or (.., offset+length) while
    nothing has wrapped (slots are positions then)."""
    total = offset + length
    if total <= cap:
        return causal_mask_np(offset, length, pads, window)
    slots = np.arange(cap)
    p = (total - 1 - (total - 1 - slots) % cap)[None, :]  # the position each slot holds
    q = np.arange(offset, total)[:, None]
    m = ((p <= q) & (p > q - window))[None, None]  # (1, 1, T, cap)
    if pads is not None and pads.any():
        m = m & ((p >= pads[:, None, None, None]) | (p == q))
    return m


def positions_np(offset: int, length: int, pads: np.ndarray | None) -> np.ndarray:
    """Rope positions (B or 1, length) int32: left padding shifts each sequence back so its
    first real token sits at position 0, as it would when run alone."""
    pos = np.arange(offset, offset + length, dtype=np.int32)[None]
    if pads is not None:
        pos = pos - pads[:, None].astype(np.int32)
    return pos
