"""Gemma 3 (text) from safetensors against transformers' Gemma3ForCausalLM on a tiny random
config: (1 + w) norms, sandwich norms, q/k norms, the scaled embedding, query_pre_attn_scalar,
tanh-GELU, sliding layers with their own rope base beside a global layer with linear rope
scaling, positions past the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

from .conftest import rel_err, write_random

GEMMA3 = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=300, sliding_window=4,
    query_pre_attn_scalar=24, max_position_embeddings=512,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
    },
)  # fmt: skip


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return write_random(tmp_path_factory.mktemp("gemma3"), "gemma3_text", dict(GEMMA3))


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_logits_and_greedy_match_transformers(gemma3, backend):
    d, hf = gemma3
    ids = np.random.default_rng(0).integers(3, 300, size=12)  # 3x the window
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    assert rel_err(m.logits(ids), ref) < 1e-4
    toks = [
        int(t[0])
        for t in generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=6)
    ]
    want = hf.generate(
        torch.tensor(ids)[None], max_new_tokens=6, min_new_tokens=6, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0, len(ids) :].tolist()  # fmt: skip
    assert toks == want
