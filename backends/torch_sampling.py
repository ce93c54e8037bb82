"""Device sampling for the PyTorch backends (cuda, mps, cpu): `mlxrun.sampling`'s
algorithm in torch ops, with no host synchronisation, so a CUDA graph can capture it."""

from __future__ import annotations

import numpy as np
import torch

from mlxrun.sampling import SamplerPlan

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    # (x * c) mod 2^32 for x < 2^32 without an int64 product past 2^63: split c in halves
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def uniform(seed, counter):
    """(B,) int64 seeds and steps -> (B,) float64 in [0, 1): `sampling.uniform_np` in torch."""
    x = (seed ^ _mul32(counter & _M32, 0x9E3779B9)) & _M32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float64) / 2**24


class TorchSampler:
    """logits (B, V) -> next tokens (B,) int64, on the logits' device.

    Options and state are tensors updated in place (`load`, the row counters, the
    repetition windows), so one captured graph serves every step and, through `load`,
    every later generation of the same plan.
    """

    def __init__(
        self, plan: SamplerPlan, state: dict[str, np.ndarray], device, triton: bool = False
    ):
        self.plan = plan
        # CUDA: the draw in three Triton kernels (cuda_sampling) instead of ~50 torch ops
        self._kernels = None
        if triton and plan.sampled:
            from .cuda_sampling import CudaDraw  # noqa: PLC0415

            self._kernels = CudaDraw(plan.batch, plan.vocab, device)
        self.t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in state.items()}
        # float64 keeps the inverse CDF exact to far below one token's share; MPS has none
        self._cdf = torch.float32 if torch.device(device).type == "mps" else torch.float64
        self._rank = torch.arange(max(plan.candidates, 1), device=device)
        self._wpos = torch.arange(plan.window, device=device)
        if plan.masked:  # token i's bit in the (B, ceil(V/32)) bitmask: word i >> 5, bit i & 31
            ids = torch.arange(plan.vocab, device=device)
            self._word, self._bit = ids >> 5, (ids & 31).to(torch.int32)
        self._mask_host = None  # mask_buffer's array
        self._mask_copied = None  # CUDA: the event after its last copy in
        self._last = None  # log-probabilities of the last call (new tensors each eager
        # call; in a captured graph, the graph's own outputs, rewritten at each replay)

    def load(self, state: dict[str, np.ndarray]) -> None:
        """New rows' options and state (same plan), written into the tensors a graph reads."""
        for k, v in state.items():
            self.t[k].copy_(torch.from_numpy(np.ascontiguousarray(v)))

    def load_from(self, other: TorchSampler) -> None:
        """`other`'s options and state (same plan), copied into this sampler's tensors."""
        for k, v in other.t.items():
            self.t[k].copy_(v)

    def mask_buffer(self) -> np.ndarray:
        """A host (B, words) int32 array for the next `set_mask`: on CUDA pinned memory, so
        the copy in is queued without waiting for the step in flight (from pageable memory
        the driver may wait for the stream). Reused: it is handed out once its last copy
        is done (by then, in the decode loops, always)."""
        if self._mask_host is None:
            mask = self.t["mask"]
            pin = mask.device.type == "cuda"
            self._mask_host = torch.empty(mask.shape, dtype=mask.dtype, pin_memory=pin)
        if self._mask_copied is not None:
            self._mask_copied.synchronize()
        return self._mask_host.numpy()

    def set_mask(self, mask: np.ndarray) -> None:
        """The rows' token bitmasks for the next call ((B, words) int32), written into the
        buffer a captured graph reads."""
        self.t["mask"].copy_(torch.from_numpy(mask), non_blocking=True)
        if self.t["mask"].device.type == "cuda":
            self._mask_copied = torch.cuda.Event()
            self._mask_copied.record()

    def save(self) -> tuple:
        return self.t["counter"].clone(), self.t["window"].clone()

    def restore(self, saved: tuple) -> None:
        """Back to `save()`'s state (after a graph's warm-up and capture ran the step)."""
        self.t["counter"].copy_(saved[0])
        self.t["window"].copy_(saved[1])

    def logprobs(self):
        """(chosen (B,), top values (B, n), top ids (B, n)) of the last call, or None where
        not asked for; fresh views, so each can be queued for its own copy to the host."""
        if self._last is None:
            return None
        return tuple(None if x is None else x.view(x.shape) for x in self._last)

    def __call__(self, logits):
        p, t = self.plan, self.t
        kernels = self._kernels is not None
        # log-probabilities stay the model's: taken before the mask
        lsm = logits.float().log_softmax(-1) if p.logprobs is not None else None
        if p.masked:  # a grammar's disallowed tokens can never be chosen, greedy or drawn
            allowed = ((t["mask"][:, self._word] >> self._bit) & 1).bool()
            logits = logits.masked_fill(~allowed, float("-inf"))
        # the kernels read bf16 logits as they are; float32 only where something needs it
        raw = logits.float() if not kernels or p.window else None
        z = logits if kernels else raw
        if p.window:
            W, V = p.window, raw.shape[-1]
            win = t["window"]
            valid = (win >= 0) & (self._wpos[None, :] >= W - t["context"][:, None])
            seen = torch.zeros(raw.shape[0], V + 1, dtype=torch.bool, device=raw.device)
            seen = seen.scatter_(1, torch.where(valid, win, V), True)[:, :V]
            pen = t["penalty"][:, None]
            z = torch.where(seen, torch.where(raw > 0, raw / pen, raw * pen), raw)
        if kernels:  # greedy rows too, and it moves the counters on
            tok = self._kernels(z, t, ranked=p.candidates > 0)
        elif p.sampled:
            tok = torch.where(t["temperature"] > 0, self._draw(z), z.argmax(-1))
            t["counter"].add_(1)
        else:
            tok = z.argmax(-1)
        if p.window:
            win.copy_(torch.cat([win[:, 1:], tok[:, None]], dim=1))
        if p.logprobs is not None:
            top = lsm.topk(p.logprobs, dim=-1) if p.logprobs else (None, None)
            self._last = (lsm.gather(1, tok[:, None])[:, 0], *top)
        return tok

    def _draw(self, z):
        """A token from each row's kept set: the inverse CDF at the row's uniform."""
        t = self.t
        temp = t["temperature"]
        z = z / torch.where(temp > 0, temp, 1.0)[:, None]
        zmax = z.max(-1, keepdim=True).values
        thr, ties = self._threshold(z, zmax)
        eq = z == thr
        kept = (z > thr) | (eq & (eq.cumsum(-1) <= ties))
        w = torch.where(kept, torch.exp(z - zmax), 0.0).to(self._cdf)
        cum = w.cumsum(-1)
        total = cum[:, -1:]
        target = uniform(t["seed"], t["counter"]).to(self._cdf)[:, None] * total
        # float32 (MPS) may round u * total up to total: stay inside the last kept token
        target = torch.minimum(target, total * (1 - 2**-23))
        return torch.searchsorted(cum, target, right=True)[:, 0].clamp_(max=z.shape[-1] - 1)

    def _threshold(self, z, zmax):
        """(B, 1) logit threshold and (B, 1) count of the tokens tied at it that are kept."""
        p, t = self.plan, self.t
        log_min_p = torch.log(t["min_p"])[:, None]  # -inf for min_p 0: keeps everything
        thr = zmax + log_min_p
        big = torch.full_like(t["top_k"][:, None], z.shape[-1])
        if not p.candidates:
            return thr, big
        C = p.candidates
        if C >= z.shape[-1]:
            vals = torch.sort(z, dim=-1, descending=True).values
        else:
            vals = torch.topk(z, C, dim=-1).values  # sorted
        k = t["top_k"][:, None]
        rank = self._rank[None, :C]
        in_k = (k == 0) | (rank < k)
        e = torch.exp(vals - zmax)
        # top-p sees probabilities renormalised over the top-k set, or over the whole row
        whole = torch.exp(z - zmax).sum(-1, keepdim=True)
        norm = torch.where(k > 0, (e * in_k).sum(-1, keepdim=True), whole)
        prob = e / norm
        keep = (
            in_k
            & (prob.cumsum(-1) - prob < t["top_p"][:, None])
            & (vals - vals[:, :1] >= log_min_p)
        ) | (rank == 0)
        n = keep.sum(-1, keepdim=True)  # the kept set is a prefix of the sorted row
        cand_thr = vals.gather(1, n - 1)
        cand_ties = n - (vals > cand_thr).sum(-1, keepdim=True)
        ranked = (k > 0) | (t["top_p"][:, None] < 1)  # rows whose set depends on the order
        return torch.where(ranked, cand_thr, thr), torch.where(ranked, cand_ties, big)
