"""Device sampling against the host reference: the same kept set and the same distribution
(chi-square over many seeded rows of fixed logits), per-row options in one batch, seeded
rows independent of their batch-mates, log-probabilities, and sampled decode on a model
through the graph path against the eager one (CUDA)."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from scipy.stats import chi2

import mlxrun
from mlxrun.generate import Step, generate_step
from mlxrun.sampling import HostSampler, SamplingParams, pack, plan_for, uniform_np

try:
    import mlx.core as mx

    from mlxrun.backends.mlx_sampling import MLXSampler
    from mlxrun.backends.mlx_sampling import uniform as mlx_uniform
except ImportError:
    mx = None
from mlxrun.backends.torch_sampling import TorchSampler
from mlxrun.backends.torch_sampling import uniform as torch_uniform

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # the CUDA sampler's Triton kernels, run by the interpreter on the CPU
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import mlxrun.backends.cuda_sampling as cuda_sampling

    if not HAS_CUDA and type(cuda_sampling._draw_kernel).__name__ != "InterpretedFunction":
        cuda_sampling = importlib.reload(cuda_sampling)  # imported before: decorate again
except ImportError:  # no triton
    cuda_sampling = None

DEVICES = ["torch-cpu"] + (["mlx"] if mx is not None else [])
DEVICES += ["torch-cuda"] if HAS_CUDA else []
INTERPRETED = cuda_sampling is not None and not HAS_CUDA
V = 48
HISTORY = [1, 2, 3, 5, 30, 30]


def _logits(seed=0):
    rng = np.random.default_rng(seed)
    z = (2 * rng.normal(size=V)).astype(np.float32)
    top = z.max()
    z[[5, 6, 7, 9]] = top - 0.25  # a tie group that top-p and top-k cut through
    z[[11, 12]] = top + 0.5
    return z


def _draw(device, params, logits, history=HISTORY, logprobs=None):
    """Tokens (B,) for B rows (one per params) of the same logits, on `device`."""
    B = len(params)
    plan = plan_for(params, V, logprobs)
    state = pack(params, [history] * B, plan)
    x = np.tile(logits, (B, 1))
    if device == "mlx":
        s = MLXSampler(plan, state)
        tok = np.array(s(mx.array(x)))
        lp = s.logprobs()
        return tok, None if lp is None else [None if a is None else np.array(a) for a in lp]
    dev = "cpu" if device == "triton-interpreter" else device.split("-")[1]
    s = TorchSampler(plan, state, dev, triton=device in ("torch-cuda", "triton-interpreter"))
    tok = s(torch.from_numpy(x).to(dev)).cpu().numpy()
    lp = s.logprobs()
    return tok, None if lp is None else [None if a is None else a.cpu().numpy() for a in lp]


def _expected(p: SamplingParams, logits):
    row = logits.astype(np.float64)
    if p.repetition_penalty != 1:
        for t in set(HISTORY[-p.repetition_context :]):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    order, probs = HostSampler(p).kept(row / p.temperature)
    want = np.zeros(V)
    want[order] = probs
    return want


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.3),  # ends inside the tie group at the top
    dict(temperature=1.0, top_k=4),  # cuts the tie group of four
    dict(temperature=1.5, top_k=12, top_p=0.8, min_p=0.02),
    dict(temperature=0.8, min_p=0.1),
    dict(temperature=1.0, repetition_penalty=1.5, repetition_context=3),
    dict(temperature=2.0, top_p=0.95, repetition_penalty=0.8),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_device_sampling_draws_the_reference_distribution(device, kw):
    """20,000 rows of one batch, each its own seed: tokens only from the reference's kept set,
    and their frequencies within the chi-square bound of its probabilities (p > 1e-4)."""
    n = 20_000
    logits = _logits()
    params = [SamplingParams(seed=i, **kw) for i in range(n)]
    tok, _ = _draw(device, params, logits)
    want = _expected(params[0], logits)
    counts = np.bincount(tok, minlength=V)
    keep = want > 0
    assert counts[~keep].sum() == 0, (
        f"drew tokens outside the kept set: {np.flatnonzero(counts * ~keep)}"
    )
    dof = keep.sum() - 1
    if dof:
        stat = ((counts[keep] - n * want[keep]) ** 2 / (n * want[keep])).sum()
        assert chi2.sf(stat, dof) > 1e-4, (stat, dof)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_rows_and_seeds_are_independent_of_batch_mates(device):
    """One batch mixing greedy, top-k, top-p and penalised rows: each row's token equals the
    token it draws alone with the same seed, and the greedy rows take the argmax."""
    logits = _logits(3)
    rows = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_k=5, seed=7),
        SamplingParams(temperature=1.2, top_p=0.7, seed=8),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, seed=9),
    ]
    together, _ = _draw(device, rows, logits)
    alone = [int(_draw(device, [p], logits)[0][0]) for p in rows]
    assert together.tolist() == alone
    assert together[0] == int(np.argmax(logits))
    pen = logits.copy()
    for t in set(HISTORY):
        pen[t] = pen[t] / 1.3 if pen[t] > 0 else pen[t] * 1.3
    assert together[3] == int(np.argmax(pen))


@pytest.mark.skipif(not INTERPRETED, reason="the GPU runs the kernels in the tests above")
@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize(
    "kw", SETTINGS[:6], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
)
def test_cuda_kernels_draw_the_torch_ops_tokens(kw):
    """The CUDA sampler's Triton kernels (under the interpreter here) take the same kept set
    and the same inverse-CDF step as the torch ops: the same tokens for the same seeds (a
    float32 target against the ops' float64 may differ at a boundary: at most 2 of 64)."""
    logits = _logits(7)
    params = [SamplingParams(seed=i, **kw) for i in range(63)] + [SamplingParams()]
    kernels, _ = _draw("triton-interpreter", params, logits)
    ops, _ = _draw("torch-cpu", params, logits)
    want = _expected(params[0], logits)
    assert (want[kernels[:-1]] > 0).all() and kernels[-1] == np.argmax(logits)
    assert (kernels != ops).sum() <= 2, (kernels, ops)


def test_uniform_is_the_same_hash_everywhere():
    seed = np.array([0, 1, 12345, 0xFFFFFFFF], np.int64)
    ctr = np.array([0, 5, 1 << 20, 7], np.int64)
    want = uniform_np(seed, ctr)
    assert np.array_equal(
        torch_uniform(torch.from_numpy(seed), torch.from_numpy(ctr)).numpy(), want
    )
    if mx is not None:
        got = mlx_uniform(mx.array(seed.astype(np.uint32)), mx.array(ctr.astype(np.uint32)))
        assert np.array_equal(np.array(got).astype(np.float64), want)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_models_log_softmax(device):
    logits = _logits(5)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams()]
    tok, (lp, top, top_ids) = _draw(device, params, logits, logprobs=3)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    np.testing.assert_allclose(lp, ref[tok], atol=1e-5)
    order = np.argsort(-ref, kind="stable")[:3]
    np.testing.assert_allclose(top, np.tile(ref[order], (2, 1)), atol=1e-5)
    assert set(top_ids[0].tolist()) == set(order.tolist())  # the tied pair in either order


def test_sampled_generation_is_seeded_and_batch_independent(tiny_dir):
    """Through the model (torch-cpu, fp32): a seeded sampled sequence is the same alone and
    beside another prompt, differs with another seed, and its logprobs come with it."""
    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    a = [int(t[0]) for t in generate_step(m.transformer, [[5, 6, 7, 8]], p, 12)]
    both = list(generate_step(m.transformer, [[5, 6, 7, 8], [9, 3]], [p, SamplingParams()], 12))
    assert [int(t[0]) for t in both] == a
    other = [
        int(t[0])
        for t in generate_step(
            m.transformer, [[5, 6, 7, 8]], SamplingParams(temperature=1.0, top_p=0.95, seed=12), 12
        )
    ]
    assert other != a
    steps = list(generate_step(m.transformer, [[5, 6, 7, 8]], p, 12, logprobs=2))
    assert isinstance(steps[0], Step) and [int(s.tokens[0]) for s in steps] == a
    assert all(s.logprob[0] <= 0 and s.top_logprobs[0, 0] >= s.logprob[0] for s in steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("quant", [None, "int4"])
def test_cuda_graph_sampling_equals_eager(tiny_dir, quant):
    """The sampler captured in the decode graph draws exactly the eager sampler's tokens,
    and a second generation reusing the captured graph with another seed matches too."""
    from mlxrun.backends.torch_backend import TorchBackend

    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cuda", dtype="float32", quant=quant, progress=False)
    prompts = [[5, 6, 7, 8], [9, 3, 4, 2]]
    rows = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, top_k=7, repetition_penalty=1.2, seed=4),
    ]

    def run(rows):
        return [t.tolist() for t in generate_step(m.transformer, prompts, rows, 16)]

    graph = run(rows)
    graph2 = run([SamplingParams(temperature=0.8, top_p=0.9, seed=5), rows[1]])
    be = m.transformer.be
    assert isinstance(be, TorchBackend) and be.cuda_graphs
    be.cuda_graphs = False
    try:
        assert run(rows) == graph
        assert run([SamplingParams(temperature=0.8, top_p=0.9, seed=5), rows[1]]) == graph2
    finally:
        be.cuda_graphs = True
