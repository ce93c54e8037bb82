"""`mlxrun bench --draft ngram | --draft-model M`: what speculative decoding gains, each
backend and format against plain decode in the same run.

Real weights: greedy decode of a copy-heavy prompt (repeat a passage of the bundled text),
plain and speculative, timed from the first generated token to the last: effective tok/s,
acceptance (drafts kept / drafted) and whether the tokens are the same.

Random weights (`shape:NAME`): acceptance means nothing, so this measures what a verify
costs: one target pass over k+1 tokens as speculative decoding runs it (a captured graph on
CUDA, eager elsewhere) and, for comparison, eagerly, against one plain decode step (captured
on CUDA); the draft's step as it runs (k steps chained, as a draft proposes) and eagerly,
where there is a draft model; and from them the tok/s to expect at a given acceptance rate
a: tokens per pass (1 - a^(k+1)) / (1 - a), time per pass verify + k x draft step.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .bench import SHAPE_PREFIX, _quant_specs, build_random, shape_config
from .bench_report import _atomic_write
from .errors import MlxrunError
from .generate import generate_step
from .sampling import SamplingParams
from .speculative import Passes
from .speculative import generate_step as speculative_step

ACCEPTANCE = (0.5, 0.7, 0.9)  # rates the random-weight rows project tok/s at


@dataclass
class SpecRow:
    backend: str
    quant: str
    draft: str
    k: int
    plain_tps: float  # plain decode, tokens/s (batch 1)
    # real weights
    spec_tps: float | None = None  # speculative, effective tokens/s
    acceptance: float | None = None
    tokens_per_pass: float | None = None
    same_tokens: bool | None = None
    # random weights
    step_ms: float | None = None  # one plain decode step
    verify_ms: float | None = None  # one target pass over k+1 tokens, as speculative runs it
    eager_step_ms: float | None = None  # one target forward of 1 token, eager
    draft_step_ms: float | None = None  # one draft step as it runs (model drafts)
    projected_tps: dict = field(default_factory=dict)  # acceptance -> tok/s
    captured: bool | None = None  # whether the verify and draft passes replay CUDA graphs
    eager_verify_ms: float | None = None  # the target's forward over k+1 tokens, eager
    eager_draft_ms: float | None = None  # one draft step, eager


def _backend(name: str, dtype: str | None):
    from mlxrun.backends import get_backend  # noqa: PLC0415

    return get_backend(name, dtype)


def _timed_tokens(steps) -> tuple[list[int], float]:
    """(tokens, decode tok/s from the first token to the last) of a step generator."""
    toks, times = [], []
    for t in steps:
        toks.append(int(np.asarray(t).reshape(-1)[0]))
        times.append(time.perf_counter())
    return toks, (len(times) - 1) / max(times[-1] - times[0], 1e-9)


def copy_prompt(tokenizer, prompt_tokens: int) -> list[int]:
    """A chat prompt asking to repeat about `prompt_tokens` tokens of the bundled text."""
    from .evaluate import eval_text  # noqa: PLC0415

    ids = tokenizer.encode(eval_text(None), add_special_tokens=False)[:prompt_tokens]
    passage = tokenizer.decode(ids)
    return tokenizer.prompt_ids("Repeat the following text word for word:\n\n" + passage)


def _real_rows(model, be_name, quant, draft, draft_model, k, prompt_tokens, gen, reps, dtype):
    import mlxrun  # noqa: PLC0415

    m = mlxrun.load(model, backend=be_name, dtype=dtype, quant=quant, progress=False, fastest=True)
    d = m.drafter(draft, draft_model, k)
    ids = copy_prompt(m.tokenizer, prompt_tokens)
    greedy = SamplingParams()
    t = m.transformer
    plain, spec, acc, per = [], [], [], []
    same = True
    for r in range(reps + 1):  # the first of each is a warm-up
        want, tps = _timed_tokens(generate_step(t, [ids], greedy, gen))
        got, stps = _timed_tokens(speculative_step(t, ids, greedy, gen, d))
        same &= got == want
        if r:
            plain.append(tps)
            spec.append(stps)
            acc.append(d.stats.acceptance)
            per.append(len(got) / max(d.stats.passes, 1))
    return SpecRow(
        be_name, quant or "stored", d.kind, d.k, statistics.median(plain),
        spec_tps=statistics.median(spec), acceptance=statistics.median(acc),
        tokens_per_pass=statistics.median(per), same_tokens=same,
    )  # fmt: skip


def _forward_ms(be, model, cache, offset: int, n: int, reps: int) -> float:
    """Median ms of one eager forward of n tokens on `cache` at `offset`."""
    ids = be.ids(np.ones((1, n), dtype=np.int64))
    times = []
    for r in range(reps + 2):
        cache.offset = offset
        be.synchronize()
        t0 = time.perf_counter()
        be.to_numpy(be.argmax(model(ids, cache, None)[0]))
        be.synchronize()
        if r >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _pass_ms(be, passes, offset: int, n: int, chain: int, reps: int) -> float:
    """Median ms of one of `passes`' passes of n tokens at `offset`: a pass from host
    tokens and `chain` - 1 more fed the previous one's last argmax on the device (a
    draft's steps), then its tokens read back, over `chain`."""
    times = []
    for r in range(reps + 2):
        be.synchronize()
        t0 = time.perf_counter()
        _, best, _ = passes([1] * n, offset)
        out = [best]
        for j in range(1, chain):
            _, best, _ = passes(best[-1:], offset + j)
            out.append(best)
        for b in out:
            be.to_numpy(b)
        be.synchronize()
        if r >= 2:
            times.append((time.perf_counter() - t0) * 1e3 / chain)
    return statistics.median(times)


def _shape_rows(model, be_name, quant, spec, draft, draft_model, k, prompt_tokens, gen, reps,
                dtype):  # fmt: skip
    be = _backend(be_name, dtype)
    target = build_random(shape_config(model), be, spec, seed=0)
    small = None
    if draft_model is not None:
        if not draft_model.startswith(SHAPE_PREFIX):
            raise MlxrunError("with a shape: model, --draft-model takes a shape too")
        small = build_random(shape_config(draft_model), be, spec, seed=1)
    V = target.config.vocab_size
    if small is not None and small.config.vocab_size != V:
        raise MlxrunError(f"--draft-model {draft_model} has another vocabulary than {model}")
    prompt = [np.random.default_rng(0).integers(0, min(V, 1000), prompt_tokens).tolist()]
    greedy = SamplingParams()
    tps = statistics.median(
        _timed_tokens(generate_step(target, prompt, greedy, gen))[1] for _ in range(reps)
    )
    cache = target.make_cache(1, prompt_tokens + k + 2)
    be.to_numpy(target(be.ids(np.asarray(prompt)), cache, None, True))
    eager_verify = _forward_ms(be, target, cache, prompt_tokens, k + 1, reps)
    one = _forward_ms(be, target, cache, prompt_tokens, 1, reps)
    del cache
    run = Passes(target, prompt_tokens + k + 2, (k + 1,))
    try:
        run.prefill(prompt[0])
        verify = _pass_ms(be, run, prompt_tokens, k + 1, 1, reps)
        captured = run.captured
    finally:
        run.close()
    draft_ms = eager_draft = None
    if small is not None:
        dc = small.make_cache(1, prompt_tokens + 2)
        be.to_numpy(small(be.ids(np.asarray(prompt)), dc, None, True))
        eager_draft = _forward_ms(be, small, dc, prompt_tokens, 1, reps)
        del dc
        steps = Passes(small, prompt_tokens + k + 2, (1, 2))
        try:
            steps.prefill(prompt[0])
            draft_ms = _pass_ms(be, steps, prompt_tokens, 1, k, reps)
        finally:
            steps.close()
    step = 1e3 / tps
    proj = {}
    for a in ACCEPTANCE:
        per_pass = (1 - a ** (k + 1)) / (1 - a)
        proj[str(a)] = per_pass / ((verify + k * (draft_ms or 0.0)) / 1e3)
    return SpecRow(
        be_name, quant, "model" if small is not None else "ngram", k, tps, step_ms=step,
        verify_ms=verify, eager_step_ms=one, draft_step_ms=draft_ms, projected_tps=proj,
        captured=captured, eager_verify_ms=eager_verify, eager_draft_ms=eager_draft,
    )  # fmt: skip


def run_spec_bench(
    model: str,
    backends: list[str],
    quants: list[str],
    draft: str | None,
    draft_model: str | None,
    num_draft: int | None,
    prompt_tokens: int = 512,
    gen_tokens: int = 128,
    reps: int = 3,
    dtype: str | None = None,
    json_path: str | None = None,
) -> list[SpecRow]:
    """Rows of `SpecRow`, one per backend and format (see the module's docstring)."""
    from .speculative import DEFAULT_K  # noqa: PLC0415

    if draft_model is not None and draft is not None:
        raise MlxrunError("give --draft-model or --draft ngram, not both")
    k = num_draft or DEFAULT_K["model" if draft_model is not None else "ngram"]
    if k < 1:
        raise MlxrunError(f"--num-draft must be at least 1, got {k}")
    shape = model.startswith(SHAPE_PREFIX)
    # real weights: each format as `load` takes it, "stored" for the checkpoint as it is
    specs = _quant_specs(quants) if shape else {q: None for q in quants}
    common = (draft, draft_model, k, prompt_tokens, gen_tokens, reps, dtype)
    rows = []
    for be_name in backends:
        for q, spec in specs.items():
            if shape:
                rows.append(_shape_rows(model, be_name, q, spec, *common))
            else:
                rows.append(_real_rows(model, be_name, None if q == "stored" else q, *common))
    if json_path is not None:
        text = json.dumps({"model": model, "draft_model": draft_model, "draft": draft,
                           "rows": [asdict(r) for r in rows]}, indent=2)  # fmt: skip
        _atomic_write(json_path, lambda f: f.write(text.encode() + b"\n"))
    return rows


def format_spec(rows: list[SpecRow]) -> str:
    lines = []
    for r in rows:
        head = f"{r.backend:5} {r.quant:9} {r.draft} k={r.k}: plain {r.plain_tps:.1f} tok/s"
        if r.spec_tps is not None:
            lines.append(
                f"{head}, speculative {r.spec_tps:.1f} tok/s ({r.spec_tps / r.plain_tps:.2f}x), "
                f"acceptance {100 * r.acceptance:.1f}%, {r.tokens_per_pass:.2f} tokens a pass, "
                f"same tokens: {'yes' if r.same_tokens else 'NO'}"
            )
        else:
            how = "captured" if r.captured else "eager"
            drafted = ""
            if r.draft_step_ms:
                drafted = f", draft step {r.draft_step_ms:.2f} ms {how}"
                if r.captured:
                    drafted += f" (eager {r.eager_draft_ms:.2f} ms)"
            eager = f"eager {r.eager_verify_ms:.2f} ms, " if r.captured else ""
            proj = ", ".join(f"a={a}: {v:.1f}" for a, v in r.projected_tps.items())
            lines.append(
                f"{head} ({r.step_ms:.2f} ms a step); verify of {r.k + 1} tokens "
                f"{r.verify_ms:.2f} ms {how} ({r.verify_ms / r.step_ms:.2f} steps; {eager}"
                f"eager 1-token {r.eager_step_ms:.2f} ms, "
                f"{(r.eager_verify_ms - r.eager_step_ms) / r.k:.3f} ms a drafted token eager)"
                f"{drafted}; projected tok/s {proj}"
            )
    return "\n".join(lines)
