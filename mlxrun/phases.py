"""Where a request's time to first token goes: host clock stamps taken on its way through
the server and the engine, cheap enough to take for every request.

The stamps are time.perf_counter() seconds (one clock for the server's event loop and the
engine's thread). A prefill chunk's stamp is when its forward pass was queued: on CUDA the
device may still be running it, so the wait for the device shows up in `first_token`
(where the sampled token reaches the host), not in the chunk's own time; a chunk run as a
fixed-shape step (`fixed`, slot_graph.SlotDecoder.prefill) is stamped once its token is on
the host, so its device time is in the chunk's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def now() -> float:
    return time.perf_counter()


@dataclass
class Phases:
    """Stamps of one request up to its first token; None where not (yet) reached."""

    received: float | None = None  # the server has the request's body (HTTP only)
    submitted: float | None = None  # queued in the engine
    admitted: float | None = None  # the engine's thread took it from the queue
    placed: float | None = None  # a slot chosen and the held prefix matched (or copied)
    cached: int = 0  # prompt tokens whose keys and values were reused
    prompt: int = 0  # prompt tokens
    chunks: list[tuple[int, float, bool]] = field(default_factory=list)  # (tokens, queued, fixed)
    first_token: float | None = None  # the first sampled token on the host
    first_event: float | None = None  # its event handed to the request's callback
    first_sent: float | None = None  # its text written to the HTTP stream (server)

    def breakdown(self) -> dict:
        """Milliseconds per phase, in order (the phases not reached are left out):
        http_in (body to queue: parsing, templating, tokenizing), queue_wait (queued to taken
        by the engine, which finishes the step it is in first), place (slot choice and
        prefix match or copy), prefill_queue (queuing the prefill chunks' passes), device
        (from the last chunk queued to its token on the host: the device's remaining work
        and the sampling), emit (detokenizing and the callback), http_out (the callback to
        the first text on the wire), total (first stamp to last)."""
        out: dict = {"prompt_tokens": self.prompt, "cached_tokens": self.cached,
                     "chunks": [n for n, _, _ in self.chunks],
                     "fixed_chunks": sum(f for _, _, f in self.chunks)}  # fmt: skip
        last = self.chunks[-1][1] if self.chunks else None
        marks = [
            ("http_in", self.received, self.submitted),
            ("queue_wait", self.submitted, self.admitted),
            ("place", self.admitted, self.placed),
            ("prefill_queue", self.placed, last),
            ("device", last, self.first_token),
            ("emit", self.first_token, self.first_event),
            ("http_out", self.first_event, self.first_sent),
        ]
        for name, a, b in marks:
            if a is not None and b is not None:
                out[name] = round(1e3 * (b - a), 3)
        stamps = [s for s in (self.received, self.submitted, self.first_sent or self.first_event)
                  if s is not None]  # fmt: skip
        if len(stamps) >= 2:
            out["total"] = round(1e3 * (stamps[-1] - stamps[0]), 3)
        return out
