"""The loaded model's Python API: `Model`, with generate / stream / generate_many / logits,
and the prompt and sampling-option checks they share.

Separate from `mlxrun.api`, which finds, checks and builds a model (`load`): what a loaded
model does with prompts is one thing, how it came to be loaded is another."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .errors import MlxrunError
from .generate import BatchResult, GenerationResponse, generate, stream
from .memory import Plan
from .sampling import SamplingParams
from .structured import constraint_of

Prompt = str | Sequence[int] | Sequence[dict]  # text, token ids or chat messages


def _is_messages(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)


def _is_token_ids(p: Any) -> bool:
    if isinstance(p, np.ndarray):
        return p.ndim == 1 and p.dtype.kind in "iu"
    return isinstance(p, (list, tuple)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p
    )


def _is_batch(p: Any) -> bool:
    """A list of prompts, as opposed to one prompt given as token ids or messages."""
    if isinstance(p, np.ndarray):
        return p.ndim == 2
    return (
        isinstance(p, (list, tuple))
        and bool(p)
        and all(isinstance(x, (str, list, tuple, np.ndarray)) for x in p)
    )


def _check_ids(ids: np.ndarray, vocab: int) -> None:
    if ids.min() < 0 or ids.max() >= vocab:
        raise MlxrunError(f"token ids must be in [0, {vocab})")


def _check_max_tokens(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise MlxrunError(f"max_tokens must be at least 1, got {n}")


def _sampling(kw: dict) -> SamplingParams:
    """SamplingParams from keyword arguments; `temp` is mlx-lm's name for temperature."""
    kw = dict(kw)
    if "temp" in kw:
        if "temperature" in kw:
            raise MlxrunError("give temperature or temp, not both")
        kw["temperature"] = kw.pop("temp")
    unknown = sorted(set(kw) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise MlxrunError(
            f"unknown sampling option {', '.join(unknown)}; the options are temperature (temp), "
            "top_p, top_k, min_p, repetition_penalty, seed"
        )
    return SamplingParams(**kw)


# CLI flags in the library's messages, as the Python parameters they are there.
_FLAG_NAMES = {"temp": "temperature", "no-chat": "chat=False"}


def _param_words(msg: str) -> str:
    return re.sub(
        r"--([a-z][a-z0-9-]*)", lambda m: _FLAG_NAMES.get(m[1], m[1].replace("-", "_")), msg
    )


def _renamed(e: MlxrunError) -> MlxrunError:
    """The error in parameter names; the CLI prints `cli_message`, in its flags."""
    new = MlxrunError(_param_words(str(e)))
    new.cli_message = getattr(e, "cli_message", str(e))
    return new


def _api_names(fn: Callable) -> Callable:
    """Re-raise MlxrunError with parameter names where the message names CLI flags."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen(*a, **kw):
            try:
                yield from fn(*a, **kw)
            except MlxrunError as e:
                raise _renamed(e) from None

        return gen

    @functools.wraps(fn)
    def call(*a, **kw):
        try:
            return fn(*a, **kw)
        except MlxrunError as e:
            raise _renamed(e) from None

    return call


class Model:
    """A loaded model on one backend.

    `tokenizer` encodes, decodes and applies the chat template; `backend` says where it runs;
    `notes` lists what loading decided that the user should know (unquantized layers).
    """

    def __init__(
        self,
        transformer,
        tokenizer,
        source: str,
        notes: list[str],
        load_time: float,
        shapes: dict,
        quant=None,
    ):
        self.transformer = transformer
        self._shapes = shapes  # {tensor: (shape, dtype)} as stored, for memory plans
        self.quant = quant
        self.tokenizer = tokenizer
        self.config = transformer.config
        self.backend = transformer.be
        self.source = source
        self.notes = notes
        self.load_time = load_time
        self.expanded = False  # a packed checkpoint dequantized on load
        self._drafts: dict = {}  # draft models loaded by name, for speculative decoding

    def __repr__(self) -> str:
        return f"<mlxrun.Model {self.source} on {self.backend.describe()}>"

    @property
    def kv_quant(self) -> str | None:
        """The KV cache's format for the caches made from now on: 'int8', 'fp8' or None."""
        return self.transformer.kv_quant

    @kv_quant.setter
    def kv_quant(self, value: str | None) -> None:
        from .kvquant import check_head_dim, parse_kv_quant  # noqa: PLC0415

        kv = parse_kv_quant(value)
        check_head_dim(kv, self.config.head_dim, self.backend.name)
        self.transformer.kv_quant = kv

    def _ids(self, prompt: Prompt, system: str | None, chat: bool | None) -> list[int]:
        """Text, token ids or chat messages -> the prompt's token ids."""
        if isinstance(prompt, str):
            return self.tokenizer.prompt_ids(prompt, system=system, chat=chat)
        if _is_messages(prompt):
            if chat is False:
                raise MlxrunError("chat messages need the chat template; drop chat=False")
            messages = ([{"role": "system", "content": system}] if system else []) + list(prompt)
            text = self.tokenizer.apply_chat_template(messages)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if _is_token_ids(prompt):
            ids = [int(t) for t in prompt]
            if not ids:
                raise MlxrunError("the prompt holds no token ids")
            _check_ids(np.asarray(ids), self.config.vocab_size)
            return ids
        raise MlxrunError(
            "prompt must be text, a list of token ids, or chat messages "
            f'[{{"role": ..., "content": ...}}], got {type(prompt).__name__}'
        )

    @_api_names
    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        *,
        system: str | None = None,
        chat: bool | None = None,
        stop: list[str] | None = None,
        json_schema: dict | str | None = None,
        grammar: str | None = None,
        regex: str | None = None,
        draft: Any = None,
        draft_model: Any = None,
        num_draft: int | None = None,
        **sampling: Any,
    ) -> Iterator[GenerationResponse]:
        """Yield GenerationResponse pieces (text, token, running stats, finish_reason).

        prompt: text, token ids, or chat messages [{"role", "content"}] (as mlx-lm takes).
        sampling: temperature (or temp), top_p, top_k, min_p, repetition_penalty, seed.
        json_schema (a dict or JSON text), grammar (GBNF or Lark) or regex: the answer
        follows it (constrained decoding, `mlxrun.structured`; needs mlxrun[structured]).
        Speculative decoding: draft_model (a Model, or what `load` takes, with this model's
        tokenizer) or draft="ngram" (prompt lookup), num_draft tokens per verify pass;
        `draft` may also be a `mlxrun.speculative` draft object, whose `stats` then count
        the drafted and accepted tokens. Greedy output is the same as without a draft.
        """
        _check_max_tokens(max_tokens)
        constraint = constraint_of(json_schema, grammar, regex)
        ids = self._ids(prompt, system, chat)
        yield from stream(
            self.transformer,
            self.tokenizer,
            ids,
            _sampling(sampling),
            max_tokens=max_tokens,
            stop=stop,
            constraint=constraint,
            draft=self.drafter(draft, draft_model, num_draft),
        )

    def drafter(
        self, draft: Any = None, draft_model: Any = None, num_draft: int | None = None
    ) -> Any:
        """The draft source for speculative decoding (`mlxrun.speculative`), or None.

        draft: None, "ngram", or a draft object (returned as it is); draft_model: a Model or
        what `load` takes (loaded once on this model's backend and dtype, then kept)."""
        from .speculative import ModelDraft, NgramDraft  # noqa: PLC0415

        if isinstance(draft, NgramDraft | ModelDraft):
            return draft
        if draft_model is not None:
            if draft not in (None, "model"):
                raise MlxrunError("give --draft-model or --draft ngram, not both")
            return ModelDraft(self._draft_model(draft_model).transformer, num_draft)
        if draft is None:
            if num_draft is not None:
                raise MlxrunError("--num-draft needs --draft-model or --draft ngram")
            return None
        if draft != "ngram":
            raise MlxrunError(f"--draft takes ngram (or use --draft-model), got {draft!r}")
        return NgramDraft(num_draft)

    def _draft_model(self, source: Any) -> Model:
        from .api import load  # noqa: PLC0415 (mlxrun.api imports this module)

        if isinstance(source, Model):
            d = source
        else:
            kept = self._drafts
            if source not in kept:
                be = self.backend
                kept[source] = load(
                    source,
                    backend="mlx" if be.name == "mlx" else be.device,
                    dtype=be.dtype,
                    progress=False,
                    fastest=True,
                )
            d = kept[source]
        if d.backend.name != self.backend.name or d.backend.device != self.backend.device:
            raise MlxrunError(
                f"the draft model runs on {d.backend.describe()} and the target on "
                f"{self.backend.describe()}; load both on one backend"
            )
        if d.tokenizer.vocab() != self.tokenizer.vocab():
            raise MlxrunError(
                f"the draft model {d.source} has another tokenizer than {self.source} "
                f"({d.tokenizer.vocab_size} vs {self.tokenizer.vocab_size} tokens); "
                "draft with a model of the same tokenizer"
            )
        return d

    @_api_names
    def generate(
        self,
        prompt: Prompt | list[Prompt],
        max_tokens: int = 256,
        *,
        system: str | None = None,
        chat: bool | None = None,
        stop: list[str] | None = None,
        batch_size: int | str = "auto",
        json_schema: dict | str | None = None,
        grammar: str | None = None,
        regex: str | None = None,
        draft: Any = None,
        draft_model: Any = None,
        num_draft: int | None = None,
        **sampling: Any,
    ) -> str | list[str]:
        """The whole answer as a string (same options as `stream`). A list of prompts (texts,
        or lists of token ids or of messages) runs as batches (`generate_many`, batch_size
        "auto" from the memory plan) and returns the answers in input order."""
        _check_max_tokens(max_tokens)
        constraint = constraint_of(json_schema, grammar, regex)
        drafter = self.drafter(draft, draft_model, num_draft)
        if _is_batch(prompt):
            if drafter is not None:
                raise MlxrunError(
                    "speculative decoding runs one prompt at a time; "
                    "drop --draft-model / --draft for batches"
                )
            results, _ = self.generate_many(
                list(prompt), max_tokens, system=system, chat=chat, stop=stop,
                batch_size=batch_size, json_schema=json_schema, grammar=grammar, regex=regex,
                **sampling,
            )  # fmt: skip
            return [r.text for r in results]
        ids = self._ids(prompt, system, chat)
        text, _ = generate(
            self.transformer,
            self.tokenizer,
            ids,
            params=_sampling(sampling),
            max_tokens=max_tokens,
            stop=stop,
            constraint=constraint,
            draft=drafter,
        )
        return text

    def plan(self, context: int, batch: int, prompt_tokens: int | None = None) -> Plan:
        """The memory plan (mlxrun.memory.Plan) for `batch` sequences of `context` tokens,
        `prompt_tokens` of them the longest prompt (default: all)."""
        from .planning import plan_shapes  # noqa: PLC0415

        be = self.backend
        return plan_shapes(
            self.config,
            self._shapes,
            self.quant,
            "mlx" if be.name == "mlx" else be.device,
            be.dtype,
            context,
            batch,
            prompt_tokens=prompt_tokens,
            kv_quant=self.transformer.kv_quant,
        )

    @_api_names
    def generate_many(
        self,
        prompts: list[Prompt],
        max_tokens: int = 256,
        *,
        system: str | None = None,
        chat: bool | None = None,
        stop: list[str] | None = None,
        batch_size: int | str = "auto",
        params: SamplingParams | None = None,
        json_schema: dict | str | None = None,
        grammar: str | None = None,
        regex: str | None = None,
        **sampling: Any,
    ) -> tuple[list[BatchResult], dict]:
        """Run many prompts as batches: ([BatchResult] in input order, stats dict with
        batch_size, tokens and seconds).

        batch_size "auto" takes the largest batch the memory plan allows for the longest
        prompt plus max_tokens; a fixed size that cannot fit is refused before it runs.
        """
        from .generate import generate_batch  # noqa: PLC0415
        from .memory import check_fits  # noqa: PLC0415

        if not prompts:
            raise MlxrunError("no prompts given")
        _check_max_tokens(max_tokens)
        constraint = constraint_of(json_schema, grammar, regex)
        ids = [self._ids(p, system, chat) for p in prompts]
        longest = max(len(i) for i in ids)
        context = longest + max_tokens
        if context > self.config.context_length:
            raise MlxrunError(
                f"the longest prompt ({longest} tokens) + "
                f"--max-tokens ({max_tokens}) exceeds the model's context of "
                f"{self.config.context_length} tokens"
            )
        want = len(prompts) if batch_size == "auto" else int(batch_size)
        if want < 1:
            raise MlxrunError(f"--batch-size must be at least 1, got {batch_size}")
        p = self.plan(context, want, prompt_tokens=longest or None)
        if batch_size == "auto":
            if p.max_batch < 1:
                check_fits(p)
            bs = min(want, p.max_batch)
        else:
            check_fits(p)
            bs = want
        t0 = time.perf_counter()
        results = generate_batch(
            self.transformer,
            self.tokenizer,
            ids,
            params or _sampling(sampling),
            max_tokens=max_tokens,
            stop=stop,
            batch_size=bs,
            constraint=constraint,
        )
        stats = {
            "batch_size": bs,
            "tokens": sum(r.generated for r in results),
            "seconds": time.perf_counter() - t0,
        }
        return results, stats

    @_api_names
    def logits(self, token_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """Logits at every position, float32: token ids [T] -> [T, vocab], a batch of
        equal-length sequences [B, T] -> [B, T, vocab]."""
        if isinstance(token_ids, str):
            raise MlxrunError(
                "logits() takes token ids, not text; encode it with m.tokenizer.encode(text)"
            )
        try:
            ids = np.asarray(token_ids)
        except ValueError:  # ragged nested lists
            ids = np.asarray([], dtype=object)
        if ids.dtype == object or ids.ndim not in (1, 2):
            raise MlxrunError(
                "logits() takes token ids [T] or a batch of equal-length sequences [B, T]; "
                "pad the sequences or call it once per sequence"
            )
        if ids.size == 0:
            raise MlxrunError("logits() needs at least one token id")
        if ids.dtype.kind not in "iu":
            raise MlxrunError(f"token ids must be integers, got {ids.dtype}")
        _check_ids(ids, self.config.vocab_size)
        batch = ids.reshape(-1, ids.shape[-1]).astype(np.int64)
        be = self.backend
        cache = self.transformer.make_cache(batch.shape[0], batch.shape[1])
        out = be.to_numpy(self.transformer(be.ids(batch), cache))
        return out if ids.ndim == 2 else out[0]
