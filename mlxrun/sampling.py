"""Sampling options, the host reference sampler, and what a device sampler computes.

Greedy decoding is an argmax on the device. Every other setting samples on the device too
(`backend.sampler`, inside the captured CUDA step where there is one): the per-row options
and random state live in device buffers, and only the chosen token ids (and, when asked,
their log-probabilities) come back to the host. `HostSampler` is the numpy reference the
device samplers are tested against: same options, same distribution.

The device algorithm, per row (all rows of a batch at once, each with its own options):
1. repetition penalty on the logits of the tokens in the row's recent window;
2. temperature; greedy rows (temperature 0) take the argmax here;
3. the kept set, exactly as the reference defines it (a prefix of the tokens sorted by
   logit, lower id first among equal logits): top-k, then top-p on the top-k-renormalised
   probabilities, then min-p. The set is a logit threshold t plus how many of the tokens
   tied at t it keeps, found from the top candidates only: top-k needs the k best, min-p
   none (t follows from the maximum), top-p alone the sorted row;
4. one uniform from a counter-based hash of (row seed, row step) picks the token by the
   inverse CDF of the kept probabilities in token-id order: no sort of the draw, and a
   seeded row gives the same tokens whatever its batch-mates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .errors import MlxrunError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"--temp must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"--top-k must be >= 0 (0 turns it off), got {self.top_k}"),
            (0 <= self.min_p < 1, f"--min-p must be in [0, 1), got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"--repetition-penalty must be > 0 (1 turns it off), got {self.repetition_penalty}",
            ),
            (
                self.repetition_context >= 1,
                f"repetition context must be at least 1 token, got {self.repetition_context}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise MlxrunError(msg)

    @property
    def greedy(self) -> bool:
        """Plain greedy: an argmax on the device and nothing else."""
        return self.temperature == 0 and self.repetition_penalty == 1.0


class HostSampler:
    """logits (B, V) float32 numpy + token history -> next tokens (B,) int64."""

    def __init__(self, p: SamplingParams):
        self.p = p
        self.rng = np.random.default_rng(p.seed)

    def __call__(self, logits: np.ndarray, history: list[list[int]]) -> np.ndarray:
        p = self.p
        logits = logits.astype(np.float64)  # copy; exp of large logits stays finite
        if p.repetition_penalty != 1.0:
            for b, hist in enumerate(history):
                seen = np.unique(np.asarray(hist[-p.repetition_context :], dtype=np.int64))
                if seen.size:
                    v = logits[b, seen]
                    logits[b, seen] = np.where(
                        v > 0, v / p.repetition_penalty, v * p.repetition_penalty
                    )
        if p.temperature == 0:
            return logits.argmax(-1)
        logits = logits / p.temperature
        out = np.empty(logits.shape[0], dtype=np.int64)
        for b, row in enumerate(logits):
            out[b] = self._sample_row(row)
        return out

    def kept(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) of the tokens a tempered, penalised row may draw."""
        p = self.p
        order = np.argsort(-row, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        probs = np.exp(row[order] - row[order[0]])
        probs /= probs.sum()
        keep = np.ones(len(order), dtype=bool)
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (the top token always stays)
            cum = np.cumsum(probs)
            keep &= np.concatenate([[True], cum[:-1] < p.top_p])
        if p.min_p > 0:
            keep &= probs >= p.min_p * probs[0]
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
        return order, probs

    def _sample_row(self, row: np.ndarray) -> int:
        order, probs = self.kept(row)
        return int(order[self.rng.choice(len(order), p=probs)])


# -- what the device samplers compute ------------------------------------------------------


@dataclass(frozen=True)
class SamplerPlan:
    """The shape of a device sampling step; a captured CUDA graph is specific to one.

    candidates: how many of each row's best logits are found (sorted) to place the kept
    set's threshold: 0 (none needed: greedy, temperature alone, min-p), k (top-k rows), or
    the vocabulary (a top-p row without top-k). window: the repetition-penalty window, 0
    when no row has a penalty. logprobs: None, or how many top log-probabilities to return
    beside the chosen token's (0 for the chosen token's alone).
    """

    batch: int
    vocab: int
    candidates: int
    window: int
    logprobs: int | None = None
    sampled: bool = True  # False: every row greedy (the penalty may still apply)
    # True: state["mask"] (B, ceil(V/32)) int32 bitmasks restrict each row's tokens
    # (`mlxrun.structured`); False: no mask op is traced or captured at all
    masked: bool = False


def plan_for(
    params: list[SamplingParams], vocab: int, logprobs: int | None = None, masked: bool = False
) -> SamplerPlan:
    """The smallest plan that serves every row of `params` (one per sequence); `masked`
    when some row's tokens are constrained by a grammar."""
    sampled = [p for p in params if p.temperature > 0]
    cands = 0
    if any(p.top_p < 1 and not p.top_k for p in sampled):
        cands = vocab
    elif any(p.top_k for p in sampled):
        cands = min(vocab, max(p.top_k for p in sampled))
    pen = [p.repetition_context for p in params if p.repetition_penalty != 1.0]
    return SamplerPlan(
        len(params), vocab, cands, max(pen, default=0), logprobs, bool(sampled), masked
    )


def mask_words(vocab: int) -> int:
    """32-bit words of a token bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


def allowed_np(mask: np.ndarray, vocab: int) -> np.ndarray:
    """(B, words) int32 bitmasks -> (B, vocab) bool: bit i % 32 of word i // 32 (the
    tests' oracle for the device samplers' unpacking)."""
    ids = np.arange(vocab)
    return ((mask.view(np.uint32)[:, ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


def row_seed(p: SamplingParams) -> int:
    """The 32-bit seed a device sampler uses for `p`: its own, or a fresh random one."""
    return int.from_bytes(os.urandom(4), "little") if p.seed is None else p.seed & 0xFFFFFFFF


def pack(
    params: list[SamplingParams],
    histories: list[list[int]],
    plan: SamplerPlan,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    mask: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Per-row options and state as the device samplers hold them (numpy, one row each).

    A row without a seed gets a fresh random one, unless `seeds` gives each row's (a server
    keeps one per request across steps); `steps` is how many tokens each row has drawn
    already (0 for all by default). `window` holds the last `plan.window` tokens of each
    history, right-aligned, -1 where there are fewer. A masked plan carries `mask`, the
    rows' token bitmasks (all tokens allowed where not given).
    """
    B, W = plan.batch, plan.window
    win = np.full((B, W), -1, dtype=np.int64)
    for b, h in enumerate(histories):
        tail = h[-W:] if W else []
        if tail:
            win[b, W - len(tail) :] = tail
    f32 = np.float32
    extra = {}
    if plan.masked:
        extra["mask"] = np.full((B, mask_words(plan.vocab)), -1, np.int32) if mask is None else mask
    return {
        **extra,
        "temperature": np.array([p.temperature for p in params], f32),
        "top_k": np.array([p.top_k for p in params], np.int64),
        "top_p": np.array([p.top_p for p in params], f32),
        "min_p": np.array([p.min_p for p in params], f32),
        "penalty": np.array([p.repetition_penalty for p in params], f32),
        "context": np.array([min(p.repetition_context, W) for p in params], np.int64),
        "seed": np.array(seeds if seeds is not None else [row_seed(p) for p in params], np.int64),
        "counter": np.array(steps if steps is not None else [0] * B, np.int64),
        "window": win,
        # rows whose kept set depends on the order of the logits (top-k, top-p)
        "ranked": np.array(
            [p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params], np.int32
        ),
    }


def uniform_np(seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """The device samplers' uniform in [0, 1) for (seed, step), in numpy (the tests' oracle).

    A 32-bit integer hash (Wellons' lowbias32) of the seed mixed with the step: counter
    based, so a captured step needs no generator state beyond the row's counter.
    """
    m = np.uint64(0xFFFFFFFF)
    x = (seed.astype(np.uint64) ^ (counter.astype(np.uint64) * np.uint64(0x9E3779B9))) & m
    x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x7FEB352D)) & m
    x = ((x ^ (x >> np.uint64(15))) * np.uint64(0x846CA68B)) & m
    x = x ^ (x >> np.uint64(16))
    return (x >> np.uint64(8)).astype(np.float64) / 2**24
