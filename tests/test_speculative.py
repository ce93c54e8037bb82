"""Speculative decoding: greedy output equals the target's own, token for token, whatever
the draft (a random model that is mostly wrong, the model itself, prompt lookup), on
PyTorch and MLX; the sampling rule keeps the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest

import mlxrun
from mlxrun.cli import main
from mlxrun.errors import MlxrunError
from mlxrun.generate import stream
from mlxrun.sampling import SamplingParams
from mlxrun.speculative import ModelDraft, NgramDraft, accept, lookup

from .conftest import SMOLLM2, TINY, write_random

# (imported at collection: without a GPU it turns the Triton interpreter on before anything
# imports triton)
from .test_engine import HAS_CUDA, _interpreted_kernels

BACKENDS = ["cpu", "mlx"]


def test_lookup_takes_the_latest_longest_match():
    seq = np.array([5, 6, 7, 1, 2, 5, 6, 9, 4, 8, 5, 6])
    # "5 6" occurs at 0 and 5; the latest (5) is followed by 9 4 8
    assert lookup(seq, 3, 3, 1) == [9, 4, 8]
    assert lookup(seq, 10, 3, 1) == [9, 4, 8, 5, 6]
    assert lookup(np.array([1, 2, 3, 4]), 4, 3, 1) == []
    # the longer match wins over a later shorter one: "7 1 2" -> 3, not "2" -> 8
    assert lookup(np.array([7, 1, 2, 3, 2, 8, 7, 1, 2]), 1, 3, 1) == [3]


@pytest.mark.parametrize("one_hot", [False, True])
def test_accept_rule_keeps_the_target_distribution(one_hot):
    """The first emitted token is distributed as p[0] whatever q drafted it, and the
    second (after a kept first draft) as p[1]."""
    rng = np.random.default_rng(0)
    V, n = 6, 10000
    p = rng.dirichlet(np.ones(V), size=3)
    q = rng.dirichlet(np.ones(V), size=2)
    if one_hot:  # a deterministic draft: the likeliest tokens, so the first is often kept
        drafts = np.tile(p[:2].argmax(-1), (n, 1))
    else:
        drafts = np.stack([rng.choice(V, size=n, p=q[i]) for i in range(2)], axis=1)
    counts = np.zeros((2, V))
    for d in drafts.tolist():
        out = accept(d, None if one_hot else q, p, rng)
        counts[0, out[0]] += 1
        if len(out) > 1:
            counts[1, out[1]] += 1
    for i in range(2):
        m = counts[i].sum()
        tv = np.abs(counts[i] / m - p[i]).sum() / 2
        # about sqrt(V / m) / 3 by chance; drafts kept without the rule are off by > 0.2
        assert m > 1000 and tv < 1.2 * np.sqrt(V / m), (i, tv, m)


def _tokens(m, ids, params, n, draft=None):
    """The tokens `m` (an mlxrun.Model) generates for token ids, greedy or sampled."""
    return [r.token for r in stream(m.transformer, m.tokenizer, ids, params, n, draft=draft)]


def _pair(root, backend: str):
    """A tiny random target and a different random draft of the same vocabulary."""
    kw = dict(TINY["llama_gqa_tied"])
    mt = kw.pop("model_type")
    t_dir, _ = write_random(root / "target", mt, kw, seed=1)
    d_dir, _ = write_random(root / "draft", mt, dict(kw, num_hidden_layers=1), seed=2)
    load = dict(backend=backend, dtype="float32", progress=False)
    return mlxrun.load(str(t_dir), **load), mlxrun.load(str(d_dir), **load)


@pytest.fixture(scope="module", params=BACKENDS)
def tiny_pair(request, tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("spec"), request.param)


def test_tiny_greedy_equals_plain_decode(tiny_pair):
    t, d = tiny_pair
    ids = [1, 5, 9, 14, 5, 9, 20, 33, 5, 9]
    want = _tokens(t, ids, SamplingParams(), 40)
    for draft in (ModelDraft(d.transformer, 3), ModelDraft(t.transformer, 5), NgramDraft(4)):
        got = _tokens(t, ids, SamplingParams(), 40, draft)
        assert got == want, draft.kind
        st = draft.stats
        assert st.drafted > 0 and 0 <= st.accepted <= st.drafted
        if draft.kind == "model" and draft.model is t.transformer:
            assert st.accepted == st.drafted  # the model drafting itself is always right
    # a sampled run whose kept set is the top token alone is greedy decoding again
    top1 = SamplingParams(temperature=0.9, top_k=1, seed=3)
    for draft in (ModelDraft(d.transformer, 3), NgramDraft(4)):
        assert _tokens(t, ids, top1, 40, draft) == want


def test_self_draft_sampling_keeps_every_draft(tiny_pair):
    """With q == p the rule accepts every draft (u * q < p for u < 1)."""
    t, _ = tiny_pair
    draft = ModelDraft(t.transformer, 4)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    out = _tokens(t, [1, 7, 8, 9], p, 20, draft)
    assert len(out) == 20 and all(0 <= x < 96 for x in out)
    assert draft.stats.accepted == draft.stats.drafted > 0


def test_refusals(tiny_pair, tmp_path):
    t, _ = tiny_pair
    kw = dict(TINY["llama_gqa_tied"], vocab_size=128)
    mt = kw.pop("model_type")
    other, _ = write_random(tmp_path / "other", mt, kw)
    with pytest.raises(MlxrunError, match="another tokenizer"):
        t.generate([1, 5], 4, draft_model=str(other))
    with pytest.raises(MlxrunError, match="repetition_penalty is not supported with a draft"):
        t.generate([1, 5], 4, draft="ngram", repetition_penalty=1.2)
    with pytest.raises(MlxrunError, match="one prompt at a time"):
        t.generate([[1, 5], [1, 6]], 4, draft="ngram")
    with pytest.raises(MlxrunError, match="num_draft must be at least 1"):
        t.generate([1, 5], 4, draft="ngram", num_draft=0)


@pytest.fixture(scope="module")
def smollm2():
    # PyTorch only: MLX is checked on the tiny pair above; SmolLM2 on MLX's CPU runs its
    # verify passes several times slower than here, minutes for this test (checked by hand:
    # equal output, ngram and self-draft)
    return mlxrun.load(SMOLLM2, backend="cpu", progress=False, fastest=True)


def test_smollm2_greedy_equals_plain_decode(smollm2):
    m = smollm2
    prompt = "Repeat this text exactly: " + "The quick brown fox jumps over the lazy dog. " * 2
    want = m.generate(prompt, 16)
    draft = NgramDraft()
    assert m.generate(prompt, 16, draft=draft) == want
    assert draft.stats.accepted > 0  # the answer copies the prompt: lookup drafts are kept
    own = ModelDraft(m.transformer, 2)  # the model drafting itself: every draft kept
    assert m.generate(prompt, 6, draft=own) == m.generate(prompt, 6)
    assert own.stats.accepted == own.stats.drafted > 0


def test_cli_speculative_prints_the_same_text(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    args = ["generate", "-m", str(d), "-b", "cpu", "-p", "w5 w9 w14 w5 w9", "--max-tokens", "12"]

    def run(*extra):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main([*args, *extra])
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    _, plain, _ = run()
    code, spec, err = run("--draft", "ngram", "--num-draft", "3")
    assert code == 0 and spec == plain and spec.strip(), err
    assert "Draft: ngram, 3 a pass;" in err
    code, _, err = run("--draft-model", str(d))  # the model drafting itself
    assert code == 0 and "(100.0%)" in err, err
    code, _, err = run("--draft", "ngram", "--draft-model", str(d))
    assert (
        code == 1 and err.strip() == "mlxrun: error: give --draft-model or --draft ngram, not both"
    )


def test_bench_rows(tiny_dir):
    from mlxrun.bench_spec import format_spec, run_spec_bench

    d, _ = tiny_dir("llama_gqa_tied")
    (real,) = run_spec_bench(str(d), ["cpu"], ["stored"], "ngram", None, 3, 24, 8, 1)
    assert real.same_tokens and 0 <= real.acceptance <= 1 and real.k == 3
    assert 1 <= real.tokens_per_pass <= 4 and real.spec_tps > 0 and real.plain_tps > 0
    (shape,) = run_spec_bench("shape:tiny", ["cpu"], ["none"], None, "shape:tiny", 2, 16, 4, 1)
    assert shape.draft == "model" and shape.verify_ms > 0 and shape.draft_step_ms > 0
    assert shape.captured is False and shape.eager_verify_ms > 0 and shape.eager_draft_ms > 0
    assert "verify of 3 tokens" in format_spec([shape]) and "eager" in format_spec([shape])
    cost = (shape.verify_ms + 2 * shape.draft_step_ms) / 1e3
    assert shape.projected_tps["0.5"] == pytest.approx((1 + 0.5 + 0.25) / cost)
    assert "same tokens: yes" in format_spec([real])


# The fixed-shape passes (backends/spec_graph.py): captured CUDA graphs on a GPU; on the CPU
# the same steps run as they are, through the plain torch ops (`spec_rows`) or, with
# `triton_kernels`, through the CUDA path's Triton kernels under the interpreter.
PROMPT = [1, 5, 9, 14, 5, 9, 20, 33, 5, 9]


def _drafts(t, d):
    """k = 4: a random draft (mostly rejected), the model drafting itself (every draft kept,
    so the catch-up feeds two tokens), prompt lookup (drafts shorter than k: padded)."""
    return [ModelDraft(d.transformer, 4), ModelDraft(t.transformer, 4), NgramDraft(4)]


def _steps(t, params, n, draft):
    """The tokens of speculative_step itself: all n of them (`stream` stops at an EOS)."""
    from mlxrun.speculative import generate_step

    return [int(x[0]) for x in generate_step(t.transformer, PROMPT, params, n, draft)]


def _check_fixed_greedy(t, d, n):
    want = _tokens(t, PROMPT, SamplingParams(), n)
    for draft in _drafts(t, d):
        assert _tokens(t, PROMPT, SamplingParams(), n, draft) == want, draft.kind
        st = draft.stats
        assert st.drafted > 0 and 0 <= st.accepted <= st.drafted
        if draft.kind == "model":
            assert draft.passes.fixed is not None and {1, 2} <= set(draft.passes.fixed.steps)
    assert draft.stats.accepted < draft.stats.drafted  # some lookups rejected: rolled back
    held = [p for p in t.backend._spec if p.model is t.transformer]
    assert held and all(5 in p.steps and not p.busy for p in held)
    return want


@pytest.fixture(scope="module")
def fixed_cpu_pair(tmp_path_factory):
    t, d = _pair(tmp_path_factory.mktemp("fixed"), "cpu")
    t.backend.spec_rows = d.backend.spec_rows = True
    return t, d


def test_fixed_passes_greedy_equals_plain_decode(fixed_cpu_pair):
    t, d = fixed_cpu_pair
    want = _check_fixed_greedy(t, d, 40)
    top1 = SamplingParams(temperature=0.9, top_k=1, seed=3)  # the sampled path, greedy again
    assert _tokens(t, PROMPT, top1, 40, ModelDraft(d.transformer, 4)) == want
    draft = ModelDraft(d.transformer, 4)
    out = _steps(t, SamplingParams(temperature=1.0, seed=5), 40, draft)
    st = draft.stats
    assert len(out) == 40 == 1 + st.accepted + st.passes  # the prefill's, kept drafts + 1 a pass


def test_fixed_passes_roll_back(fixed_cpu_pair):
    """A pass of 5 tokens writes keys at all 5 positions; the next pass starts after the
    kept ones and sees only what it overwrote, not the rejected drafts' keys. Its logits
    equal a forward pass over the kept sequence alone (padded rows included)."""
    from mlxrun.speculative import Passes

    t, _ = fixed_cpu_pair
    m, be = t.transformer, t.backend
    run = Passes(m, 40, (5,))
    try:
        assert run.fixed is not None
        run.prefill(PROMPT)
        L = len(PROMPT)
        a = be.to_numpy(run([7, 8, 9, 10, 11], L)[0])
        b, best, ok = run([7, 30, 31], L + 1)  # 7 kept at L, the rest rejected; 2 padded
        b, best = be.to_numpy(b), be.to_numpy(best)
    finally:
        run.close()
    ref_a = t.logits(PROMPT + [7, 8, 9, 10, 11])[L:]
    ref_b = t.logits(PROMPT + [7, 7, 30, 31])[L + 1 :]
    assert np.abs(a - ref_a).max() < 1e-4 and np.abs(b - ref_b).max() < 1e-4
    assert best.tolist() == ref_b.argmax(-1).tolist() and be.to_numpy(ok).all()


@pytest.mark.long  # minutes on 2 cores
def test_fixed_passes_under_triton_kernels(tmp_path_factory):
    """The CUDA path's kernels (rope_qkv and decode_attention by rows, argmax) on the CPU,
    interpreted, uncaptured."""
    if HAS_CUDA or not _interpreted_kernels():
        pytest.skip("on a GPU the captured tests below run these kernels")
    t, d = _pair(tmp_path_factory.mktemp("triton"), "cpu")
    t.backend.triton_kernels = d.backend.triton_kernels = True
    _check_fixed_greedy(t, d, 24)


@pytest.fixture(scope="module")
def cuda_pair(tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("cuda"), "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_cuda_captured_greedy_equals_plain_decode(cuda_pair):
    t, d = cuda_pair
    want = _check_fixed_greedy(t, d, 40)
    assert all(p.capture and p.steps[5].graph is not None for p in t.backend._spec)
    draft = ModelDraft(d.transformer, 4)
    top1 = SamplingParams(temperature=0.9, top_k=1, seed=3)
    assert _tokens(t, PROMPT, top1, 40, draft) == want
    assert draft.passes.captured
    # the next generation replays the same graphs (none captured anew)
    graphs = {id(s.graph) for p in t.backend._spec for s in p.steps.values()}
    assert _tokens(t, PROMPT, SamplingParams(), 40, NgramDraft(4)) == want
    assert graphs == {id(s.graph) for p in t.backend._spec for s in p.steps.values()}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_cuda_captured_sampling(cuda_pair):
    """Sampled runs through the captured passes: a random draft's q and the target's p
    (its logits read back from the graph's buffer) drive the rule; drafting itself, q == p
    and every draft is kept."""
    t, d = cuda_pair
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    draft = ModelDraft(d.transformer, 4)
    out = _steps(t, p, 40, draft)
    st = draft.stats
    assert len(out) == 40 and all(0 <= x < 96 for x in out)
    assert st.passes > 0 and st.drafted <= 4 * st.passes and 0 <= st.accepted <= st.drafted
    assert len(out) == 1 + st.accepted + st.passes  # the prefill's, then kept drafts + 1 a pass
    assert _steps(t, p, 40, ModelDraft(d.transformer, 4)) == out  # seeded: the same
    own = ModelDraft(t.transformer, 4)
    _steps(t, p, 20, own)
    # q == p up to the rounding of a 1-row pass against a 5-row one
    assert own.stats.accepted >= own.stats.drafted - 1 > 0
