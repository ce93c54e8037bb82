"""A prompt pass that keeps only the last position's logits (`last_only`: generate's and the
engine's prefill) attends with the last layer's last query alone, every position's keys and
values still cached (on MLX, `short_queries`, that query is also projected and rotated
alone, at its own position). Against transformers on tiny random models, on MLX and
torch-cpu, with the cut on and off: the last row's logits, the queries each attention call
saw, and the greedy tokens that follow (they read the keys the cut pass cached), for a
causal model (sdpa's "causal" mode), sliding windows in rings over chunks (boolean masks)
with and without left padding, and attention sinks on a sliding last layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mlxrun
import mlxrun.model
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

from .conftest import hf_greedy, random_models, rel_err

VOCAB = 64
BASE = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip
MODELS = {
    "llama": ("llama", {}),
    # every layer slides (the last one's mask is a boolean array, a ring once it wraps)
    "mistral_window": ("mistral", dict(sliding_window=5)),
    # sinks and biases; the sliding layer last, the full one first
    "gpt_oss_sinks": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=6, swiglu_limit=0.5,
                                      layer_types=["full_attention", "sliding_attention"])),
}  # fmt: skip
PROMPT = np.random.default_rng(2).integers(3, VOCAB, size=19)
CHUNK = 8  # 19 tokens: passes of 8, 8 and 3, each past the window of the sliding layers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return random_models(tmp_path_factory.mktemp("last_query"), MODELS, BASE, std=0.2)


def _no_cut(q, mask):  # the code before the cut: every query attends, the output is sliced
    return q, mask


def _query_rows(be, monkeypatch) -> list[int]:
    """The query rows of every attention call from now on."""
    rows, attention = [], be.attention

    def counted(q, *args, **kw):
        rows.append(int(q.shape[2]))
        return attention(q, *args, **kw)

    monkeypatch.setattr(be, "attention", counted)
    return rows


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
@pytest.mark.parametrize("name", list(MODELS))
def test_last_query_cut_keeps_logits_and_tokens(models, name, backend, monkeypatch):
    d, hf = models(name)
    with torch.no_grad():
        ref = hf(torch.tensor(PROMPT)[None]).logits[0, -1].numpy()
    want = hf_greedy(hf, PROMPT, 6)
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    t, be = m.transformer, m.backend
    rows = _query_rows(be, monkeypatch)
    got = {}
    for cut in (True, False):
        if not cut:  # (and on MLX, the last layer's q projected for every row again)
            monkeypatch.setattr(mlxrun.model, "last_query", _no_cut)
            monkeypatch.setattr(be, "short_queries", False)
        rows.clear()
        cache = t.make_cache(1, len(PROMPT) + 6, chunk=CHUNK)
        for s in range(0, len(PROMPT), CHUNK):
            logits = t(be.ids(PROMPT[None, s : s + CHUNK]), cache, None, last_only=True)
        got[cut] = be.to_numpy(logits)[0]
        n = [min(CHUNK, len(PROMPT) - s) for s in range(0, len(PROMPT), CHUNK)]
        assert rows == [r for k in n for r in (k, 1 if cut else k)], cut  # 2 layers a pass
        assert rel_err(got[cut], ref) < 1e-4, cut
        rows.clear()
        steps = generate_step(t, [PROMPT.tolist()], SamplingParams(), 6, prefill_chunk=CHUNK)
        assert [int(s[0]) for s in steps] == want, cut
        assert rows[:6] == ([8, 1, 8, 1, 3, 1] if cut else [8, 8, 8, 8, 3, 3]), cut
    assert rel_err(got[True], got[False]) < 1e-5


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_last_query_cut_in_a_left_padded_batch(models, backend):
    """Two prompts of 19 and 7 tokens in one batch (the short one left-padded: its rows of
    the sliding mask hide the padding): each gets its own transformers tokens."""
    d, hf = models("mistral_window")
    prompts = [PROMPT.tolist(), PROMPT[:7].tolist()]
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    steps = list(generate_step(m.transformer, prompts, SamplingParams(), 5, prefill_chunk=CHUNK))
    for b, p in enumerate(prompts):
        assert [int(s[b]) for s in steps] == hf_greedy(hf, p, 5), b
