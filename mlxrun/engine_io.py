"""What goes into the serving engine and what comes out: a `Request` (prompt, sampling,
limits, the callback), the `Event` each generated token produces, and `QueueFull` when the
waiting queue is at its bound. Servers and the chat loop build these; `mlxrun.engine` runs
them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import MlxrunError
from .phases import Phases
from .sampling import SamplingParams
from .structured import Constraint


class QueueFull(MlxrunError):
    """The engine's waiting queue is at --max-queue: try again later."""


@dataclass
class TokenLogprob:
    """log P(token) under the model's raw logits, and the `top` likeliest alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """One generated token's worth of output for a request. `text` is the newly final text
    (empty while a multi-byte character or a possible stop string is pending)."""

    text: str
    token: int | None
    logprob: TokenLogprob | None
    finish_reason: str | None  # None while running; "stop", "length", "cancelled", "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose keys and values came from the prefix cache
    error: str | None = None


_ids = itertools.count(1)


@dataclass
class Request:
    """What to generate. `on_event` is called from the engine's thread for every token."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: the chosen token's and the top k
    constraint: Constraint | None = None  # a JSON schema, regex or grammar to follow
    markup: bool | None = None  # keep special tokens in the text (None: as the tokenizer)
    on_event: Callable[[Event], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False  # as the engine sees it
    asked: bool = False  # cancel() was called
    deferred: bool = False  # cancel() takes effect at the next step's message (tensor parallel)
    phases: Phases = field(default_factory=Phases)  # where its time to first token went

    def cancel(self) -> None:
        """Stop generating; the engine frees the slot at its next step."""
        self.asked = True
        if not self.deferred:
            self.cancelled = True
