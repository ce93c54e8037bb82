"""The serving engine's decode steps on the PyTorch CUDA code path: one CUDA graph per
batch-size bucket (and sampling plan), over the slot cache's rows in place.

The engine's running sequences sit in slots of their own lengths, and they join and leave
between steps; a captured graph needs fixed shapes and addresses. So a step of bucket b runs
b rows whose token, slot and write position are device buffers (`SlotRows`): the Triton
kernels store each row's k, v at its own position of its own slot (`rope_qkv` with rows)
and attend to that slot in place (`decode_attention` with rows), under a mask the step
builds from the positions. The device sampler and the finite-rows flags are in the graph.

Rows past the running ones are dummies. They write, and attend to, only the last position
of slot 0, which no sequence uses (a sequence that fills the context never feeds its last
token back), so they cannot touch a real row's keys; every other operation is row by row,
so they do not change a real row's result either.

A sliding-window layer's rows are rings (backends/slots.py): position p at ring slot
p % capacity, where rope_qkv's store wraps already; the step's mask for that window says,
per row, which position each ring slot holds (the latest one at or before the row's own).
A ring has no position that no sequence uses, so there the dummies write into a scratch
row of their own, past the slots (TorchSlotCache keeps one in each ring).

A step writes its tokens back into its input buffer and moves the positions (and the
sampler's counters and windows) on, so while the same sequences run in the same rows a
replay needs no copy in: the host loads the buffers only when the batch changes.

The same steps run the short last prefill chunk of a prompt (the tail after a cached
prefix, or a whole short prompt): its n tokens are n rows of one slot at consecutive
positions. rope_qkv stores every row's key before decode_attention reads any, and row t
sees keys up to its own position, so the rows are the chunk's causal attention; the last
row's token is the first generated one. Eagerly, those few tokens cost a forward pass of
kernel launches from Python (hundreds of them), which is most of a cached request's time to
first token; replayed, one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from mlxrun.sampling import SamplerPlan, SamplingParams, pack, plan_for

# (token, slot, write position, lowest visible key, 1 for a sequence / 0 for a dummy) a row
_IO = 5
# Steps of sampled plans are captured as requests ask for them (top-k values differ); the
# least recently used go beyond this many. Greedy steps, captured at start, always stay.
MAX_SAMPLED_STEPS = 16
# The longest last prefill chunk run as a step (rows of one slot); longer ones run eagerly,
# where the launches are a small share of the pass. Steps of 1, 2, 4 .. 64 rows are captured
# for them beside the batch-size buckets.
TAIL_MAX = 64


class RowMask(NamedTuple):
    """What `SlotRows.mask` gives the attention: the mask and the slot each row reads."""

    mask: torch.Tensor  # (b, 1, 1, S) bool, True = may attend
    rows: torch.Tensor  # (b,) int64


class SlotRows:
    """The KV-cache protocol for a decode step of b rows over a TorchSlotCache's buffers:
    row i is slot rows[i], writing at pos[i] and seeing keys lo[i]..pos[i] (lo is 0 for a
    sequence). All of it is on the device, in `io` (5, b) int64."""

    def __init__(self, cache, io: torch.Tensor):
        self.cache = cache
        self.tok, self.rows, self.pos, self.lo, self.live = io.unbind(0)
        self.offset = 0  # the protocol's; positions are per row here
        self._keys = torch.arange(cache.max_len, device=io.device)
        self._ring_rows: torch.Tensor | None = None  # made in the step, by the first ring mask
        self._scratch = torch.full_like(self.rows, cache.slots)  # (a device tensor: capturable)

    def mask(self, length: int, pads, window: int | None = None) -> RowMask:
        cap = self.cache._cap_of.get(window, self.cache.max_len)
        P = self.pos[:, None]
        if cap < self.cache.max_len:  # a ring: slot s holds position P - ((P - s) mod cap)
            k = P - torch.remainder(P - self._keys[None, :cap], cap)  # (b, cap)
            m = (k >= self.lo[:, None]) & (k > P - window) & (k >= 0)
            return RowMask(m[:, None, None, :], self.ring_rows())
        k = self._keys[None, :]
        m = (k >= self.lo[:, None]) & (k <= P)
        if window is not None:
            m = m & (k > P - window)
        return RowMask(m[:, None, None, :], self.rows)

    def ring_rows(self) -> torch.Tensor:
        """(b,) the rows of a ring layer: the sequences' slots, the dummies' scratch row."""
        if self._ring_rows is None:
            self._ring_rows = torch.where(self.live != 0, self.rows, self._scratch)
        return self._ring_rows

    def rows_for(self, layer: int) -> torch.Tensor:
        """(b,) the cache rows that layer `layer`'s steps write and read."""
        return self.rows if self.cache.ring(layer) is None else self.ring_rows()

    def positions(self, length: int, pads) -> torch.Tensor:
        return self.pos.view(-1, 1)  # (b, 1): a row's rope position is its write position

    def buffers(self, layer: int):
        """Layer's whole k, v caches (slots, kv_heads, max_len, D), or a ring's (slots + 1,
        kv_heads, capacity, D): read through `rows_for(layer)` (a quantized cache's:
        torch_kv.QuantKV, codes and scales)."""
        return self.cache.kv.stored(layer)

    def update_and_fetch(self, layer, k, v):
        """Without the Triton kernels: store k, v (b, kv_heads, 1, D) at each row's slot and
        position; the attention gathers the rows (RowMask)."""
        cap = self.cache.kv.keys[layer].shape[2]
        rows, pos = self.rows_for(layer), self.pos % cap  # (a ring wraps)
        self.cache.kv.write(layer, k, v, lambda buf, x: buf.__setitem__((rows, slice(None), pos),
                                                                        x[:, :, 0]))  # fmt: skip
        return self.buffers(layer)

    def advance(self, n: int) -> None:
        self.pos.add_(self.live * n)  # the dummies stay on their one position
        self._ring_rows = None  # (the next pass, or the next capture, makes it again)


def buckets(max_batch: int) -> list[int]:
    """Batch sizes with a step of their own: powers of two up to max_batch, and max_batch."""
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return sorted(set(out) | {max_batch})


class SlotStep:
    """One decode step of `batch` rows: greedy (plan None) or through a device sampler of
    `plan`; a CUDA graph when `capture`, else run as it is (the CPU tests of this path)."""

    def __init__(self, model, cache, batch: int, plan: SamplerPlan | None, capture: bool, pool):
        be = model.be
        self.model, self.batch, self.plan = model, batch, plan
        dev = cache.keys[0].device
        self.io = torch.zeros((_IO, batch), dtype=torch.int64, device=dev)
        self.rows = SlotRows(cache, self.io)
        self.ok = torch.ones((batch,), dtype=torch.bool, device=dev)
        self.sampler = None
        if plan is not None:
            idle = [SamplingParams()] * batch
            self.sampler = be.sampler(plan, pack(idle, [[]] * batch, plan, [0] * batch))
        self.dummy_io = np.zeros((_IO, batch), dtype=np.int64)
        self.dummy_io[2:4] = cache.max_len - 1  # the one position no sequence uses
        self.io.copy_(torch.from_numpy(self.dummy_io))  # warm-up and capture touch nothing
        self.graph = self.sample_graph = None
        self.logits = None  # (batch, V): a split step's forward output, its sample's input
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up runs (autotuning, workspaces) first
                for _ in range(2):
                    self._sample(self._forward())
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            if self.split:
                # Grammar-constrained rows: forward and sample are two graphs, so the forward
                # pass runs while the host fills the masks (the same pool: the sample graph
                # always replays after the forward graph, whose logits stay held here)
                with torch.cuda.graph(self.graph, pool=pool):
                    self.logits = self._forward()
                self.sample_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.sample_graph, pool=pool):
                    self._sample(self.logits)
            else:
                with torch.cuda.graph(self.graph, pool=pool):
                    self._sample(self._forward())

    @property
    def split(self) -> bool:
        """Whether the step runs as `forward` then `sample` (a masked plan: the host sets
        the mask in between)."""
        return self.plan is not None and self.plan.masked

    def _forward(self):
        return self.model(self.rows.tok.view(-1, 1), self.rows, None, last_only=True)

    def _sample(self, logits) -> None:
        be = self.model.be
        if self.sampler is None and be.triton_kernels:
            from .cuda_ops import argmax  # noqa: PLC0415

            argmax(logits, out=self.rows.tok, ok=self.ok)  # the finite flags in the same launch
            return
        if self.sampler is not None:
            self.rows.tok.copy_(self.sampler(logits))
        else:
            self.rows.tok.copy_(be.argmax(logits))
        self.ok.copy_(be.finite_rows(logits))

    def load(self, io: np.ndarray, state: dict | None) -> None:
        """The rows' buffers (io (5, batch)) and sampler state, for a new set of sequences."""
        self.io.copy_(torch.from_numpy(io))
        if self.sampler is not None:
            self.sampler.load(state)

    def forward(self) -> None:
        """Queue a split step's forward pass; `sample` then picks the tokens under the
        sampler's mask, set in between."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._forward()

    def sample(self):
        """A split step's second half: (tokens, flags, logprobs) as `__call__` returns."""
        if self.sample_graph is not None:
            self.sample_graph.replay()
            return self._outputs()
        self._sample(self.logits)
        self.logits = None
        return self._copies()

    def __call__(self):
        """Run the step: (tokens (batch,), finite flags (batch,), the sampler's logprobs or
        None). Replayed, they are fresh views of buffers the next replay overwrites (the
        engine queues their copies to the host first, `be.start`); run eagerly, copies."""
        if self.split:
            self.forward()
            return self.sample()
        if self.graph is not None:
            self.graph.replay()
            return self._outputs()
        self._sample(self._forward())
        return self._copies()

    def _outputs(self):
        lps = self.sampler.logprobs() if self.sampler is not None else None
        return self.io[0].view(-1), self.ok.view(-1), lps

    def _copies(self):
        lps = None
        if self.sampler is not None and self.sampler.logprobs() is not None:
            lps = tuple(None if x is None else x.clone() for x in self.sampler.logprobs())
        return self.io[0].clone(), self.ok.clone(), lps


class SlotDecoder:
    """The engine's decode steps for the rows of a TorchSlotCache, one `SlotStep` per
    (bucket, sampling plan): a batch of n sequences runs in the smallest bucket >= n."""

    def __init__(self, model, cache, max_batch: int, capture: bool, tail_max: int = TAIL_MAX):
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = buckets(max_batch)
        self.tail_max = tail_max
        self.tail_buckets = sorted(set(self.buckets) | set(buckets(tail_max)))  # 1, 2, 4 .. 64
        self.vocab = model.config.vocab_size  # (a CUDA-ready packed head keeps no .weight)
        self.steps: dict[tuple[int, SamplerPlan | None], SlotStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._loaded: tuple | None = None  # (step, batch key) whose buffers are on the device

    def warm(self) -> None:
        """Capture the greedy step of every bucket now, largest first (the graphs share one
        memory pool, which the largest sizes), so no request waits for a capture."""
        for b in reversed(self.tail_buckets):
            self._step(b, None)

    def _step(self, b: int, plan: SamplerPlan | None) -> SlotStep:
        key = (b, plan)
        step = self.steps.pop(key, None)
        if step is None:
            sampled = [k for k in self.steps if k[1] is not None]
            if plan is not None and len(sampled) >= MAX_SAMPLED_STEPS:
                del self.steps[sampled[0]]  # the least recently used
            step = SlotStep(self.model, self.cache, b, plan, self.capture, self.pool)
        self.steps[key] = step  # most recently used last
        return step

    def __call__(self, key, slots, tokens, params, histories, seeds, counts, logprobs):
        """Run one decode step (`step_for`'s arguments, free rows): its (tokens, flags,
        logprobs) device views."""
        return self.step_for(key, slots, tokens, params, histories, seeds, counts, logprobs)()

    def step_for(
        self,
        key,
        slots: list[int],
        tokens: list[int],
        params: list[SamplingParams],
        histories: list[list[int]],
        seeds: list[int],
        counts: list[int],
        logprobs: int | None,
        masked: bool = False,
    ) -> SlotStep:
        """The step for sequences in `slots` (at the cache's host lengths), fed `tokens`,
        its buffers loaded. `key` names the batch (its sequences, in row order): when it and
        the step are the last call's, the device holds the rows' state already and nothing
        is copied in. masked: some rows follow a grammar, so the step is split (`forward`,
        the host's `sampler.set_mask`, `sample`). Its outputs are device views, rows past
        len(slots) being dummies; the caller moves the host lengths on."""
        n = len(slots)
        b = next(x for x in self.buckets if x >= n)
        pad = b - n
        rows = list(params) + [SamplingParams()] * pad
        plain = logprobs is None and all(p.greedy for p in params) and not masked
        plan = None if plain else plan_for(rows, self.vocab, logprobs, masked)
        step = self._step(b, plan)
        if self._loaded != (step, key):
            io = step.dummy_io.copy()
            io[0, :n] = tokens
            io[1, :n] = slots
            io[2, :n] = self.cache.lengths[slots]
            io[3, :n] = 0
            io[4, :n] = 1
            state = None
            if plan is not None:
                state = pack(rows, list(histories) + [[]] * pad, plan,
                             list(seeds) + [0] * pad, list(counts) + [0] * pad)  # fmt: skip
            step.load(io, state)
            self._loaded = (step, key)
        return step

    def prefill(self, slot: int, tokens: list[int], params: SamplingParams,
                history: list[int], seed: int, logprobs: int | None):  # fmt: skip
        """Run the last prefill chunk `tokens` (at most tail_max) of the sequence in `slot`
        (at the cache's host length) as rows of one step, its last row sampled with
        `params` as a first token. -> (token, finite, the sampler's logprobs (device views
        of that row) or None). The caller moves the host length on; the device rows match no batch
        after it (the next decode step loads its own)."""
        n = len(tokens)
        b = next(x for x in self.tail_buckets if x >= n)
        rows = [SamplingParams()] * (b - 1) + [params]  # the sampled row last: bucket b - 1
        plain = logprobs is None and params.greedy
        plan = None if plain else plan_for(rows, self.vocab, logprobs)
        step = self._step(b, plan)
        L = int(self.cache.lengths[slot])
        io = step.dummy_io.copy()
        at = np.arange(b - n, b)  # the chunk's rows end at the last one
        io[0, at] = tokens
        io[1, at] = slot
        io[2, at] = L + np.arange(n)
        io[3, at] = 0
        io[4, at] = 1
        state = None
        if plan is not None:
            state = pack(rows, [[]] * (b - 1) + [history], plan, [0] * (b - 1) + [seed],
                         [0] * b)  # fmt: skip
        step.load(io, state)
        self._loaded = None
        y, ok, lps = step()
        be = self.model.be
        tok = int(be.to_numpy(y).reshape(-1)[b - 1])
        fin = bool(be.to_numpy(ok).reshape(-1)[b - 1])
        return (
            tok,
            fin,
            None if logprobs is None else tuple(None if x is None else x[b - 1 : b] for x in lps),
        )

    def forget(self) -> None:
        """The device rows no longer match any batch (after a failed step)."""
        self._loaded = None
