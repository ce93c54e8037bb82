"""Attention sinks (gpt-oss): a learned logit per head joins each query's softmax and is
dropped after it. Each backend's attention primitive against transformers' eager formula."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import rel_err

B, NH, NKV, T, S, D = 2, 4, 2, 3, 7, 16


def _reference(q, k, v, scale, mask, sinks):
    """transformers' gpt-oss eager attention, in float64: scores, the sink column joined,
    softmax, the sink column dropped."""
    rep = NH // NKV
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    s = np.where(mask, s, -np.inf)
    s = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (B, NH, T, 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return p[..., :-1] @ v


@pytest.fixture(scope="module")
def inputs():
    g = np.random.default_rng(0)
    q, k, v = (
        g.normal(size=(B, NH, T, D)),
        g.normal(size=(B, NKV, S, D)),
        g.normal(size=(B, NKV, S, D)),
    )
    sinks = g.normal(size=NH) * 2
    causal = np.tril(np.ones((T, S), bool), S - T)[None, None]
    window = causal & (np.arange(S)[None, :] > np.arange(S - T, S)[:, None] - 3)[None, None]
    return q, k, v, sinks, causal, window


def test_sinks_split_with_the_heads():
    from mlxrun.shard import split_axis

    assert split_axis("model.layers.3.self_attn.sinks") == 0
    assert split_axis("model.layers.3.self_attn.q_proj.weight") == 0
    assert split_axis("model.layers.3.self_attn.o_proj.weight") == -1


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_attention_with_sinks_matches_transformers(inputs, backend):
    from mlxrun.backends import get_backend

    be = get_backend(backend, dtype="float32")
    q, k, v, sinks, causal, window = inputs
    arr = lambda x: be.array(x.astype(np.float32))  # noqa: E731
    for mask, want_mask in (("causal", causal), (window, window)):
        m = mask if isinstance(mask, str) else be.array(mask)
        got = be.to_numpy(be.attention(arr(q), arr(k), arr(v), 0.3, m, sinks=arr(sinks)))
        want = _reference(q, k, v, 0.3, want_mask, sinks)
        assert rel_err(got, want) < 1e-5
    # the sinks matter: without them the result differs
    plain = be.to_numpy(be.attention(arr(q), arr(k), arr(v), 0.3, be.array(window)))
    assert rel_err(plain, _reference(q, k, v, 0.3, window, sinks)) > 1e-2
