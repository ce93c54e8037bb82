"""Speculative decoding: a draft proposes up to k tokens, the target checks them all in one
forward pass over k+1 positions, and the cache rolls back the positions it rejected.

Batch-1 decode reads every weight once per token, so the target's pass over k+1 tokens
costs about what one token costs, and each accepted draft is a token for free. Two draft
sources: `NgramDraft` (prompt lookup: the continuation of the latest earlier occurrence of
the sequence's last n tokens, no model at all) and `ModelDraft` (a small model with the
target's vocabulary, decoding ahead on its own cache).

Greedy output equals the target's own greedy decode token for token: a draft is kept only
where it is the target's argmax at that position. Sampled output has the target's
distribution by the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023):
draft d drawn from q is kept with probability min(1, p(d)/q(d)); at the first rejection a
token is drawn from the residual max(0, p - q), renormalised; when all are kept, one more
from p at the position after them. A deterministic draft (ngram) is a one-hot q. p and q
are the sampler's kept-set probabilities (temperature, top-k, top-p, min-p) computed on the
host from the target's logits; greedy needs only the argmaxes, taken on the device.

The target's verify pass and the draft model's steps go through `Passes`: on CUDA the
backend's fixed-shape passes, one captured graph per pass size (backends/spec_graph.py:
the verify's k+1, the draft's 1 and 2); elsewhere eager forward passes. Either way the
host logic below is the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import MlxrunError
from .memory import prefill_chunk_for
from .model import Transformer
from .sampling import HostSampler, SamplingParams

# Drafted tokens per verify pass unless asked: a model draft pays a forward pass of its own
# per drafted token, so fewer; a lookup draft is free to propose, only the verify grows.
DEFAULT_K = {"model": 4, "ngram": 8}


@dataclass
class DraftStats:
    """Counters of one generation: verify passes, tokens drafted and tokens kept."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """Fraction of drafted tokens the target kept (0 when none were drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


class Passes:
    """Forward passes over a few consecutive tokens of one sequence, on a cache of its own:
    the backend's fixed-shape ones where it has them (captured on CUDA), else eager.

    `passes(tokens, offset)` runs tokens (a list of ints, or a device array (n,) such as a
    previous pass's argmax) at positions offset .. offset + n - 1, n at most max(sizes),
    -> (logits (n, V), argmax (n,), finite (n,)) on the device: the logits valid until the
    next pass, the others the caller's. Positions past them hold stale keys, never read:
    a rollback is the next pass's offset."""

    def __init__(self, model: Transformer, max_len: int, sizes: tuple[int, ...]):
        self.model, self.sizes = model, tuple(sizes)
        self.fixed = model.be.spec_passes(model, max_len, self.sizes)
        self.cache = model.make_cache(1, max_len) if self.fixed is None else self.fixed.cache

    @property
    def captured(self) -> bool:
        """Whether the passes replay CUDA graphs."""
        return self.fixed is not None and self.fixed.capture

    def __call__(self, tokens, offset: int):
        if self.fixed is not None:
            return self.fixed(tokens, offset)
        be = self.model.be
        self.cache.offset = offset
        if isinstance(tokens, list):
            ids = be.ids(np.asarray(tokens, dtype=np.int64)[None])
        else:
            ids = tokens.reshape(1, -1)
        rows = self.model(ids, self.cache, None)[0]  # (n, V)
        return rows, be.argmax(rows), be.finite_rows(rows)

    def prefill(self, tokens: list[int], offset: int = 0, chunk: int | None = None):
        """Run a prompt (any length, in prefill chunks; eager) -> its last row's (logits
        (1, V), argmax (1,), finite (1,))."""
        self.cache.offset = offset
        logits = feed(self.model, self.cache, tokens, chunk)
        be = self.model.be
        return logits, be.argmax(logits), be.finite_rows(logits)

    def close(self) -> None:
        if self.fixed is not None:
            self.fixed.close()


class NgramDraft:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n
    tokens (n from `max_n` down to `min_n`) and propose the tokens that followed it."""

    kind = "ngram"

    def __init__(self, k: int | None = None, max_n: int = 3, min_n: int = 1):
        self.k = DEFAULT_K["ngram"] if k is None else k
        if self.k < 1:
            raise MlxrunError(f"--num-draft must be at least 1, got {self.k}")
        self.max_n, self.min_n = max_n, min_n
        self.stats = DraftStats()

    def start(self, model: Transformer, prompt_len: int, max_tokens: int) -> None:
        self.stats = DraftStats()

    def propose(
        self, seq: list[int], k: int, probs=None, rng=None
    ) -> tuple[list[int], np.ndarray | None]:
        """(up to k tokens, None): a lookup draft is one-hot, it has no q."""
        return lookup(np.asarray(seq, dtype=np.int64), k, self.max_n, self.min_n), None

    def keep(self, n: int) -> None:
        """The sequence's first n tokens are final (nothing cached here)."""

    def close(self) -> None:
        """The generation is over."""


def lookup(seq: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """The k tokens (or fewer) that followed the latest earlier occurrence of seq's last n
    tokens, for the longest n in [min_n, max_n] that occurs; [] when none does."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = seq[L - n :]
        # windows starting at 0 .. L-n-1: every occurrence with at least one token after it
        win = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)
        hits = np.flatnonzero((win == tail).all(axis=1))
        if hits.size:
            j = int(hits[-1]) + n
            return seq[j : j + k].tolist()
    return []


class ModelDraft:
    """A small model that decodes ahead of the target, on a cache of its own."""

    kind = "model"

    def __init__(self, model: Transformer, k: int | None = None):
        self.model = model
        self.k = DEFAULT_K["model"] if k is None else k
        if self.k < 1:
            raise MlxrunError(f"--num-draft must be at least 1, got {self.k}")
        self.stats = DraftStats()
        self.passes: Passes | None = None
        self.cached = 0  # tokens of the sequence in the draft's cache

    def start(self, model: Transformer, prompt_len: int, max_tokens: int) -> None:
        d, t = self.model.config, model.config
        if d.vocab_size != t.vocab_size:
            raise MlxrunError(
                f"the draft model's vocabulary ({d.vocab_size} tokens) differs from the "
                f"target's ({t.vocab_size}); draft with a model of the same tokenizer"
            )
        if prompt_len + max_tokens > d.max_position_embeddings:
            raise MlxrunError(
                f"prompt ({prompt_len} tokens) + --max-tokens ({max_tokens}) exceeds the "
                f"draft model's context of {d.max_position_embeddings} tokens; shorten one"
            )
        # One position more than the target's cache: a cache of the very same shape could be
        # the one a PyTorch backend keeps for reuse, and then the target's too (self-drafting).
        # Passes of 1 token (a draft step) and 2 (the catch-up after a pass that kept every
        # draft: the last draft and the target's token).
        self.close()
        self.passes = Passes(self.model, prompt_len + max_tokens + 1, (1, 2))
        self.cached = 0
        self.stats = DraftStats()

    def propose(
        self, seq: list[int], k: int, probs=None, rng=None
    ) -> tuple[list[int], np.ndarray | None]:
        """Up to k tokens after `seq`, and their draft probabilities q (k, V) when `probs`
        (logits row -> probabilities) is given; greedy (argmax, q None) otherwise."""
        be, run = self.model.be, self.passes
        new = seq[self.cached :]  # the prompt, then 1 token, 2 after a pass that kept all
        if len(new) > max(run.sizes):
            rows, best, _ = run.prefill(new, self.cached)
        else:
            rows, best, _ = run(new, self.cached)
        self.cached = len(seq)
        toks, qs = [], []
        for j in range(k):
            if probs is None:  # the argmax stays on the device: steps queue without a sync
                t = best[-1:]
            else:
                q = probs(be.to_numpy(rows[-1]).reshape(-1))
                t = [draw(q, rng)]
                qs.append(q)
            toks.append(t)
            if j + 1 < k:  # the last draft need not be fed: the next round starts there
                rows, best, _ = run(t, self.cached)
                self.cached += 1
        if probs is None:
            toks = [be.to_numpy(t).reshape(-1) for t in toks]
        return [int(t[0]) for t in toks], (np.stack(qs) if qs else None)

    def keep(self, n: int) -> None:
        """The sequence's first n tokens are final: drop cached positions past them (the
        next pass starts there and overwrites them)."""
        self.cached = min(self.cached, n)

    def close(self) -> None:
        """The generation is over: the draft's passes may serve the next one."""
        if self.passes is not None:
            self.passes.close()


def feed(model: Transformer, cache, toks: list[int], chunk: int | None = None):
    """Run `toks` through the model on `cache` (in prefill chunks) -> last logits (1, V)."""
    be = model.be
    ids = np.asarray(toks, dtype=np.int64)[None]
    chunk = chunk or prefill_chunk_for(be.name, be.memory_kind, 1)
    for s in range(0, ids.shape[1], chunk):
        logits = model(be.ids(ids[:, s : s + chunk]), cache, None, last_only=True)
        if s + chunk < ids.shape[1]:
            be.eval(logits)  # bound MLX's lazy graph to one chunk
    return logits


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from probabilities (V,) by the inverse CDF at a uniform."""
    cum = np.cumsum(probs)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), len(cum) - 1))


def accept(
    drafted: list[int], q: np.ndarray | None, p: np.ndarray, rng: np.random.Generator
) -> list[int]:
    """The speculative-sampling rule. drafted (n,) drawn from q (n, V), or from a one-hot
    q when None; p (n+1, V) the target's probabilities at the n drafted positions and the
    one after -> the tokens to emit: the kept drafts, then one token of the target's."""
    for i, d in enumerate(drafted):
        qd = 1.0 if q is None else float(q[i, d])
        if rng.random() * qd < p[i, d]:  # u < p(d)/q(d), without dividing by q(d) = 0
            continue
        if q is None:
            resid = p[i].copy()
            resid[d] = 0.0
        else:
            resid = np.maximum(p[i] - q[i], 0.0)
        if resid.sum() <= 0:  # rejected only by rounding (p == q): p itself is the residual
            resid = p[i]
        return list(drafted[:i]) + [draw(resid, rng)]
    return list(drafted) + [draw(p[len(drafted)], rng)]


def target_probs(params: SamplingParams):
    """logits row (V,) -> the probabilities (V,) float64 that `params` samples from: the
    host sampler's kept set (top-k, top-p, min-p) of the tempered logits."""
    host = HostSampler(params)
    filtered = params.top_k > 0 or params.top_p < 1 or params.min_p > 0

    def probs(row: np.ndarray) -> np.ndarray:
        z = row.astype(np.float64) / params.temperature
        if not filtered:
            e = np.exp(z - z.max())
            return e / e.sum()
        order, kept = host.kept(z)
        out = np.zeros(z.shape[0])
        out[order] = kept
        return out

    return probs


def check_options(params: SamplingParams, logprobs: int | None, batch: int) -> None:
    if batch != 1:
        raise MlxrunError(
            f"speculative decoding runs one prompt at a time, got {batch}; "
            "drop --draft-model / --draft for batches"
        )
    if logprobs is not None:
        raise MlxrunError("log-probabilities are not reported with a draft; drop one of them")
    if params.repetition_penalty != 1.0:
        raise MlxrunError(
            "--repetition-penalty is not supported with a draft (the penalty would change "
            "inside the drafted span); drop one of them"
        )


def generate_step(
    model: Transformer,
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int,
    draft: NgramDraft | ModelDraft,
    prefill_chunk: int | None = None,
) -> Iterator[np.ndarray]:
    """Yield the next token (1,) int64, `max_tokens` times at most, as
    `mlxrun.generate.generate_step` does for one prompt, drafting with `draft`; its
    `stats` count the verify passes, drafted and accepted tokens."""
    from .generate import _not_finite  # noqa: PLC0415

    check_options(params, None, 1)
    if not prompt:
        raise MlxrunError("a prompt encodes to no tokens; give some text")
    be = model.be
    L = len(prompt)
    if L + max_tokens > model.config.max_position_embeddings:
        raise MlxrunError(
            f"prompt ({L} tokens) + --max-tokens ({max_tokens}) exceeds the "
            f"model's context of {model.config.max_position_embeddings} tokens; shorten one of them"
        )
    draft.start(model, L, max_tokens)
    extra = draft.model.weight_bytes() if isinstance(draft, ModelDraft) else 0
    sampled = not params.greedy
    probs = target_probs(params) if sampled else None
    rng = np.random.default_rng(params.seed)
    stats = draft.stats
    target = None
    try:
        with be.wired(model.weight_bytes() + extra + model.kv_bytes(1, L + max_tokens)):
            # verify passes of k+1 tokens (fewer near the end: padded to k+1 where captured)
            target = Passes(model, L + max_tokens, (draft.k + 1,))
            chunk = prefill_chunk or prefill_chunk_for(be.name, be.memory_kind, 1)
            # rows (T, V), best (T,), ok (T,): the target's logits, argmaxes and finite flags
            # at the positions of the last pass, the prefill's last (no drafts) or a
            # verify's: seq[-1] and each draft
            rows, best, ok = target.prefill(prompt, 0, chunk)
            seq = list(prompt)
            drafts, q = [], None
            n_out = 0
            while True:
                if sampled:
                    host = be.to_numpy(rows).reshape(-1, rows.shape[-1])
                    ok = np.isfinite(host).all(-1)
                else:
                    ok = be.to_numpy(ok).reshape(-1).astype(bool)
                if not ok.all():
                    raise _not_finite(n_out + int(np.flatnonzero(~ok)[0]), np.array([False]))
                if sampled:
                    new = accept(drafts, q, np.stack([probs(r) for r in host]), rng)
                else:  # the drafts that are the target's argmax, then the target's next
                    best = be.to_numpy(best).reshape(-1).astype(np.int64).tolist()
                    n = 0
                    while n < len(drafts) and drafts[n] == best[n]:
                        n += 1
                    new = drafts[:n] + [best[n]]
                stats.accepted += len(new) - 1
                for t in new:
                    n_out += 1
                    yield np.array([t], dtype=np.int64)
                    if n_out == max_tokens:
                        return
                seq.extend(new)
                draft.keep(len(seq) - 1)
                # the verify must not pass the context the caller asked for: at most the
                # tokens still to come, less the one the target adds
                k = min(draft.k, max_tokens - n_out - 1)
                drafts, q = draft.propose(seq, k, probs, rng) if k > 0 else ([], None)
                stats.passes += 1
                stats.drafted += len(drafts)
                # from the last token on: the rejected drafts' positions are overwritten
                rows, best, ok = target([seq[-1], *drafts], len(seq) - 1)
    finally:
        if target is not None:
            target.close()
        draft.close()
