"""`bench --compare mlx-lm`: mlx-lm's model built on mlxrun's arrays computes the same
logits and greedy tokens as ours (so the two rows time the same work), and the bench rows
and skips it adds."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from mlxrun import bench, bench_mlxlm, bench_timing
from mlxrun.bench import build_random, run_bench, shape_config
from mlxrun.generate import generate_step
from mlxrun.quant.formats import resolve
from mlxrun.sampling import SamplingParams

from .conftest import rel_err

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
mlx_lm_generate = importlib.import_module("mlx_lm.generate")


def _model(which: str):
    from mlxrun.api import load
    from mlxrun.backends import get_backend

    if which == "smollm2":  # the bundled Q4_1 GGUF: int4 g32 layers, a Q8_0 tied head
        return load("smollm2", backend="mlx", progress=False).transformer
    be = get_backend("mlx", "float32")
    quant = None if which == "none" else resolve(which.removesuffix("+head8"))
    m = build_random(shape_config("shape:tiny"), be, quant, seed=3)
    if which.endswith("+head8"):  # layers and head in different formats, as GGUF files do
        m.head = be.quantize(be.dequantize(m.head), "affine", 8, 32)
    return m


@pytest.mark.parametrize(
    "which",
    [
        "none",
        "int4",
        "fp4",
        "int4+head8",
        pytest.param("smollm2", marks=(pytest.mark.slow, pytest.mark.long)),
    ],
)
def test_mlx_lm_model_on_our_arrays_matches_ours(which):
    m = _model(which)
    mlm = bench_mlxlm.mlx_lm_model(m)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, m.config.vocab_size, 12).tolist()
    be = m.be
    ours = be.to_numpy(m(be.ids(np.array([prompt])), m.make_cache(1, 12)))
    theirs = np.array(mlm(mx.array([prompt])).astype(mx.float32))
    assert ours.shape == theirs.shape == (1, 12, m.config.vocab_size)
    assert rel_err(theirs, ours) < 1e-5
    # The same greedy continuation, each through its own generate loop and cache.
    toks = [int(t[0]) for t in generate_step(m, [prompt], SamplingParams(), 8)]
    peer = [int(t) for t, _ in mlx_lm_generate.generate_step(mx.array(prompt), mlm, max_tokens=8)]
    assert toks == peer


@pytest.mark.parametrize("which", ["int4", "fp4", "int4+head8"])
def test_dense_prefill_matches_quantized_matmul(which):
    """MLXBackend.dense_rows: passes of that many rows expand each packed weight and run a
    dense matmul, with mlx-lm's logits (MLX's quantized matmul) on the same arrays; a
    one-row pass, below the threshold, keeps the quantized matmul."""
    from mlxrun.backends.mlx_backend import MLXBackend

    m = _model(which)
    prompt = np.random.default_rng(1).integers(0, m.config.vocab_size, 12).tolist()
    theirs = np.array(bench_mlxlm.mlx_lm_model(m)(mx.array([prompt])).astype(mx.float32))
    be, expanded = m.be, []
    dequantize = be.dequantize  # the backend's own, bound before the counting one replaces it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MLXBackend, "dense_rows", 4)
        mp.setattr(MLXBackend, "dequantize", lambda _, q: expanded.append(q) or dequantize(q))
        cache = m.make_cache(1, 13)
        ours = be.to_numpy(m(be.ids(np.array([prompt])), cache))
        n_prompt = len(expanded)
        one = be.to_numpy(m(be.ids(np.array([[prompt[0]]])), m.make_cache(1, 1)))
    assert rel_err(theirs, ours) < 1e-5
    assert rel_err(theirs[:, :1], one) < 1e-5
    assert n_prompt == 7 * m.config.num_hidden_layers + 1  # every layer's matrices and the head
    assert len(expanded) == n_prompt  # none for the one-row pass


def test_bench_compare_mlx_lm_rows():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench_timing.COPY_BYTES, "cpu", 32 << 20)  # a smaller copy keeps the test fast
        r = run_bench(
            "shape:tiny",
            ["mlx"],
            ["none", "int4"],
            prompt_tokens=16,
            gen_tokens=8,
            reps=2,
            compare=["mlx-lm"],
            progress=False,
        )
    assert [(x.backend, x.quant) for x in r.rows] == [
        ("mlx", "none"),
        ("mlx-lm", "none"),
        ("mlx", "int4"),
        ("mlx-lm", "int4"),
    ]
    for ours, peer in (r.rows[0:2], r.rows[2:4]):
        assert peer.engine == "mlx-lm" and peer.description.startswith("mlx-lm ")
        assert peer.weights == ours.weights  # the same arrays
        assert peer.bytes_per_token == ours.bytes_per_token
        assert len(peer.decode_tps_reps) == 2 and min(peer.decode_tps_reps) > 0
        assert peer.prefill_tps == pytest.approx(16 / (peer.ttft_ms / 1e3))
    assert r.skipped == []
    assert "mlx-lm" in bench.format_report(r)


@pytest.mark.parametrize(
    "backends,batch,why",
    [
        (["mlx"], 2, "mlx-lm's generate_step runs batch 1 only"),
        (["cpu"], 1, "it runs on the mlx backend: add mlx to --backends"),
    ],
)
def test_bench_compare_mlx_lm_skips(backends, batch, why):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench_timing.COPY_BYTES, "cpu", 32 << 20)
        r = run_bench(
            "shape:tiny",
            backends,
            ["none"],
            prompt_tokens=8,
            gen_tokens=2,
            batch=batch,
            reps=1,
            compare=["mlx-lm"],
            progress=False,
        )
    assert [x.backend for x in r.rows] == backends
    assert [(s.backend, s.reason) for s in r.skipped] == [("mlx-lm", why)]


def _ops(tmp_path, name, *outs) -> int:
    """Primitives in the graph that computes `outs` (MLX's own dot export, one node a line)."""
    path = tmp_path / f"{name}.dot"
    mx.export_to_dot(str(path), *outs)
    return path.read_text().count("shape=rectangle")


@pytest.mark.parametrize("which", ["none", "int4"])
def test_decode_step_graph_no_larger_than_mlx_lm(tmp_path, which):
    """One greedy decode step after the same prompt, as each loop queues it (ours: the token
    and the logits' NaN/inf check; mlx-lm's: the token and its log-probabilities): ours has
    no more primitives than mlx-lm's, 2 a layer fewer than with SwiGLU as separate sigmoid
    and multiplies, and 7 fewer than with the check's elementwise ops uncompiled."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxrun.backends import mlx_backend as mb

    m = _model(which)
    mlm = bench_mlxlm.mlx_lm_model(m)
    prompt = mx.array([list(range(1, 17))])

    def ours():
        cache = m.make_cache(1, 32)
        logits = m(prompt, cache, last_only=True)
        mx.eval(logits, *cache.keys, *cache.values)  # the prompt's graph ends here
        y = mx.argmax(logits, axis=-1)
        logits = m(y.reshape(1, 1), cache, last_only=True)
        return m.be.argmax(logits), m.be.finite_rows(logits)

    def unfused(name, plain):
        old = getattr(mb, name)
        try:
            setattr(mb, name, plain)
            return _ops(tmp_path, name, *ours())
        finally:
            setattr(mb, name, old)

    cache = make_prompt_cache(mlm)
    logits = mlm(prompt, cache=cache)
    mx.eval(logits, [c.state for c in cache])
    y = mx.argmax(logits[:, -1, :], axis=-1)
    logits = mlm(y[:, None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)  # generate_step's _step
    theirs = (mx.argmax(logprobs, axis=-1), logprobs)  # its greedy sampler's argmax
    n_ours, n_theirs = _ops(tmp_path, "ours", *ours()), _ops(tmp_path, "theirs", *theirs)
    assert n_ours <= n_theirs
    assert unfused("_swiglu_fused", mb._swiglu) - n_ours == 2 * m.config.num_hidden_layers
    assert unfused("_finite_fused", mb._finite) - n_ours == 7
