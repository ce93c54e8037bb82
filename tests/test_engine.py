"""The serving engine on tiny random models, in process, on torch-cpu and MLX and through
the fixed-shape decode steps of the CUDA code path (slot_graph.py: captured graphs on a GPU,
the same steps run by the Triton interpreter elsewhere): greedy tokens equal
`generate_step`'s whatever the batch-mates, the prefix cache, cancellation, seeds, logprobs,
the queue limit, and a request whose logits turn NaN failing alone."""

from __future__ import annotations

import importlib
import os
import queue
import threading

import numpy as np
import pytest

import mlxrun
from mlxrun.engine import Engine, QueueFull, Request
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:
    torch, HAS_CUDA = None, False
if not HAS_CUDA:
    # before anything imports triton (transformers does, building the tiny checkpoints):
    # its own library functions (tl.sum) must be interpreted too
    os.environ["TRITON_INTERPRET"] = "1"


def _interpreted_kernels() -> bool:
    """The CUDA path's Triton kernels on this CPU: decorated by the interpreter."""
    try:
        import mlxrun.backends.cuda_attention as attn
        import mlxrun.backends.cuda_ops as ops
        import mlxrun.backends.cuda_rope as rope
        import mlxrun.backends.cuda_sampling as smp
        import mlxrun.quant.triton_decode as dec
        import mlxrun.quant.triton_gemm as gemm
        import mlxrun.quant.triton_gemv as gemv
        import mlxrun.quant.triton_gemv_step as step
        import mlxrun.quant.triton_kernels as tk
    except ImportError:  # no triton
        return False
    # the kernel modules before triton_kernels, which re-binds their kernels
    kernels = ((dec, "_group_scale"), (step, "_gemv_step"), (gemv, "_gemv_kernel"),
               (gemm, "_gemm_kernel"), (tk, "_gemv_kernel"))  # fmt: skip
    more = ((ops, "_add_rms_norm_kernel"), (rope, "_rope_qkv_kernel"), (attn, "_rope_qkv_kernel"),
            (smp, "_draw_kernel"))  # fmt: skip
    for mod, fn in (*kernels, *more):
        if type(getattr(mod, fn)).__name__ != "InterpretedFunction":
            importlib.reload(mod)  # imported earlier without the interpreter
    return True


def load_fixed(d):
    """The tiny model on the CUDA code path with the engine's fixed-shape steps: captured on
    a GPU; on a CPU, torch with the Triton kernels on, interpreted, and no capture."""
    if HAS_CUDA:
        return mlxrun.load(str(d), backend="cuda", dtype="float32", progress=False)
    if torch is None or not _interpreted_kernels():
        pytest.skip("needs torch and triton")
    m = mlxrun.load(str(d), backend="cpu", progress=False)
    m.transformer.be.triton_kernels = True  # dense float32 weights: nothing to repack
    return m


# Every engine test on the fixed-shape steps too: seconds on a GPU; minutes under the
# Triton interpreter on 2 cores (`pytest -m long`; test_fixed_steps below is CI's share).
FIXED = pytest.param("fixed", marks=pytest.mark.cuda if HAS_CUDA else pytest.mark.long)


@pytest.fixture(scope="module", params=["cpu", "mlx", FIXED])
def tiny(request, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    if request.param == "fixed":
        return load_fixed(d)
    return mlxrun.load(str(d), backend=request.param, progress=False)


def reference(m, prompt, n, params=None):
    """Greedy tokens of `prompt` alone through generate_step, cut after the first EOS."""
    out = []
    for t in generate_step(m.transformer, [prompt], params or SamplingParams(), n):
        out.append(int(t[0]))
        if out[-1] in m.tokenizer.eos_token_ids:
            break
    return out


def run_all(eng, reqs, timeout=600):
    """Submit every request at once; wait for all to finish. -> per request: its events.
    (The fixed-shape steps under the Triton interpreter take minutes on a loaded 2-core CPU:
    test_continuous_batching_matches_generate[fixed], -m long, 213 s.)"""
    got = {r.id: [] for r in reqs}
    done = threading.Semaphore(0)

    def on(rid):
        def f(ev):
            got[rid].append(ev)
            if ev.finish_reason:
                done.release()

        return f

    for r in reqs:
        r.on_event = on(r.id)
        eng.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=timeout)
    return [got[r.id] for r in reqs]


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 96, n)] for n in lengths]


def test_continuous_batching_matches_generate(tiny):
    """7 prompts of 2-40 tokens through 3 slots in chunks of 8: requests join and leave the
    running batch mid-way, yet each gets exactly its own greedy tokens."""
    ps = prompts(0, (5, 17, 9, 40, 2, 12, 23))
    eng = Engine(tiny.transformer, tiny.tokenizer, max_batch=3, context=64, prefill_chunk=8)
    try:
        outs = run_all(eng, [Request(p, max_tokens=10) for p in ps])
        for p, evs in zip(ps, outs):
            assert [e.token for e in evs] == reference(tiny, p, 10)
            assert evs[-1].finish_reason in ("stop", "length")
            assert evs[-1].completion_tokens == len(evs)
        h = eng.health()
        assert (h["running"], h["waiting"], h["finished"]) == (0, 0, len(ps))
    finally:
        eng.close()


def test_prefix_cache_reuses_and_matches(tiny):
    """A follow-up that extends a finished request's prompt reuses its slot's keys and values
    (a chat's next turn); one that shares a running request's prefix copies them. Both still
    give generate_step's tokens."""
    base = prompts(1, (20,))[0]
    eng = Engine(tiny.transformer, tiny.tokenizer, max_batch=2, context=96, prefill_chunk=8)
    try:
        (first,) = run_all(eng, [Request(base, max_tokens=6)])
        assert first[-1].cached_tokens == 0
        turn2 = base + [e.token for e in first] + [7, 8, 9]
        (second,) = run_all(eng, [Request(turn2, max_tokens=6)])
        # the slot holds base + all generated tokens but the last (never fed back), or the
        # last too where the fixed steps launched the step after it before reading it
        n = len(base) + len(first)
        assert second[-1].cached_tokens in ((n - 1, n) if eng.graphs else (n - 1,))
        assert [e.token for e in second] == reference(tiny, turn2, 6)
        # a long request keeps running while a second one with the same 20-token head comes
        a, b = base + [11] * 4, base + [12, 13]
        outs = run_all(eng, [Request(a, max_tokens=30), Request(b, max_tokens=5)])
        assert outs[1][-1].cached_tokens >= len(base)
        assert [e.token for e in outs[1]] == reference(tiny, b, 5)
        assert [e.token for e in outs[0]] == reference(tiny, a, 30)
        h = eng.health()
        assert h["prefix_hits"] >= 3 and h["prefix_tokens_reused"] >= 3 * len(base)
    finally:
        eng.close()


def test_first_token_phases(tiny):
    """Every request's way to its first token is stamped: a cold prompt prefills in chunks
    of 8, a follow-up with its 19-token head cached prefills only its 5-token tail; the
    phases are in order and /health shows the latest."""
    base = prompts(2, (20,))[0]
    eng = Engine(tiny.transformer, tiny.tokenizer, max_batch=2, context=64, prefill_chunk=8)
    try:
        cold, warm = Request(base, max_tokens=2), Request(base[:19] + [5, 6, 7, 8, 9], max_tokens=2)
        run_all(eng, [cold])
        run_all(eng, [warm])
        for r, cached, chunks in ((cold, 0, [8, 8, 4]), (warm, 19, [5])):
            ph = r.phases
            b = ph.breakdown()
            assert (b["prompt_tokens"], b["cached_tokens"], b["chunks"]) == (
                len(r.prompt), cached, chunks)  # fmt: skip
            stamps = [ph.submitted, ph.admitted, ph.placed, *(t for _, t, _ in ph.chunks),
                      ph.first_token, ph.first_event]  # fmt: skip
            assert stamps == sorted(stamps)
            assert all(b[k] >= 0 for k in ("queue_wait", "place", "prefill_queue", "device"))
        assert eng.health()["last_first_token_ms"] == warm.phases.breakdown()
    finally:
        eng.close()


def test_cancel_frees_the_slot_and_others_go_on(tiny):
    """A request cancelled mid-stream leaves at the next step; a waiting one takes its slot
    and still gets its own tokens."""
    p1, p2 = prompts(2, (6, 9))
    eng = Engine(tiny.transformer, tiny.tokenizer, max_batch=1, context=128, prefix_cache=False)
    try:
        events = eng.stream(Request(p1, max_tokens=100))
        next(events), next(events)
        other: queue.Queue = queue.Queue()
        eng.submit(Request(p2, max_tokens=8, on_event=other.put))
        events.close()  # the consumer goes away: cancels
        got = []
        while not got or not got[-1].finish_reason:
            got.append(other.get(timeout=60))
        assert [e.token for e in got] == reference(tiny, p2, 8)
        h = eng.health()
        assert (h["running"], h["cancelled"]) == (0, 1)
    finally:
        eng.close()


def test_seeded_sampling_ignores_batch_mates(tiny):
    """One sampler per request: a seed gives the same tokens alone or among other requests."""
    p, q, r = prompts(3, (7, 11, 4))
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    eng = Engine(tiny.transformer, tiny.tokenizer, max_batch=3, context=64, prefix_cache=False)
    try:
        (alone,) = run_all(eng, [Request(p, params, max_tokens=12)])
        mates = run_all(
            eng,
            [
                Request(q, SamplingParams(temperature=1.0, seed=1), max_tokens=12),
                Request(p, params, max_tokens=12),
                Request(r, max_tokens=12),
            ],
        )
        assert [e.token for e in mates[1]] == [e.token for e in alone]
    finally:
        eng.close()


def test_logprobs_are_the_models_log_softmax(tiny):
    """Chosen-token and top-k logprobs equal log_softmax of Model.logits on the same ids."""
    (p,) = prompts(4, (9,))
    eng = Engine(tiny.transformer, tiny.tokenizer, max_batch=2, context=64)
    try:
        (evs,) = run_all(eng, [Request(p, max_tokens=3, logprobs=3)])
    finally:
        eng.close()
    seq = list(p)
    for ev in evs:
        x = tiny.logits(seq)[-1].astype(np.float64)
        lsm = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        assert ev.token == int(np.argmax(x))
        assert ev.logprob.logprob == pytest.approx(lsm[ev.token], abs=1e-4)
        top = np.argsort(-lsm)[:3]
        assert [t for t, _ in ev.logprob.top] == top.tolist()
        seq.append(ev.token)


def test_queue_limit_and_bad_requests(tiny):
    eng = Engine(tiny.transformer, tiny.tokenizer, max_batch=1, context=32, max_queue=0)
    try:
        with pytest.raises(QueueFull, match="max-queue"):
            eng.submit(Request([5, 6], max_tokens=2))
        with pytest.raises(mlxrun.MlxrunError, match="exceeds the context of 32"):
            eng.check(Request([5] * 30, max_tokens=3))
        with pytest.raises(mlxrun.MlxrunError, match="max_tokens must be at least 1"):
            eng.check(Request([5], max_tokens=0))
    finally:
        eng.close()


def test_fixed_steps_pad_rows_and_match_generate(tiny_dir):
    """CI's share of the fixed-shape steps (every test above runs on them with -m long):
    three requests of different lengths in 5 slots decode in the bucket of 4, a dummy row
    beside them, one row sampled with a seed; each gets what it gets alone on the plain
    CPU path (generate_step's greedy tokens; the seeded row's own draw). Last prefill chunks
    run as steps too (rows of one slot): the 3- and 5-token prompts whole, the 9-token one
    after an eager chunk of 8, and a follow-up's 2-3-token tail after its cached 12-13 tokens,
    whose logprobs are the eager path's."""
    d, _ = tiny_dir("llama_gqa_tied")
    fixed, plain = load_fixed(d), mlxrun.load(str(d), backend="cpu", progress=False)
    ps = prompts(5, (3, 9, 5))
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=11)
    eng = Engine(fixed.transformer, fixed.tokenizer, max_batch=5, context=32, prefill_chunk=8)
    try:
        reqs = [Request(ps[0], max_tokens=4), Request(ps[1], seeded, max_tokens=4),
                Request(ps[2], max_tokens=4)]  # fmt: skip
        outs = run_all(eng, reqs)
        assert {b for b, _ in eng.graphs.steps} >= {4}  # three rows and a dummy ran
        follow = ps[1] + [e.token for e in outs[1]] + [7, 8]
        reqs.append(Request(follow, max_tokens=4, logprobs=2))
        (tail,) = run_all(eng, reqs[3:])
        # 12 cached, or 13 where the step after the last token was launched before its read
        cached = tail[-1].cached_tokens
        assert cached in (12, 13)
        chunks = [[(n, fixed) for n, _, fixed in r.phases.chunks] for r in reqs]
        assert chunks == [[(3, True)], [(8, False), (1, True)], [(5, True)], [(15 - cached, True)]]
    finally:
        eng.close()
    ref = Engine(plain.transformer, plain.tokenizer, max_batch=1, context=32, prefill_chunk=8)
    try:
        (alone,) = run_all(ref, [Request(ps[1], seeded, max_tokens=4)])
        (eager,) = run_all(ref, [Request(follow, max_tokens=4, logprobs=2)])
    finally:
        ref.close()
    assert [e.token for e in outs[0]] == reference(plain, ps[0], 4)
    assert [e.token for e in outs[1]] == [e.token for e in alone]
    assert [e.token for e in outs[2]] == reference(plain, ps[2], 4)
    assert [e.token for e in tail] == [e.token for e in eager] == reference(plain, follow, 4)
    for g, e in zip(tail, eager):
        assert g.logprob.logprob == pytest.approx(e.logprob.logprob, abs=1e-4)
        assert [t for t, _ in g.logprob.top] == [t for t, _ in e.logprob.top]


def test_a_row_gone_nan_fails_alone(tiny):
    """A request whose logits turn NaN mid-decode (its second token's embedding row is
    poisoned; the tied head keeps the clean one) ends with an error event after the tokens
    it had; its batch-mate gets all of its own tokens; a short request that then takes the
    failed slot beside a long one (whose attention spans the NaN position) is clean too."""
    m, be = tiny.transformer, tiny.transformer.be
    rng = np.random.default_rng(8)
    cands = [[int(t) for t in rng.integers(3, 96, n)] for n in (6, 5, 7, 9, 4, 8, 6, 5) * 3]
    refs = [reference(tiny, p, 6) for p in cands]
    a = next(i for i, r in enumerate(refs) if len(r) == 6 and r[0] != r[1]
             and r[1] not in cands[i])  # fmt: skip
    bad = refs[a][1]
    clean = [i for i in range(len(cands)) if bad not in cands[i] + refs[i] and i != a]
    b = clean[0]
    c = next(i for i in clean[1:] if len(cands[i]) < len(cands[a]))
    d = next(i for i in clean[1:] if i != c and len(cands[i]) + 6 > len(cands[a]) + 2)
    embed = m.embed
    w = be.to_numpy(embed).astype(np.float32)
    w[bad] = np.nan
    m.embed = be.array(w)
    eng = Engine(m, tiny.tokenizer, max_batch=2, context=32, prefix_cache=False)
    try:
        ea, eb = run_all(eng, [Request(cands[a], max_tokens=6), Request(cands[b], max_tokens=6)])
        assert [e.token for e in ea[:-1]] == refs[a][:2]
        assert ea[-1].finish_reason == "error" and "NaN or infinite" in ea[-1].error
        assert "generated token 3" in ea[-1].error
        assert [e.token for e in eb] == refs[b]
        ec, ed = run_all(eng, [Request(cands[c], max_tokens=6), Request(cands[d], max_tokens=6)])
        assert [e.token for e in ec] == refs[c] and [e.token for e in ed] == refs[d]
        h = eng.health()
        assert (h["failed"], h["running"], h["finished"]) == (1, 0, 3)
    finally:
        eng.close()
        m.embed = embed


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("quant", [None, "int4"])
def test_captured_steps_equal_eager_steps(tiny_dir, quant):
    """On a GPU the engine's decode steps replay CUDA graphs per batch-size bucket: greedy
    rows get generate_step's tokens, and every row (greedy, seeded top-p, top-k with a
    repetition penalty, logprobs) gets what the same steps run uncaptured give it."""
    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cuda", dtype="float32", quant=quant, progress=False)
    be = m.transformer.be
    ps = prompts(6, (4, 13, 7, 21, 2))

    def reqs():
        return [
            Request(ps[0], max_tokens=12),
            Request(ps[1], SamplingParams(temperature=0.9, top_p=0.9, seed=3), max_tokens=12),
            Request(ps[2], max_tokens=12, logprobs=2),
            Request(
                ps[3],
                SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.2, seed=4),
                max_tokens=12,
            ),
            Request(ps[4], max_tokens=12),
        ]

    outs = {}
    try:
        for captured in (True, False):
            be.cuda_graphs = captured
            eng = Engine(m.transformer, m.tokenizer, max_batch=3, context=64, prefill_chunk=8)
            try:
                outs[captured] = run_all(eng, reqs())
                steps = eng.graphs.steps.values()
                assert all((s.graph is not None) == captured for s in steps)
            finally:
                eng.close()
    finally:
        be.cuda_graphs = True
    for g, e in zip(outs[True], outs[False]):
        assert [x.token for x in g] == [x.token for x in e]
    for i in (0, 2, 4):
        assert [x.token for x in outs[True][i]] == reference(m, ps[i], 12)
    for g, e in zip(outs[True][2], outs[False][2]):
        assert g.logprob.logprob == pytest.approx(e.logprob.logprob, abs=1e-4)
        assert [t for t, _ in g.logprob.top] == [t for t, _ in e.logprob.top]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("quant", [None, "int4"])
def test_captured_prefill_tails_equal_eager(tiny_dir, quant):
    """On a GPU a prompt's last prefill chunk of up to 64 tokens replays a captured step
    (rows of its slot): follow-ups whose tails of 1-40 tokens come after a cached prefix, and
    short prompts whole, get the tokens and logprobs of the engine run eagerly throughout,
    and generate_step's greedy tokens."""
    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cuda", dtype="float32", quant=quant, progress=False)
    base = prompts(9, (30,))[0]
    tails = [base + t for t in prompts(10, (1, 5, 17, 40))] + prompts(11, (3, 60))
    outs = {}
    for fixed in (True, False):
        eng = Engine(m.transformer, m.tokenizer, max_batch=3, context=128, prefill_chunk=64,
                     fixed_steps=fixed)  # fmt: skip
        try:
            run_all(eng, [Request(base, max_tokens=2)])
            reqs = [Request(p, max_tokens=6, logprobs=3) for p in tails]
            outs[fixed] = [run_all(eng, [r])[0] for r in reqs]  # one by one: the prefix held
            if fixed:
                assert all(r.phases.chunks[-1][2] for r in reqs)
                assert all(r.phases.cached >= 30 for r in reqs[:4])
        finally:
            eng.close()
    for p, g, e in zip(tails, outs[True], outs[False]):
        assert [x.token for x in g] == [x.token for x in e] == reference(m, p, 6)
        for a, b in zip(g, e):
            assert a.logprob.logprob == pytest.approx(
                b.logprob.logprob, abs=2e-3 if quant else 1e-4
            )
