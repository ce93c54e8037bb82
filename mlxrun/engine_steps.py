"""The engine's step execution beyond the eager path: the one sampling call of a step
(`sample_rows`, on every path) and the fixed-shape steps through the backend's slot decoder
(FixedSteps, which Engine extends): launch a step before the previous one's tokens are
read, sample it under grammar masks, land its tokens.

Separate from engine.py, which decides what runs (admission, the prefix cache, prefill
chunks, retiring), and engine_seq.py, which turns tokens into a request's events: this is
how a decided step runs on the device and comes back. The methods read the Engine's `be`,
`graphs`, `cache`, `held`, `seqs` and `_flight`, and hand tokens to its `_emit`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .engine_io import TokenLogprob
from .phases import now
from .sampling import mask_words, pack, plan_for
from .structured import fill_masks

if TYPE_CHECKING:
    from .engine_seq import _Seq

# Launch a fixed-shape decode step before reading the previous one's tokens (CUDA);
# MLXRUN_SERVE_OVERLAP=0 reads each step's tokens first (for A/B timing).
OVERLAP = os.environ.get("MLXRUN_SERVE_OVERLAP", "1") != "0"


@dataclass
class _Flight:
    """A launched fixed step: its batch, and once sampled its device outputs (tokens
    (bucket,), finite flags, logprobs); y is None while only its forward pass is queued."""

    key: tuple
    seqs: list[_Seq]
    step: object  # backends.slot_graph.SlotStep
    wants: list[int | None]
    n: int | None  # the most top logprobs a row asks for
    y: object = None
    ok: object = None
    lps: tuple | None = None


def sample_rows(be, logits, seqs: list[_Seq]) -> tuple[np.ndarray, list[TokenLogprob | None]]:
    """The one sampling call of a step: logits (B, V) of the running rows and their
    requests -> next tokens (B,) int64 and per-row logprobs (None where not asked).

    The device sampler (`mlxrun.sampling`) draws every row with its request's options, seed
    and step count, so a seed gives the same tokens whatever the batch-mates; only the
    tokens (and the log-probabilities asked for) come to the host.
    """
    rows = [s.req.params for s in seqs]
    wants = [s.req.logprobs for s in seqs]
    n = max((w for w in wants if w is not None), default=None)
    masked = any(s.matcher is not None for s in seqs)
    if n is None and all(p.greedy for p in rows) and not masked:
        return be.to_numpy(be.argmax(logits)).astype(np.int64).reshape(-1), [None] * len(seqs)
    V = int(logits.shape[-1])
    plan = plan_for(rows, V, n, masked)
    # the masks are computed here, after the forward pass was queued (CUDA, MLX)
    mask = fill_masks([s.matcher for s in seqs], mask_words(V)) if masked else None
    state = pack(
        rows, [s.history for s in seqs], plan, [s.seed for s in seqs], [s.n for s in seqs], mask
    )
    sampler = be.sampler(plan, state)
    toks = be.to_numpy(sampler(logits)).astype(np.int64).reshape(-1)
    if n is None:
        return toks, [None] * len(seqs)
    return toks, token_logprobs(be, toks, wants, sampler.logprobs())


def token_logprobs(be, toks: np.ndarray, wants: list[int | None], lps) -> list:
    """Per row, a TokenLogprob where `wants` asks for one (None elsewhere), from a device
    sampler's logprobs(): (chosen (B,), top values (B, n) or None, top ids (B, n) or None)."""
    lp, top, ids = (None if x is None else be.to_numpy(x) for x in lps)
    out: list[TokenLogprob | None] = [None] * len(wants)
    for b, k in enumerate(wants):
        if k is not None:
            best = [(int(ids[b, j]), float(top[b, j])) for j in range(k)]
            out[b] = TokenLogprob(int(toks[b]), float(lp[b]), best)
    return out


class FixedSteps:
    """The fixed-shape steps of an Engine (see the module's docstring)."""

    def _prefill_fixed(self, s: _Seq, chunk: list[int]) -> None:
        """The last chunk of a prompt (a tail after a cached prefix, or a short prompt) as
        one fixed-shape step of the backend's decoder (slot_graph.SlotDecoder.prefill)."""
        if self._flight is not None:  # its tokens first: the step reuses the device rows
            fl, self._flight = self._flight, None
            self._land(fl, chained=False)
        r = s.req
        tok, ok, lps = self.graphs.prefill(s.slot, chunk, r.params, s.history, s.seed, r.logprobs)
        r.phases.chunks.append((len(chunk), now(), True))
        self.held[s.slot].extend(chunk)
        self.cache.lengths[s.slot] += len(chunk)
        s.done += len(chunk)
        lp = None if lps is None else token_logprobs(self.be, np.array([tok]), [r.logprobs], lps)[0]
        self._emit(s, tok, lp, ok)

    def _decode_fixed(self, seqs: list[_Seq]) -> None:
        """One step through the backend's fixed-shape decoder. While the same sequences run,
        the step after is launched before this one's tokens are read (it feeds on them on
        the device), so the host's detokenizing and sending overlap the device's work. With
        grammar-constrained rows only that step's forward pass is launched early: its
        sample waits for the masks, which need this step's tokens (`_sample_masked`)."""
        fl = self._flight
        key = tuple(s.req.id for s in seqs)
        if fl is not None and fl.key == key and OVERLAP:
            self._flight = self._launch(seqs, key, fed=False)
            self._land(fl, chained=True)
            if self._flight.y is None:
                self._sample_masked(self._flight)
            return
        self._flight = None
        if fl is not None:
            self._land(fl, chained=False)
            seqs = [s for s in seqs if self.seqs[s.slot] is s]  # some may have finished
            key = tuple(s.req.id for s in seqs)
        if seqs:
            self._flight = self._launch(seqs, key, fed=True)
            if self._flight.y is None:  # the masks are filled while the forward pass runs
                self._sample_masked(self._flight)
            if not OVERLAP:
                self._land(self._flight, chained=False)
                self._flight = None

    def _launch(self, seqs: list[_Seq], key: tuple, fed: bool) -> _Flight:
        """Queue a step of `seqs` and its tokens' copies to the host (with constrained rows,
        its forward pass alone). fed: their last tokens are on the host (else they are the
        step in flight's, still on the device)."""
        wants = [s.req.logprobs for s in seqs]
        n = max((w for w in wants if w is not None), default=None)
        masked = any(s.matcher is not None for s in seqs)
        step = self.graphs.step_for(
            key,
            [s.slot for s in seqs],
            [s.last for s in seqs],
            [s.req.params for s in seqs],
            [s.history for s in seqs],
            [s.seed for s in seqs],
            [s.n for s in seqs],
            n,
            masked,
        )
        fl = _Flight(key, seqs, step, wants, n)
        if masked:
            step.forward()
        else:
            self._sampled(fl, step())
        for s in seqs:
            if fed:
                self.held[s.slot].append(s.last)
            self.cache.lengths[s.slot] += 1
        return fl

    def _sample_masked(self, fl: _Flight) -> None:
        """Queue the sample of a launched forward pass under its rows' grammar masks (all
        tokens for free, finished and dummy rows)."""
        smp = fl.step.sampler
        matchers = [s.matcher for s in fl.seqs] + [None] * (fl.step.batch - len(fl.seqs))
        smp.set_mask(fill_masks(matchers, mask_words(smp.plan.vocab), out=smp.mask_buffer()))
        self._sampled(fl, fl.step.sample())

    def _sampled(self, fl: _Flight, out: tuple) -> None:
        fl.y, fl.ok, fl.lps = out
        self.be.start(fl.y, fl.ok, *(x for x in fl.lps or () if x is not None))

    def _land(self, fl: _Flight, chained: bool) -> None:
        """Read a launched step's tokens and hand them out; chained: each was fed to the
        step launched after it (so its keys and values are being written)."""
        be = self.be
        seqs = fl.seqs
        B = len(seqs)
        toks = be.to_numpy(fl.y).astype(np.int64).reshape(-1)[:B]
        flags = be.to_numpy(fl.ok).reshape(-1)[:B]
        rows = [None] * B if fl.n is None else token_logprobs(be, toks, fl.wants, fl.lps)
        for s, t, lp, f in zip(seqs, toks.tolist(), rows, flags.tolist()):
            if self.seqs[s.slot] is not s:
                continue  # cancelled meanwhile
            if chained:
                self.held[s.slot].append(t)
            self._emit(s, t, lp, bool(f))
