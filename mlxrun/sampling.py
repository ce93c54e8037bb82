"""Sampling options and samplers.

Greedy decoding stays on the device (argmax, no host round trip). Everything else samples on
the host in numpy from the last position's logits: one implementation for every backend,
and the same seed gives the same tokens on MLX and PyTorch.
"""

from __future__ import annotations

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
        ]
        for ok, msg in checks:
            if not ok:
                raise MlxrunError(msg)

    @property
    def on_device(self) -> bool:
        """Plain greedy: argmax on the device, no logits copied to the host."""
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

    def _sample_row(self, row: np.ndarray) -> int:
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
        return int(order[self.rng.choice(len(order), p=probs)])
