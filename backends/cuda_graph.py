"""The PyTorch backend's captured decode step on CUDA (TorchBackend.decode_step)."""

from __future__ import annotations

import numpy as np
import torch

from mlxrun.backends.torch_cache import StaticCache


class GraphDecoder:
    """Decode steps replayed from one captured CUDA graph, greedy or through a sampler.

    Capturing removes the per-kernel launch cost (hundreds of launches per token), which
    otherwise dominates batch-1 decode. The graph reads the tokens from a static buffer and
    writes their argmax back into it, so consecutive steps need no copy in or out between
    replays (each was a launch of its own on the GPU's timeline). `__call__` returns a view
    of that buffer: valid until the next call, which overwrites it (the decode loop queues
    its host copy first, through `TorchBackend.start`).
    """

    def __init__(
        self, model, cache: StaticCache, batch: int, pads: np.ndarray | None, sampler=None
    ):
        self.model, self.cache, self.busy = model, cache, True
        self.sampler = sampler  # its options and state are tensors the graph reads
        cache.enter_graph(pads)
        dev = cache.device
        self.tok = torch.zeros((batch, 1), dtype=torch.int64, device=dev)
        saved = sampler.save() if sampler is not None else None
        self.ok = torch.ones((batch,), dtype=torch.bool, device=dev)  # rows' logits finite
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up runs (autotuning, workspaces) before capture
            for _ in range(2):
                self._step(pads)
                cache.rewind()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step(pads)
        cache.rewind()
        if sampler is not None:  # the warm-up and capture runs moved its counters on
            sampler.restore(saved)

    @property
    def plan(self):
        return None if self.sampler is None else self.sampler.plan

    def _step(self, pads):
        be = self.model.be
        logits = self.model(self.tok, self.cache, pads, last_only=True)
        if self.sampler is not None:
            self.tok.copy_(self.sampler(logits).view(-1, 1))
        elif be.triton_kernels:
            from .cuda_ops import argmax  # noqa: PLC0415

            argmax(logits, out=self.tok.view(-1))
        else:
            self.tok.copy_(be.argmax(logits).view(-1, 1))
        self.ok.copy_(be.finite_rows(logits))

    @property
    def finite(self):
        """The last replay's `finite_rows` (B,) bool: a fresh view, as start() keys on it."""
        return self.ok.view(-1)

    def __call__(self, y):
        if y.data_ptr() != self.tok.data_ptr():
            self.tok.copy_(y.view(-1, 1))
        self.graph.replay()
        self.cache.offset += 1
        return self.tok.view(-1)

    def close(self) -> None:
        """The generation is over: the graph and its cache may serve the next one."""
        self.busy = False
