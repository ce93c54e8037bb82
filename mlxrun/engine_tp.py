"""One serving engine over tensor-parallel ranks: rank 0 takes the requests, every rank
runs the same steps.

Every forward pass needs every rank (the model's sums), so the ranks' engines must admit,
cancel and decode the same sequences at the same step. Rank 0's engine holds the server
side; at the top of each step it sends the requests that arrived and the ones cancelled
since the last step (one all-reduce of a length, and one of the bytes when there is
news), and the other ranks' engines apply them and take the same step. Tokens need no
message: every rank samples the same summed logits with the same per-request seeds. When
idle, rank 0 still sends an empty message every second, so the others' wait for the next
one never runs into the collective library's timeout.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np

from .sampling import SamplingParams, row_seed
from .structured import Constraint

IDLE_BEAT_S = 1.0


def to_wire(req) -> dict:
    """The fields of an engine Request that decide its tokens (its callbacks stay home)."""
    return {
        "id": req.id,
        "prompt": req.prompt,
        "params": asdict(req.params),
        "max_tokens": req.max_tokens,
        "stop": req.stop,
        "logprobs": req.logprobs,
        "constraint": None if req.constraint is None else asdict(req.constraint),
        "markup": req.markup,  # the text decides where a stop string ends it
    }


def from_wire(d: dict, make):
    """A follower's copy of a request: `make` is the engine's Request class."""
    return make(
        prompt=d["prompt"],
        params=SamplingParams(**d["params"]),
        max_tokens=d["max_tokens"],
        stop=d["stop"],
        logprobs=d["logprobs"],
        constraint=None if d["constraint"] is None else Constraint(**d["constraint"]),
        markup=d.get("markup"),
        id=d["id"],
    )


def fix_seed(req) -> None:
    """Draw an unseeded request's seed once, on rank 0, so every rank uses the same one."""
    if req.params.seed is None:
        p = req.params
        req.params = SamplingParams(**(asdict(p) | {"seed": row_seed(p)}))


class StepSync:
    """The per-step message from rank 0 to the others, over the model's process group."""

    def __init__(self, group):
        self.group = group

    @property
    def leader(self) -> bool:
        return self.group.rank == 0

    def exchange(self, news: dict | None = None) -> dict:
        """Rank 0 passes its news ({"arrived": [...], "cancelled": [...], "stop": bool});
        every rank gets it back. Empty news costs one all-reduce of one number."""
        raw = json.dumps(news).encode() if self.leader and news else b""
        n = self.group.all_sum_np(np.array([len(raw)], dtype=np.int64))[0]
        if n == 0:
            return {"arrived": [], "cancelled": [], "stop": False}
        buf = np.zeros(int(n), dtype=np.int32)  # bytes as int32: every library sums those
        if self.leader:
            buf[:] = np.frombuffer(raw, dtype=np.uint8)
        got = self.group.all_sum_np(buf).astype(np.uint8).tobytes()
        return json.loads(got)
