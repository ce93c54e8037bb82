"""Device sampling for the MLX backend: `mlxrun.sampling`'s algorithm in mlx ops, lazy
like the forward pass, so a step's token is drawn without a host round trip."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxrun.sampling import SamplerPlan


def _u32(c: int):
    return mx.array(c, dtype=mx.uint32)


def uniform(seed, counter):
    """(B,) uint32 seeds and steps -> (B,) float32 in [0, 1): `sampling.uniform_np`."""
    x = seed ^ (counter * _u32(0x9E3779B9))  # uint32 arithmetic wraps, as the hash wants
    x = (x ^ (x >> 16)) * _u32(0x7FEB352D)
    x = (x ^ (x >> 15)) * _u32(0x846CA68B)
    x = x ^ (x >> 16)
    return (x >> 8).astype(mx.float32) / 2**24  # 24 bits: exact in float32


class MLXSampler:
    """logits (B, V) -> next tokens (B,) uint32; state arrays are replaced each step."""

    def __init__(self, plan: SamplerPlan, state: dict[str, np.ndarray]):
        self.plan = plan
        self.load(state)
        # float64 keeps the inverse CDF exact far below one token's share; MLX has it on
        # the CPU only
        self._cdf = mx.float64 if mx.default_device() == mx.cpu else mx.float32
        self._last = None

    def load(self, state: dict[str, np.ndarray]) -> None:
        t = {k: mx.array(v) for k, v in state.items()}
        t["seed"] = t["seed"].astype(mx.uint32)
        t["counter"] = t["counter"].astype(mx.uint32)
        t["window"] = t["window"].astype(mx.int32)
        t["context"] = t["context"].astype(mx.int32)
        t["top_k"] = t["top_k"].astype(mx.int32)
        if "mask" in t:
            t["mask"] = t["mask"].view(mx.uint32)
        self.t = t

    def mask_buffer(self) -> np.ndarray:
        """A host (B, words) int32 array for the next `set_mask` (which copies it)."""
        return np.empty(self.t["mask"].shape, np.int32)

    def set_mask(self, mask: np.ndarray) -> None:
        """The rows' token bitmasks ((B, words) int32) for the next call."""
        self.t["mask"] = mx.array(mask).view(mx.uint32)

    def logprobs(self):
        return self._last

    def __call__(self, logits):
        p, t = self.plan, self.t
        raw = logits.astype(mx.float32)  # log-probabilities stay the model's, unmasked
        z = raw
        B, V = raw.shape
        if p.masked:  # token i's bit: word i >> 5, bit i & 31
            ids = mx.arange(V, dtype=mx.uint32)
            bits = mx.take(t["mask"], ids >> 5, axis=1) >> (ids & 31)
            z = mx.where((bits & 1).astype(mx.bool_), z, -mx.inf)
        if p.window:
            W = p.window
            win = t["window"]
            valid = (win >= 0) & (mx.arange(W)[None, :] >= W - t["context"][:, None])
            seen = mx.zeros((B, V + 1), dtype=mx.bool_)
            seen = mx.put_along_axis(seen, mx.where(valid, win, V), mx.array(True), axis=1)
            seen = seen[:, :V]
            pen = t["penalty"][:, None]
            z = mx.where(seen, mx.where(z > 0, z / pen, z * pen), z)  # -inf stays -inf
        tok = mx.argmax(z, axis=-1).astype(mx.int32)
        if p.sampled:
            tok = mx.where(t["temperature"] > 0, self._draw(z), tok)
            t["counter"] = t["counter"] + _u32(1)
        if p.window:
            t["window"] = mx.concatenate([t["window"][:, 1:], tok[:, None]], axis=1)
        if p.logprobs is not None:
            lsm = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
            chosen = mx.take_along_axis(lsm, tok[:, None], axis=-1)[:, 0]
            top = (None, None)
            if p.logprobs:
                ids = mx.argsort(-lsm, axis=-1)[:, : p.logprobs]
                top = (mx.take_along_axis(lsm, ids, axis=-1), ids)
            self._last = (chosen, *top)
        return tok

    def _draw(self, z):
        t = self.t
        temp = t["temperature"]
        z = z / mx.where(temp > 0, temp, 1.0)[:, None]
        zmax = mx.max(z, axis=-1, keepdims=True)
        thr, ties = self._threshold(z, zmax)
        eq = z == thr
        kept = (z > thr) | (eq & (mx.cumsum(eq.astype(mx.int32), axis=-1) <= ties))
        w = mx.where(kept, mx.exp(z - zmax), 0.0).astype(self._cdf)
        cum = mx.cumsum(w, axis=-1)
        total = cum[:, -1:]
        target = uniform(t["seed"], t["counter"]).astype(self._cdf)[:, None] * total
        target = mx.minimum(target, total * (1 - 2**-23))  # float32 rounding: stay inside
        # first index whose cumulative weight passes the target (no searchsorted in mlx)
        idx = mx.sum(cum <= target, axis=-1)
        return mx.minimum(idx, z.shape[-1] - 1).astype(mx.int32)

    def _threshold(self, z, zmax):
        p, t = self.plan, self.t
        log_min_p = mx.log(t["min_p"])[:, None]
        thr = zmax + log_min_p
        big = mx.full((z.shape[0], 1), z.shape[-1], dtype=mx.int32)
        if not p.candidates:
            return thr, big
        C = min(p.candidates, z.shape[-1])
        vals = mx.topk(z, C, axis=-1) if C < z.shape[-1] else z
        vals = -mx.sort(-vals, axis=-1)  # descending
        k = t["top_k"][:, None]
        rank = mx.arange(C)[None, :]
        in_k = (k == 0) | (rank < k)
        e = mx.exp(vals - zmax)
        whole = mx.sum(mx.exp(z - zmax), axis=-1, keepdims=True)
        norm = mx.where(k > 0, mx.sum(e * in_k, axis=-1, keepdims=True), whole)
        prob = e / norm
        keep = (
            in_k
            & (mx.cumsum(prob, axis=-1) - prob < t["top_p"][:, None])
            & (vals - vals[:, :1] >= log_min_p)
        ) | (rank == 0)
        n = mx.sum(keep, axis=-1, keepdims=True).astype(mx.int32)
        cand_thr = mx.take_along_axis(vals, n - 1, axis=-1)
        cand_ties = n - mx.sum(vals > cand_thr, axis=-1, keepdims=True).astype(mx.int32)
        ranked = (k > 0) | (t["top_p"][:, None] < 1)
        return mx.where(ranked, cand_thr, thr), mx.where(ranked, cand_ties, big)
