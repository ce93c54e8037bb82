"""Every architecture from a tiny random config, on both CPU backends, against
transformers on the same weights: logits at every position and 32 greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

from .conftest import TINY, hf_greedy, rel_err

BACKENDS = ["cpu", "mlx"]


def _ids(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 96, size=n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(TINY))
def test_logits_and_greedy_match_transformers(tiny_dir, name, backend):
    d, hf = tiny_dir(name)
    ids = _ids(24)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    got = m.logits(ids)
    assert got.shape == (24, 96)
    assert rel_err(got, ref) < 1e-4
    toks = [
        int(t[0])
        for t in generate_step(
            m.transformer, [ids.tolist()], SamplingParams(), max_tokens=32, prefill_chunk=7
        )
    ]
    assert toks == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(tiny_dir, backend, dtype):
    d, hf = tiny_dir("llama3_untied_scaled")
    ids = _ids(16)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m = mlxrun.load(str(d), backend=backend, dtype=dtype, progress=False)
    assert rel_err(m.logits(ids), ref) < 3e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_cache_equal_one_pass(tiny_dir, backend):
    """Prefill in chunks of 5 then decode token by token: the logits of every step equal
    the full-sequence forward pass (the cache and the causal mask with an offset agree)."""
    d, _ = tiny_dir("qwen2_bias")
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    ids = _ids(19)
    full = m.logits(ids)
    t, be = m.transformer, m.backend
    cache = t.make_cache(1, 19)
    steps = []
    for s in range(0, 12, 5):
        steps.append(be.to_numpy(t(be.ids(ids[None, s : min(s + 5, 12)]), cache))[0])
    for i in range(12, 19):
        steps.append(be.to_numpy(t(be.ids(ids[None, i : i + 1]), cache))[0])
    assert rel_err(np.concatenate(steps), full) < 1e-5
