"""The PyTorch backend's captured decode step on CUDA (TorchBackend.decode_step)."""

from __future__ import annotations

import numpy as np
import torch

from mlxrun.backends.torch_cache import StaticCache


class GraphDecoder:
    """Decode steps replayed from captured CUDA graphs, greedy or through a sampler.

    Capturing removes the per-kernel launch cost (hundreds of launches per token), which
    otherwise dominates batch-1 decode. The graph reads the tokens from a static buffer and
    writes their argmax back into it, so consecutive steps need no copy in or out between
    replays (each was a launch of its own on the GPU's timeline). `__call__` returns a view
    of that buffer: valid until the next call, which overwrites it (the decode loop queues
    its host copy first, through `TorchBackend.start`).

    With a masked plan (grammar-constrained rows) the step is two graphs: `forward` (token
    buffer -> logits buffer) and `sample` (logits and the sampler's mask buffer -> token
    buffer). The forward pass of step t+1 needs only token t, already on the device, so it
    is queued before the host has read token t; the host then advances the grammars and
    fills the masks while the GPU runs it, and `sample` is queued once the mask is copied
    in. Free plans keep one graph: one replay a step, as before.
    """

    def __init__(
        self, model, cache: StaticCache, batch: int, pads: np.ndarray | None, sampler=None
    ):
        self.model, self.cache, self.busy = model, cache, True
        self.sampler = sampler  # its options and state are tensors the graph reads
        self.split = sampler is not None and sampler.plan.masked
        cache.enter_graph(pads)
        self._pads = pads
        dev = cache.device
        self.tok = torch.zeros((batch, 1), dtype=torch.int64, device=dev)
        saved = sampler.save() if sampler is not None else None
        self.ok = torch.ones((batch,), dtype=torch.bool, device=dev)  # rows' logits finite
        self.logits = None  # (B, V): the forward graph's output, the sample graph's input
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up runs (autotuning, workspaces) before capture
            for _ in range(2):
                self._sample(self._forward())
                cache.rewind()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.sample_graph = None
        if self.split:
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
            # the same pool: the sample graph always replays after the forward graph, and the
            # logits it reads stay allocated (held here)
            self.sample_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.sample_graph, pool=self.graph.pool()):
                self._sample(self.logits)
        else:
            with torch.cuda.graph(self.graph):
                self._sample(self._forward())
        cache.rewind()
        if sampler is not None:  # the warm-up and capture runs moved its counters on
            sampler.restore(saved)

    @property
    def plan(self):
        return None if self.sampler is None else self.sampler.plan

    def _forward(self):
        return self.model(self.tok, self.cache, self._pads, last_only=True)

    def _sample(self, logits) -> None:
        be = self.model.be
        if self.sampler is None and be.triton_kernels:
            from .cuda_ops import argmax  # noqa: PLC0415

            argmax(logits, out=self.tok.view(-1), ok=self.ok)  # the finite flags in the same launch
            return
        if self.sampler is not None:
            self.tok.copy_(self.sampler(logits).view(-1, 1))
        else:
            self.tok.copy_(be.argmax(logits).view(-1, 1))
        self.ok.copy_(be.finite_rows(logits))

    @property
    def finite(self):
        """The last replay's `finite_rows` (B,) bool: a fresh view, as start() keys on it."""
        return self.ok.view(-1)

    def forward(self, y) -> None:
        """Queue the forward pass of the step fed `y` (B,) (a split decoder's first half);
        `sample` then picks its tokens."""
        if y.data_ptr() != self.tok.data_ptr():
            self.tok.copy_(y.view(-1, 1))
        self.graph.replay()
        self.cache.offset += 1

    def sample(self):
        """Queue the sampling of the last `forward`'s logits under the sampler's current
        mask; returns the tokens (B,), a view of the token buffer as `__call__`'s."""
        self.sample_graph.replay()
        return self.tok.view(-1)

    def __call__(self, y):
        if self.split:
            self.forward(y)
            return self.sample()
        if y.data_ptr() != self.tok.data_ptr():
            self.tok.copy_(y.view(-1, 1))
        self.graph.replay()
        self.cache.offset += 1
        return self.tok.view(-1)

    def close(self) -> None:
        """The generation is over: the graph and its cache may serve the next one."""
        self.busy = False
