"""A request in a slot (`_Seq`) and how its tokens become its request's events (`Emits`,
which Engine extends): text through the detokenizer, stop strings held back until they
can no longer match, the grammar's verdict, finish reasons, and the NaN check's error.

Separate from engine.py, which decides what runs (admission, the prefix cache, prefill
chunks, retiring): this is what a request sees of each token, as `generate.stream` does it
for one sequence. The methods read the Engine's `stats`, `tokenizer`, `cache` and
`recent`, and call its `_retire`."""

from __future__ import annotations

import logging
import sys

from .engine_io import Event, Request, TokenLogprob
from .generate import _stop_hold
from .phases import Phases, now
from .sampling import row_seed
from .tokenizer import Tokenizer

log = logging.getLogger("mlxrun.engine")


class _Seq:
    """A request in a slot: prefilling while done < len(prompt), then decoding."""

    def __init__(self, req: Request, slot: int, cached: int, tokenizer: Tokenizer, matcher=None):
        self.req, self.slot, self.cached = req, slot, cached
        self.matcher = matcher  # the request's grammar state (`mlxrun.structured`), or None
        self.done = cached  # prompt tokens whose k, v are in the slot
        self.history = list(req.prompt)  # for the repetition penalty
        self.seed = row_seed(req.params)  # one per request: its draws ignore batch-mates
        self.detok = tokenizer.detokenizer(req.markup)
        self.stops = [s for s in req.stop if s]
        self.n = 0  # tokens generated
        self.sent = 0  # characters of detok.text already handed out
        self.last = -1  # the token the next decode step feeds


def not_finite(n: int) -> str:
    return (
        f"the model's logits are NaN or infinite at generated token {n + 1}: this request "
        "stops rather than emitting garbage (the others go on); the weights or activations "
        "overflow, so try --dtype float32 or another checkpoint"
    )


class Emits:
    """The Engine's per-token output (a mixin, as engine_steps.FixedSteps is)."""

    def _emit(self, s: _Seq, token: int, lp: TokenLogprob | None, finite: bool = True) -> None:
        """Hand one token to its request (as `generate.stream` turns tokens into text); a
        row whose logits were not finite ends its request with an error instead."""
        if not finite:
            self.stats["failed"] += 1
            msg = not_finite(s.n)
            self._send(s, Event("", None, None, "error", len(s.req.prompt), s.n, s.cached, msg))
            self._retire(s, keep=False)
            self.cache.clear(s.slot)  # its keys and values may hold NaN
            return
        s.n += 1
        if s.n == 1:
            s.req.phases.first_token = now()
        s.last = token
        s.history.append(token)
        self.stats["generated_tokens"] += 1
        finish = None
        m = s.matcher
        if m is not None and not m.done and not m.advance(token):
            self._send(s, Event("", token, lp, "error", len(s.req.prompt), s.n, s.cached,
                                f"the grammar rejected a token: {m.error}"))  # fmt: skip
            self._retire(s, keep=False)
            return
        if token in self.tokenizer.eos_token_ids:
            finish = "stop"
            s.detok.flush()
        else:
            s.detok.add(token)
            if m is not None and m.done:  # the structure is complete: only the end may follow
                finish = "stop"
                s.detok.flush()
            elif s.n == s.req.max_tokens:
                finish = "length"
                s.detok.flush()
        text = s.detok.text
        hits = [i for stop in s.stops if (i := text.find(stop, s.sent)) >= 0]
        if hits:
            text, finish = text[: min(hits)], "stop"
        end = len(text) if finish else len(text) - _stop_hold(text, s.stops)
        piece, s.sent = text[s.sent : end], max(s.sent, end)
        if s.n == 1:
            s.req.phases.first_event = now()
        self._send(s, Event(piece, token, lp, finish, len(s.req.prompt), s.n, s.cached))
        if s.n == 1:
            self._first(s.req.phases)
        if finish:
            self.stats["finished"] += 1
            self._retire(s)

    def _first(self, ph: Phases) -> None:
        """A request's first token is out: keep its phases (`recent`, /health)."""
        self.recent.append(ph)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("first token: %s", ph.breakdown())

    def _send(self, s: _Seq, ev: Event) -> None:
        if s.req.on_event is not None and not s.req.cancelled:
            try:
                s.req.on_event(ev)
            except Exception as e:  # a broken consumer loses its request, not the engine
                print(f"mlxrun: dropping request {s.req.id}: {e}", file=sys.stderr)
                s.req.cancel()
