"""The serving engine: one model, a slot KV cache, continuous batching and a prefix cache.

Everything that serves (`mlxrun serve`, `mlxrun chat`) submits `Request`s; one thread runs
the loop: admit waiting requests into free slots (reusing the longest prefix already held),
prefill one chunk of one admitted prompt, run one decode step for every running sequence,
hand each new token to its request's callback, and retire finished or cancelled sequences
at once. Rows have their own lengths, masks and rope positions (backends/slots.py), so a
sequence's tokens do not depend on its batch-mates. How a step is sampled, and the
fixed-shape steps that run ahead of the host, are in engine_steps.py; what a request sees
of each token (text, stop strings, finish reasons) is in engine_seq.py.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Iterator

import numpy as np

from .backends.base import QuantizedWeight
from .engine_io import Event, QueueFull, Request
from .engine_seq import Emits, _Seq
from .engine_steps import FixedSteps, _Flight, sample_rows
from .engine_steps import token_logprobs as token_logprobs
from .engine_tp import IDLE_BEAT_S, StepSync, fix_seed, from_wire, to_wire
from .errors import MlxrunError
from .memory import prefill_chunk_for
from .model import Transformer
from .phases import Phases, now
from .structured import grammars_for
from .tokenizer import Tokenizer

# Shorter held prefixes are not reused: a BOS alone is common to every prompt, and copying a
# few positions saves less than it costs.
MIN_PREFIX = 4
# How many requests' first-token phases the engine keeps (`Engine.recent`)
RECENT = 64


def _materialize(model: Transformer) -> None:
    """Compute every lazy weight now, on this thread: MLX runs a graph on the stream of the
    thread that built it, and the engine's thread has none of the loader's."""
    arrays = []
    for a in [model.embed, model.norm, model.head, model.rope] + [
        v for L in model.layers for v in vars(L).values()
    ]:
        if isinstance(a, QuantizedWeight):
            arrays += [x for x in (a.weight, a.scales, a.biases) if x is not None]
        elif a is not None:
            arrays.append(a)
    model.be.eval(*arrays)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if len(diff) else n


class Engine(FixedSteps, Emits):
    """Continuous batching over `max_batch` cache slots of `context` positions each.

    submit() queues a request (raising QueueFull at `max_queue` waiting, MlxrunError for a
    request that cannot run); the engine thread calls the request's `on_event` per token.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        max_batch: int = 4,
        context: int | None = None,
        max_queue: int = 64,
        prefill_chunk: int | None = None,
        prefix_cache: bool = True,
        fixed_steps: bool = True,
    ):
        c = model.config
        self.model, self.tokenizer, self.be = model, tokenizer, model.be
        self.max_batch = max_batch
        self.context = min(context or c.context_length, c.context_length)
        self.max_queue = max_queue
        # The same chunks as `generate` for one sequence, so a prompt is prefilled as it is there.
        self.prefill_chunk = prefill_chunk or prefill_chunk_for(
            self.be.name, self.be.memory_kind, 1
        )
        self.prefix_cache = prefix_cache
        windows = [c.window(i) for i in range(c.num_hidden_layers)]
        self.cache = self.be.make_slot_cache(
            c.num_hidden_layers, max_batch, c.num_key_value_heads, c.head_dim, self.context,
            windows, self.prefill_chunk, **({"kv_quant": model.kv_quant} if model.kv_quant else {}),
        )  # fmt: skip
        _materialize(model)
        # Fixed-shape decode steps over the slots (CUDA: a graph per batch-size bucket, the
        # greedy ones captured now); None (or fixed_steps False, for A/B timing and tests):
        # each step runs eagerly at its own batch size.
        self.graphs = self.be.slot_decoder(model, self.cache, max_batch) if fixed_steps else None
        if self.graphs is not None and self.graphs.capture:
            self.graphs.warm()
        self._flight: _Flight | None = None  # a launched fixed step whose tokens are unread
        self.seqs: list[_Seq | None] = [None] * max_batch
        self.held: list[list[int]] = [
            [] for _ in range(max_batch)
        ]  # tokens whose k, v a slot holds
        self.used = [0] * max_batch  # when each slot was last retired (least recently used first)
        self.waiting: deque[Request] = deque()
        # Split over ranks: rank 0 queues arrivals here until the next step's message, so
        # every rank's `waiting` changes at the same step (engine_tp)
        g = self.be.group
        self.sync = StepSync(g) if g is not None and g.size > 1 else None
        self.arrived: list[Request] = []
        self.recent: deque[Phases] = deque(maxlen=RECENT)  # the latest first tokens' phases
        self.stats = {
            "requests": 0,
            "finished": 0,
            "cancelled": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "prefix_hits": 0,
            "prefix_tokens_reused": 0,
            "failed": 0,  # stopped by NaN or infinite logits
            "steps": 0,
        }
        self._cond = threading.Condition()
        self._stopping = False
        self._tick = 0
        bind = self.be.thread_binder()
        self._thread = threading.Thread(
            target=lambda: (bind(), self._loop()), name="mlxrun-engine", daemon=True
        )
        self._thread.start()

    # --- the caller's side ------------------------------------------------------------

    def check(self, req: Request) -> None:
        """Raise MlxrunError if `req` can never run here (the server answers 400)."""
        if not req.prompt:
            raise MlxrunError("the prompt encodes to no tokens; give some text")
        if req.max_tokens < 1:
            raise MlxrunError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if req.constraint is not None:  # compiled once and cached: the engine's copy is free
            self.grammars().compile(req.constraint)
        if len(req.prompt) + req.max_tokens > self.context:
            raise MlxrunError(
                f"the prompt ({len(req.prompt)} tokens) plus max_tokens ({req.max_tokens}) "
                f"exceeds the context of {self.context} tokens; shorten one of them"
            )

    def submit(self, req: Request) -> Request:
        self.check(req)
        if self.sync is not None:
            req.deferred = True
            fix_seed(req)
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            queued = len(self.waiting) + len(self.arrived)
            if queued >= self.max_queue:
                raise QueueFull(f"{queued} requests are already waiting (--max-queue); retry later")
            req.phases.submitted = now()
            req.phases.prompt = len(req.prompt)
            (self.waiting if self.sync is None else self.arrived).append(req)
            self.stats["requests"] += 1
            self._cond.notify()
        return req

    def stream(self, req: Request) -> Iterator[Event]:
        """Submit `req` and yield its events until it finishes (for callers on a thread of
        their own; closing the iterator cancels the request)."""
        q: queue.Queue[Event] = queue.Queue()
        req.on_event = q.put
        self.submit(req)
        try:
            while True:
                ev = q.get()
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            req.cancel()
            with self._cond:
                self._cond.notify()

    def grammars(self):
        """The tokenizer's compiled-grammar cache (`mlxrun.structured.Grammars`)."""
        return grammars_for(self.tokenizer, self.model.config.vocab_size)

    def health(self) -> dict:
        with self._cond:
            running = sum(s is not None for s in self.seqs)
            last = self.recent[-1].breakdown() if self.recent else None
            return {
                "status": "ok",
                "running": running,
                "waiting": len(self.waiting),
                "slots": self.max_batch,
                "context": self.context,
                **self.stats,
                "last_first_token_ms": last,
            }

    def close(self) -> None:
        """Stop the loop; waiting and running requests end with finish_reason "cancelled"."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def wait(self) -> None:
        """Until the loop ends: a tensor-parallel follower's engine, until rank 0's stops."""
        self._thread.join()

    # --- the engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            if self.sync is None:
                with self._cond:
                    while not self._stopping and not self.waiting and not any(self.seqs):
                        self._cond.wait()
                    if self._stopping:
                        break
            elif self._exchange():
                break
            elif not self.waiting and not any(self.seqs):
                continue
            try:
                self._step()
            except Exception as e:  # a fault in a step fails its requests, not the server
                print(f"mlxrun: engine error: {type(e).__name__}: {e}", file=sys.stderr)
                if self.sync is not None:  # the other ranks wait in this step's sums: end
                    sys.stderr.flush()  # every rank (the launcher stops the others)
                    os._exit(1)
                if self.graphs is not None:
                    self.graphs.forget()
                    self._flight = None
                for s in [s for s in self.seqs if s is not None]:
                    self._send(s, Event("", None, None, "error", 0, s.n, s.cached, str(e)))
                    self._retire(s, keep=False)
        for s in [s for s in self.seqs if s is not None]:
            self._send(s, Event("", None, None, "cancelled", len(s.req.prompt), s.n, s.cached))
            self._retire(s, keep=False)
        with self._cond:
            waiting, self.waiting = list(self.waiting), deque()
        for r in waiting:
            if r.on_event is not None:
                r.on_event(Event("", None, None, "cancelled", len(r.prompt), 0, 0))

    def _exchange(self) -> bool:
        """The step's message between ranks (engine_tp): rank 0 sends what arrived and what
        was cancelled, the others apply it. True: stop."""
        if not self.sync.leader:
            news = self.sync.exchange()
            self.waiting.extend(from_wire(d, Request) for d in news["arrived"])
            gone = set(news["cancelled"])
            for r in self._live():
                r.cancelled = r.cancelled or r.id in gone
            return news["stop"]
        with self._cond:
            if not (self._stopping or self.arrived or self.waiting or any(self.seqs)):
                self._cond.wait(IDLE_BEAT_S)
            arrived, self.arrived = self.arrived, []
            self.waiting.extend(arrived)
            stop = self._stopping
        gone = [r.id for r in self._live() if r.asked and not r.cancelled]
        for r in self._live():
            r.cancelled = r.cancelled or r.asked
        news = {"arrived": [to_wire(r) for r in arrived], "cancelled": gone, "stop": stop}
        self.sync.exchange(news if arrived or gone or stop else None)
        return stop

    def _live(self) -> list[Request]:
        with self._cond:
            return list(self.waiting) + [s.req for s in self.seqs if s is not None]

    def _step(self) -> None:
        for s in [s for s in self.seqs if s is not None and s.req.cancelled]:
            self.stats["cancelled"] += 1
            self._retire(s)
        self._admit()
        pre = [s for s in self.seqs if s is not None and s.done < len(s.req.prompt)]
        if pre:  # one chunk of one prompt a step, so a long prompt stalls the others little
            self._prefill(min(pre, key=lambda s: s.req.id))
        dec = [s for s in self.seqs if s is not None and s.done == len(s.req.prompt) and s.n]
        if dec:
            self._decode(dec)
        elif self._flight is not None:  # its sequences were all cancelled
            self._flight = None
        self.stats["steps"] += 1

    def _admit(self) -> None:
        while True:
            with self._cond:
                free = [i for i, s in enumerate(self.seqs) if s is None]
                if not free or not self.waiting:
                    return
                req = self.waiting.popleft()
            req.phases.admitted = now()
            if req.cancelled:
                self.stats["cancelled"] += 1
                continue
            try:
                matcher = (
                    None if req.constraint is None else self.grammars().matcher(req.constraint)
                )
            except MlxrunError as e:
                if req.on_event is not None:
                    req.on_event(Event("", None, None, "error", len(req.prompt), 0, 0, str(e)))
                continue
            slot, cached = self._place(req.prompt, free)
            req.phases.placed, req.phases.cached = now(), cached
            self.seqs[slot] = _Seq(req, slot, cached, self.tokenizer, matcher)
            self.stats["prompt_tokens"] += len(req.prompt)
            if cached:
                self.stats["prefix_hits"] += 1
                self.stats["prefix_tokens_reused"] += cached

    def _place(self, prompt: list[int], free: list[int]) -> tuple[int, int]:
        """A free slot for `prompt` and how many of its first tokens that slot already holds.

        The longest prefix held anywhere wins: in a free slot it is kept in place (the next
        turn of a chat); in a running one it is copied (a shared system prompt). At least
        one prompt token is always prefilled: its logits give the first new token.
        """
        best, src = MIN_PREFIX - 1, None
        if self.prefix_cache:
            for i in range(self.max_batch):
                n = min(_common(self.held[i], prompt), len(prompt) - 1)
                if not self.cache.keeps(i, n):  # its window rings moved on past n
                    continue
                if n > best or (n == best and src is not None and self.seqs[i] is None):
                    best, src = n, i
        best = best if src is not None else 0
        if src is not None and self.seqs[src] is None:
            slot = src
        else:
            slot = min(free, key=lambda i: self.used[i])
            if src is not None:
                self.cache.copy_prefix(src, slot, best)
        self.cache.set_length(slot, best)
        self.held[slot] = list(prompt[:best])
        return slot, best

    def _prefill(self, s: _Seq) -> None:
        be, prompt = self.be, s.req.prompt
        chunk = prompt[s.done : s.done + self.prefill_chunk]
        g = self.graphs
        if (g is not None and s.matcher is None and s.done + len(chunk) == len(prompt)
                and len(chunk) <= g.tail_max):  # fmt: skip
            return self._prefill_fixed(s, chunk)
        self.cache.select([s.slot])
        logits = self.model(be.ids(np.asarray([chunk])), self.cache, None, last_only=True)
        s.req.phases.chunks.append((len(chunk), now(), False))
        self.held[s.slot].extend(chunk)
        s.done += len(chunk)
        if s.done < len(prompt):
            be.eval(logits)  # bound MLX's lazy graph to one chunk
            return
        toks, lps = sample_rows(be, logits, [s])
        ok = be.to_numpy(be.finite_rows(logits)).reshape(-1)
        self._emit(s, int(toks[0]), lps[0], bool(ok[0]))

    def _decode(self, seqs: list[_Seq]) -> None:
        if self.graphs is not None:
            return self._decode_fixed(seqs)
        be = self.be
        self.cache.select([s.slot for s in seqs])
        ids = np.asarray([[s.last] for s in seqs])
        logits = self.model(be.ids(ids), self.cache, None, last_only=True)  # (B, V)
        be.queue(logits)  # MLX: started now, so sample_rows' grammar masks overlap it
        for s in seqs:
            self.held[s.slot].append(s.last)
        toks, lps = sample_rows(be, logits, seqs)
        ok = be.to_numpy(be.finite_rows(logits)).reshape(-1)
        for s, t, lp, f in zip(seqs, toks.tolist(), lps, ok.tolist()):
            self._emit(s, t, lp, bool(f))

    def _retire(self, s: _Seq, keep: bool = True) -> None:
        """Free the slot now; its keys and values stay as a prefix for later requests."""
        self._tick += 1
        self.used[s.slot] = self._tick
        if not (keep and self.prefix_cache):
            self.held[s.slot] = []
            self.cache.set_length(s.slot, 0)
        with self._cond:
            self.seqs[s.slot] = None


def engine_for(m, max_batch: str | int = "auto", context: int | None = None, **kw) -> Engine:
    """An Engine for a loaded mlxrun.Model, sized by its memory plan: `context` defaults to
    the model's (capped by what one sequence can hold), `max_batch` "auto" to the most
    sequences of that context that fit (at most 32 on CUDA, 8 elsewhere)."""
    cap = 32 if m.backend.device == "cuda" else 8
    if context is None:
        context = min(m.config.context_length, max(m.plan(None, 1).max_context, 1))
    if context < 2:
        raise MlxrunError(f"--context must be at least 2, got {context}")
    if max_batch == "auto":
        plan = m.plan(context, 1)
        if plan.max_batch < 1:
            raise MlxrunError(f"one sequence of {context} tokens does not fit: {plan.advice}")
        batch = min(plan.max_batch, cap)
    else:
        if not (str(max_batch).isdigit() and int(max_batch) >= 1):
            raise MlxrunError(
                f"--max-batch must be a positive integer or 'auto', got {max_batch!r}"
            )
        batch = int(max_batch)
        plan = m.plan(context, batch)
        if not plan.fits:
            raise MlxrunError(f"{batch} sequences of {context} tokens do not fit: {plan.advice}")
    g = m.backend.group
    if g is not None and g.size > 1:  # every rank's engine has rank 0's slots and context
        mine = [batch, context] if g.rank == 0 else [0, 0]
        batch, context = (int(v) for v in g.all_sum_np(np.array(mine, dtype=np.int64)))
    return Engine(m.transformer, m.tokenizer, max_batch=batch, context=context, **kw)
