"""Speculative decoding's forward passes on the PyTorch CUDA code path: a few consecutive
tokens of one sequence at any offset, one CUDA graph per pass size.

Eagerly, a forward pass of an 8B model is hundreds of kernel launches from Python: ~40 ms on
an H100 against 2.2 ms for the captured decode step, so an eager verify of k+1 tokens cost
19 plain steps and speculative decoding lost 10-20x. Replayed, the verify is one launch and
reads the weights once, like a decode step.

The passes are the serve engine's fixed-shape steps (slot_graph.py) over a batch-1
StaticCache seen as a slot cache of one row: token t of a pass is row t of the step, at
position offset + t of that row, and sees keys up to its own position; rope_qkv stores
every row's key before decode_attention reads any, so the rows are the pass's causal
attention (the engine's prefill tails run the same way). The positions are device buffers
the host loads, so one graph serves every offset; the step writes each row's argmax into
its token buffer and moves the positions on by one, so a 1-token pass fed its own output
needs no copy in (the draft model's decode).

A pass of n tokens runs in the smallest captured size >= n; the rows past n repeat
positions after the real ones (clamped to the cache's last slot, which no real position
reaches): their keys are written where nothing reads them before a later pass, which moves
on by the accepted count, overwrites them. That is also the rollback: rejected drafts'
keys stay in the buffers and are overwritten, never read (a row's mask ends at its own
position).
"""

from __future__ import annotations

import numpy as np
import torch

from mlxrun.backends.slot_graph import SlotStep
from mlxrun.backends.torch_cache import StaticCache

# Models whose passes are kept for their next generation (a capture costs three eager passes
# a size, ~0.1 s for an 8B model): the target and its draft.
HELD = 2
# Held caches grow to a multiple of this many positions, so that generations of similar
# lengths reuse one capture (masked key blocks past a sequence's end are not read).
ROUND = 256


class _OneRow:
    """A batch-1 StaticCache as slot_graph.SlotRows sees a slot cache: row 0 its sequence."""

    # SlotRows' scratch row for dummy rows of a ring layer: there are no dummies here (every
    # row is the sequence's, `live`), and a StaticCache made without a chunk has no rings
    slots = 0

    def __init__(self, cache: StaticCache):
        self.cache, self.max_len = cache, cache.max_len
        self._cap_of, self.kv, self.keys = cache._cap_of, cache.kv, cache.keys

    def ring(self, layer: int) -> int | None:
        cap = self.cache.caps[layer]
        return cap if cap < self.max_len else None


class _Pass(SlotStep):
    """A step whose logits (rows, V) stay readable after it runs: the host needs them for
    sampled speculative decoding's probabilities."""

    def _forward(self):
        self.logits = super()._forward()  # held: a captured graph's output stays valid
        return self.logits


class RowPasses:
    """Passes over n consecutive tokens of the sequence in `cache` (batch 1), for n up to
    max(sizes), each run in the smallest step of `sizes` that holds it: CUDA graphs when
    `capture`, else the same steps run as they are (tests on the CPU)."""

    def __init__(self, model, cache: StaticCache, capture: bool):
        self.model, self.cache, self.capture = model, cache, capture
        self.view = _OneRow(cache)
        self.steps: dict[int, _Pass] = {}
        self.at: dict[int, int | None] = {}  # size -> the offset its device positions hold
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.busy = True

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.steps))

    def ensure(self, sizes) -> None:
        """Capture the steps of `sizes` not captured yet (largest first: they share one
        pool, sized by the largest). Their warm-up runs write only the cache's last slot,
        which no real position reaches."""
        for n in sorted(set(sizes) - set(self.steps), reverse=True):
            self.steps[n] = _Pass(self.model, self.view, n, None, self.capture, self.pool)
            self.at[n] = None

    def __call__(self, tokens, offset: int):
        """Run tokens (a list of ints, or a device int64 array (n,)) at positions offset ..
        offset + n - 1 -> (logits (n, V), argmax (n,), finite (n,)): the logits a view the
        next pass of the same size overwrites, the other two the caller's own."""
        n = len(tokens)
        b = next(s for s in self.sizes if s >= n)
        step = self.steps[b]
        io = step.io  # (5, b): token, row, position, lowest key, live
        host = isinstance(tokens, list)
        if host or self.at[b] != offset:
            pos = offset + np.arange(b)
            last = self.cache.max_len - 1
            fill = np.zeros((5, b), dtype=np.int64)
            if host:
                fill[0, :n] = tokens
            fill[2] = np.minimum(pos, last)
            fill[4] = 1
            io.copy_(torch.from_numpy(fill))
            self.at[b] = offset + 1 if pos[-1] < last else None
        else:
            self.at[b] = offset + 1
        if not host and tokens.data_ptr() != io[0].data_ptr():
            io[0, :n].copy_(tokens.view(-1))
        step()
        return step.logits[:n], io[0, :n].clone(), step.ok[:n].clone()

    def close(self) -> None:
        """The generation is over: the passes and their cache may serve the next one."""
        self.busy = False


def _cache(model, max_len: int) -> StaticCache:
    """A batch-1 cache of its own (not the backend's reused decode cache, which the draft
    model's or a plain generation's graph may hold)."""
    be, c = model.be, model.config
    windows = [c.window(i) for i in range(c.num_hidden_layers)]
    return StaticCache(
        c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, max_len, be._dt, be._dev,
        be.triton_kernels, windows, None, model.kv_quant,
    )  # fmt: skip


def passes_for(be, model, max_len: int, sizes) -> RowPasses:
    """Passes of `sizes` over a cache of at least `max_len` positions for `model`: a held
    set not in use (the one with most of the sizes captured), else a new one, held in place
    of the oldest idle one."""
    rounded = -(-max_len // ROUND) * ROUND
    idle = [
        p
        for p in be._spec
        if p.model is model and not p.busy and max_len <= p.cache.max_len <= 4 * rounded
    ]
    if idle:
        p = max(idle, key=lambda p: len(set(sizes) & set(p.steps)))
        be._spec.remove(p)
        p.busy = True
        p.cache.reset()
    else:
        while len(be._spec) >= HELD and any(not q.busy for q in be._spec):
            be._spec.remove(next(q for q in be._spec if not q.busy))
            if be.device == "cuda":
                torch.cuda.empty_cache()  # before the new cache is allocated
        p = RowPasses(model, _cache(model, rounded), be.cuda_graphs)
    be._spec.append(p)  # most recently used last
    p.ensure(sizes)
    return p
