"""Generation as a stack of generators: `generate_step` yields token ids for a batch,
`stream` turns one sequence into text pieces with stats and a finish reason, and
`generate` joins them. The CLI and the Python API are thin shells over these."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import MlxrunError
from .memory import prefill_chunk_for
from .model import Transformer
from .sampling import SamplingParams, mask_words, pack, plan_for
from .structured import Constraint, fill_masks, grammars_for
from .tokenizer import Tokenizer


@dataclass
class GenerationResponse:
    """One streamed piece. `text` is the new text (may be empty while a multi-byte
    character or a possible stop string is pending); stats are running totals."""

    text: str
    token: int | None
    finish_reason: str | None  # None while running, then "stop" or "length"
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB (1e9 bytes) as the backend measures it, as in mlx-lm
    logprob: float | None = None  # log-probability of `token` under the model, when asked
    top_logprobs: list[tuple[int, float]] | None = None  # the n most likely (id, logprob)


class Step(NamedTuple):
    """One decode step of a batch with log-probabilities (`generate_step(logprobs=n)`)."""

    tokens: np.ndarray  # (B,) int64
    logprob: np.ndarray  # (B,) the chosen tokens' log-probabilities under the model
    top_logprobs: np.ndarray | None  # (B, n) the n largest, best first
    top_ids: np.ndarray | None  # (B, n) their token ids


def left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray | None]:
    """Token lists -> (B, L) ids right-aligned, and pads (B,) (None when all equal)."""
    L = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), L), dtype=np.int64)
    pads = np.array([L - len(p) for p in prompts], dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, pads[b] :] = p
    return ids, (pads if pads.any() else None)


def generate_step(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    max_tokens: int,
    prefill_chunk: int | None = None,
    logprobs: int | None = None,
    matchers: list | None = None,
) -> Iterator[np.ndarray | Step]:
    """Yield the next token of every sequence (B,) int64, `max_tokens` times at most.

    `params` is one setting for every sequence or one per sequence. Tokens are chosen on
    the device (greedy or sampled) and only they come back to the host. With `logprobs`
    (0 for the chosen token's alone, n for the n best beside it) each step is a `Step`.
    The step after the one being yielded is already queued on the device, so the host's
    detokenizing and stop checks overlap the device's work. `matchers` (one per sequence,
    None where free; `mlxrun.structured`) restrict each row to its grammar's tokens: the
    next step then waits for the chosen token, and its mask is computed on the host while
    the device runs the forward pass.
    """
    if any(len(p) == 0 for p in prompts):
        raise MlxrunError("a prompt encodes to no tokens; give some text")
    be = model.be
    ids, pads = left_pad(prompts)
    B, L = ids.shape
    rows = list(params) if isinstance(params, list | tuple) else [params] * B
    if len(rows) != B:
        raise MlxrunError(f"{len(rows)} sampling settings for {B} prompts; give one or one each")
    if matchers is not None and len(matchers) != B:
        raise MlxrunError(f"{len(matchers)} constraints for {B} prompts; give one each")
    limit = model.config.context_length
    if L + max_tokens > limit:
        raise MlxrunError(
            f"prompt ({L} tokens) + --max-tokens ({max_tokens}) exceeds the "
            f"model's context of {limit} tokens; shorten one of them"
        )
    if prefill_chunk is None:  # the planner's choice, so its workspace is what runs
        prefill_chunk = prefill_chunk_for(be.name, be.memory_kind, B)
    with be.wired(model.weight_bytes() + model.kv_bytes(B, L + max_tokens, prefill_chunk)):
        yield from _steps(
            model, ids, pads, rows, max_tokens, prefill_chunk, prompts, logprobs, matchers
        )


def _not_finite(step: int, ok: np.ndarray) -> MlxrunError:
    rows = [int(b) for b in np.flatnonzero(~ok)]
    return MlxrunError(
        f"the model's logits are NaN or infinite at generated token {step + 1} (sequence "
        f"{', '.join(map(str, rows))}): stopping rather than emitting garbage; the weights "
        "or activations overflow, so try --dtype float32 or another checkpoint"
    )


def _advance(matchers: list, toks: np.ndarray) -> None:
    """Move each live matcher on by its row's token (a rejected token leaves the matcher
    in its error state: the row draws freely from then on, as an ended row does)."""
    for m, t in zip(matchers, toks.tolist()):
        if m is not None and not m.done and m.error is None:
            m.advance(t)


def _steps(model, ids, pads, rows, max_tokens, prefill_chunk, prompts, logprobs, matchers):
    be = model.be
    B, L = ids.shape
    cache = model.make_cache(B, L + max_tokens, chunk=prefill_chunk)
    if (
        be.group is not None
        and any(p.seed is None for p in rows)
        and not all(p.greedy for p in rows)
    ):
        # split over ranks, every rank must draw the same tokens (or they part ways and
        # wait for each other in the next all_sum): seeds drawn by rank 0 for all
        shared = be.group.shared_seed()
        rows = [
            p if p.seed is not None else dataclasses.replace(p, seed=(shared + b) & 0xFFFFFFFF)
            for b, p in enumerate(rows)
        ]
    masked = matchers is not None and any(m is not None for m in matchers)
    plain = logprobs is None and all(p.greedy for p in rows) and not masked
    sampler = None

    def sample(logits):
        """(next ids (B,), per-row finiteness (B,)), both on the device; a masked plan
        samples under the masks of the matchers' current state."""
        nonlocal sampler
        if plain:
            return be.argmax(logits), be.finite_rows(logits)
        V = int(logits.shape[-1])  # the head's vocabulary, known from the first logits
        if sampler is None:
            plan = plan_for(rows, V, logprobs, masked)
            mask = fill_masks(matchers, mask_words(V)) if masked else None
            sampler = be.sampler(plan, pack(rows, prompts, plan, mask=mask))
        elif masked:
            set_masks(sampler)
        return sampler(logits), be.finite_rows(logits)

    def set_masks(smp) -> None:
        smp.set_mask(fill_masks(matchers, mask_words(smp.plan.vocab), out=smp.mask_buffer()))

    def started(y, ok, smp):
        """(ids, flags, log-probabilities or None), their copies to the host queued as one
        point of the decode timeline."""
        extra = smp.logprobs() if smp is not None and logprobs is not None else None
        be.start(y, ok, *(x for x in extra or () if x is not None))
        return y, ok, extra

    def host(x):
        return None if x is None else be.to_numpy(x)

    for s in range(0, L, prefill_chunk):
        logits = model(be.ids(ids[:, s : s + prefill_chunk]), cache, pads, last_only=True)
        if s + prefill_chunk < L:
            be.eval(logits)  # bound MLX's lazy graph to one chunk
    cur = started(*sample(logits), sampler)
    # Decode may run as captured graphs (CUDA); same math, fewer launches. The graph samples
    # with its own copy of the sampler, loaded with this one's state.
    graph = be.decode_step(model, cache, B, pads, sampler) if max_tokens > 1 else None
    smp = graph.sampler if graph is not None and sampler is not None else sampler

    # A step is a forward pass, then a (masked) sample. The forward pass of step n+1 needs
    # only token n, already on the device, so it is queued before token n is read. Free
    # rows queue the sample at once too; constrained rows first need token n on the host
    # (it advances the matchers), then their masks, computed while the forward pass runs.
    def forward(y):
        if graph is not None:
            graph.forward(y)
            return None
        logits = model(y.reshape(B, 1), cache, pads, True)
        be.queue(logits)  # MLX: lazy until asked; start it before the host's mask work
        return logits

    def pick(logits):
        if graph is not None:
            set_masks(smp)
            return graph.sample(), graph.finite
        return sample(logits)

    def whole_step(y):
        if graph is not None:
            return graph(y), graph.finite
        return sample(model(y.reshape(B, 1), cache, pads, True))

    try:
        for n in range(max_tokens):
            more = n + 1 < max_tokens
            if more and masked:
                pending = forward(cur[0])
            elif more:
                nxt = started(*whole_step(cur[0]), smp)
            toks = be.to_numpy(cur[0]).astype(np.int64).reshape(B)
            # The flags travel beside the token (their copy queued with it), so checking them
            # costs no extra wait; a NaN row's token is still an id in range, so the step
            # already queued on it runs harmlessly.
            ok = be.to_numpy(cur[1]).astype(bool).reshape(B)
            if not ok.all():
                raise _not_finite(n, ok)
            if masked:  # before the caller sees the token: it may ask whether the row is done
                _advance(matchers, toks)
            if cur[2] is None:
                yield toks
            else:
                lp, top, top_ids = (host(x) for x in cur[2])
                yield Step(toks, lp, top, None if top_ids is None else top_ids.astype(np.int64))
            if more and masked:  # the masks follow the tokens just read (and the caller's
                # replacing a matcher, as the benchmark does)
                nxt = started(*pick(pending), smp)
            if more:
                cur = nxt
    finally:  # also when the caller stops early (a stop string, a closed stream)
        if graph is not None:
            graph.close()


def _stop_hold(text: str, stops: list[str]) -> int:
    """How many trailing characters might be the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def stream(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams | None = None,
    max_tokens: int = 256,
    stop: list[str] | None = None,
    prefill_chunk: int | None = None,
    logprobs: int | None = None,
    constraint: Constraint | None = None,
    draft=None,
) -> Iterator[GenerationResponse]:
    """Generate for one prompt, yielding text pieces as they become final. With `logprobs`
    (0, or n for the n most likely beside it) each response carries its token's
    log-probability under the model. With `constraint` the answer follows its JSON schema,
    regular expression or grammar (`mlxrun.structured`). With `draft`
    (`mlxrun.speculative.NgramDraft` or `ModelDraft`) the tokens come from speculative
    decoding; its `stats` count them."""
    params = params or SamplingParams()
    if max_tokens < 1:
        raise MlxrunError(f"--max-tokens must be at least 1, got {max_tokens}")
    stops = [s for s in (stop or []) if s]
    be = model.be
    be.reset_peak_memory()
    detok = tokenizer.detokenizer()
    eos = tokenizer.eos_token_ids
    t0 = time.perf_counter()
    t_first = None
    n = 0
    sent = 0  # characters of detok.text already yielded
    prompt_tps = 0.0
    finish = None
    token = None
    lp = top = None
    matchers = None
    if draft is None:
        matchers = _matchers(model, tokenizer, constraint, 1)
        steps = generate_step(
            model, [prompt_ids], params, max_tokens, prefill_chunk, logprobs, matchers
        )
    else:
        from .speculative import check_options  # noqa: PLC0415
        from .speculative import generate_step as speculative_step  # noqa: PLC0415

        if constraint is not None:
            raise MlxrunError(
                "speculative decoding does not follow a schema or grammar yet; drop the "
                "draft or the constraint"
            )
        check_options(params, logprobs, 1)
        steps = speculative_step(model, prompt_ids, params, max_tokens, draft, prefill_chunk)
    for step in steps:
        if logprobs is None:
            token = int(step[0])
        else:
            token, lp = int(step.tokens[0]), float(step.logprob[0])
            if step.top_ids is not None:
                top = list(zip(step.top_ids[0].tolist(), step.top_logprobs[0].tolist()))
        if t_first is None:
            t_first = time.perf_counter()
            prompt_tps = len(prompt_ids) / max(t_first - t0, 1e-9)
        n += 1
        if token in eos:
            finish = "stop"
            detok.flush()
        else:
            detok.add(token)
            if matchers is not None and matchers[0].done:  # nothing but the end may follow
                finish = "stop"
                detok.flush()
            elif n == max_tokens:
                finish = "length"
                detok.flush()
        text = detok.text
        # Held-back text means a stop string can only begin at or after `sent`.
        hits = [i for s in stops if (i := text.find(s, sent)) >= 0]
        if hits:
            text, finish = text[: min(hits)], "stop"
        end = len(text) if finish else len(text) - _stop_hold(text, stops)
        piece, sent = text[sent:end], max(sent, end)
        gen_time = time.perf_counter() - t_first
        yield GenerationResponse(
            piece,
            token,
            finish,
            len(prompt_ids),
            prompt_tps,
            n,
            (n - 1) / gen_time if n > 1 and gen_time > 0 else 0.0,
            be.peak_memory() / 1e9,
            lp,
            top,
        )
        if finish:
            return


def _matchers(model, tokenizer, constraint, n: int) -> list | None:
    """n fresh matchers of `constraint` (compiled once), or None without one."""
    if constraint is None:
        return None
    g = grammars_for(tokenizer, model.config.vocab_size)
    return [g.matcher(constraint) for _ in range(n)]


def generate(
    model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], **kw
) -> tuple[str, GenerationResponse]:
    """Run `stream` to the end: (whole text, last response with the final stats)."""
    text, last = [], None
    for r in stream(model, tokenizer, prompt_ids, **kw):
        text.append(r.text)
        last = r
    return "".join(text), last


@dataclass
class BatchResult:
    """One prompt's outcome in a batch, in the caller's order."""

    text: str
    tokens: list[int]  # the answer's tokens, without the end-of-sequence token
    finish_reason: str  # "stop" or "length"
    generated: int = 0  # tokens generated, the end-of-sequence token included (as stream counts)


def _finish(tokenizer: Tokenizer, toks: list[int], stops: list[str]) -> tuple[str, bool]:
    text = tokenizer.decode(toks)
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def generate_batch(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    params: SamplingParams | None = None,
    max_tokens: int = 256,
    stop: list[str] | None = None,
    batch_size: int = 8,
    prefill_chunk: int | None = None,
    constraint: Constraint | None = None,
) -> list[BatchResult]:
    """Generate for many prompts, `batch_size` at a time, each stopping on its own.

    Prompts are grouped by length so batches carry little padding; results come back in
    input order. With greedy decoding each result equals running that prompt alone.
    """
    params = params or SamplingParams()
    if max_tokens < 1:
        raise MlxrunError(f"--max-tokens must be at least 1, got {max_tokens}")
    if batch_size < 1:
        raise MlxrunError(f"--batch-size must be at least 1, got {batch_size}")
    stops = [s for s in (stop or []) if s]
    eos = tokenizer.eos_token_ids
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[BatchResult | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        toks: list[list[int]] = [[] for _ in idx]
        reason: list[str | None] = [None] * len(idx)
        ended = [0] * len(idx)  # 1 where the sequence ended on an end-of-sequence token
        matchers = _matchers(model, tokenizer, constraint, len(idx))
        for step in generate_step(
            model, [prompts[i] for i in idx], params, max_tokens, prefill_chunk, None, matchers
        ):
            for b, t in enumerate(step.tolist()):
                if reason[b]:
                    continue
                if t in eos:
                    reason[b] = "stop"
                    ended[b] = 1
                    continue
                toks[b].append(t)
                if stops and _finish(tokenizer, toks[b], stops)[1]:
                    reason[b] = "stop"
                if matchers is not None and matchers[b].done:
                    reason[b] = "stop"
            if all(reason):
                break
        for b, i in enumerate(idx):
            text, _ = _finish(tokenizer, toks[b], stops)
            results[i] = BatchResult(text, toks[b], reason[b] or "length", len(toks[b]) + ended[b])
    return results
