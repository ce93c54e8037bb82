"""Generation as a stack of generators: `generate_step` yields token ids for a batch,
`stream` turns one sequence into text pieces with stats and a finish reason, and
`generate` joins them. The CLI and the Python API are thin shells over these."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import MlxrunError
from .memory import prefill_chunk_for
from .model import Transformer
from .sampling import HostSampler, SamplingParams
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
    params: SamplingParams,
    max_tokens: int,
    prefill_chunk: int | None = None,
) -> Iterator[np.ndarray]:
    """Yield the next token of every sequence (B,) int64, `max_tokens` times at most.

    The step after the one being yielded is already queued on the device (greedy path),
    so the host's detokenizing and stop checks overlap the device's work.
    """
    if any(len(p) == 0 for p in prompts):
        raise MlxrunError("a prompt encodes to no tokens; give some text")
    be = model.be
    ids, pads = left_pad(prompts)
    B, L = ids.shape
    limit = model.config.max_position_embeddings
    if L + max_tokens > limit:
        raise MlxrunError(
            f"prompt ({L} tokens) + --max-tokens ({max_tokens}) exceeds the "
            f"model's context of {limit} tokens; shorten one of them"
        )
    if prefill_chunk is None:  # the planner's choice, so its workspace is what runs
        prefill_chunk = prefill_chunk_for(be.name, be.memory_kind, B)
    with be.wired(model.weight_bytes() + model.kv_bytes(B, L + max_tokens)):
        yield from _steps(model, ids, pads, params, max_tokens, prefill_chunk, prompts)


def _steps(model, ids, pads, params, max_tokens, prefill_chunk, prompts):
    be = model.be
    B, L = ids.shape
    cache = model.make_cache(B, L + max_tokens)
    history = [list(p) for p in prompts]
    host = None if params.on_device else HostSampler(params)

    def sample(logits):
        if host is None:
            return be.argmax(logits)
        return be.ids(host(be.to_numpy(logits), history))

    for s in range(0, L, prefill_chunk):
        logits = model(be.ids(ids[:, s : s + prefill_chunk]), cache, pads, last_only=True)
        if s + prefill_chunk < L:
            be.eval(logits)  # bound MLX's lazy graph to one chunk
    y = sample(logits)
    be.start(y)
    # Greedy decode may run as one captured graph per step (CUDA); same math, fewer launches.
    graph = be.decode_step(model, cache, B, pads) if host is None and max_tokens > 1 else None
    try:
        for n in range(max_tokens):
            if n + 1 < max_tokens:
                if graph is not None:
                    nxt = graph(y)
                else:
                    nxt = sample(model(y.reshape(B, 1), cache, pads, last_only=True))
                be.start(nxt)
            toks = be.to_numpy(y).astype(np.int64).reshape(B)
            for b in range(B):
                history[b].append(int(toks[b]))
            yield toks
            if n + 1 < max_tokens:
                y = nxt
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
) -> Iterator[GenerationResponse]:
    """Generate for one prompt, yielding text pieces as they become final."""
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
    for toks in generate_step(model, [prompt_ids], params, max_tokens, prefill_chunk):
        token = int(toks[0])
        if t_first is None:
            t_first = time.perf_counter()
            prompt_tps = len(prompt_ids) / max(t_first - t0, 1e-9)
        n += 1
        if token in eos:
            finish = "stop"
            detok.flush()
        else:
            detok.add(token)
            if n == max_tokens:
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
        )
        if finish:
            return


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
        for step in generate_step(
            model, [prompts[i] for i in idx], params, max_tokens, prefill_chunk
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
            if all(reason):
                break
        for b, i in enumerate(idx):
            text, _ = _finish(tokenizer, toks[b], stops)
            results[i] = BatchResult(text, toks[b], reason[b] or "length", len(toks[b]) + ended[b])
    return results
