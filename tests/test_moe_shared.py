"""Qwen2-MoE (a shared expert beside the routed ones) against transformers: tiny random
Qwen2MoeForCausalLM checkpoints, logits within 1e-4 on torch-cpu and MLX and greedy tokens
equal; int4 on load against transformers running the dequantized bytes; the planner and
the bench count the shared expert as held and always read."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.backends.base import QuantizedWeight
from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError

from .conftest import random_models, rel_err, write_random
from .test_moe import BASE as MOE_BASE
from .test_moe import VOCAB, _check, _check_plan, _hf

# test_moe's models with a third layer and Qwen2-MoE's experts, a shared one among them
BASE = dict(
    MOE_BASE,
    num_hidden_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=96,
    intermediate_size=64,
)
# Qwen1.5-MoE's routing (raw top-k weights); layer 1 a dense MLP (mlp_only_layers)
VARIANT = dict(norm_topk_prob=False, mlp_only_layers=[1])
PROMPT = np.random.default_rng(2).integers(3, VOCAB, size=32)  # 64 slots: the grouped paths


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2moe")
    return functools.partial(random_models(root, {"m": ("qwen2_moe", VARIANT)}, BASE, std=0.2), "m")


def test_qwen2_moe_matches_transformers(variant):
    d, hf = variant()
    ref, want = _hf(hf, PROMPT, 4)
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
        _check(m, PROMPT, ref, want, 1e-4, backend)
    o = m.transformer.config.moe
    layers = (True, False, True)
    assert (o.shared_intermediate_size, o.norm_topk, o.layers) == (96, False, layers)
    for L, moe in zip(m.transformer.layers, layers, strict=True):
        assert (L.moe is not None) == moe
        # the dense MLP is the shared expert in a MoE layer, the layer's own MLP elsewhere
        assert tuple(L.gate_proj.shape) == ((96, 64) if moe else (64, 64))


def test_the_shared_expert_and_its_gate_count(variant):
    """Without the shared expert's gate (or without the expert) the logits move: the test
    above could not pass with either ignored."""
    d, hf = variant()
    ref, _ = _hf(hf, PROMPT[:8], 1)
    m = mlxrun.load(str(d), backend="mlx", dtype="float32", progress=False)
    e = m.transformer.layers[0].moe
    be = m.transformer.be
    e.shared_gate = be.array(np.full((1, 64), 0.0, np.float32))  # sigmoid(0) = 1/2
    assert rel_err(m.logits(PROMPT[:8]), ref) > 1e-3


def _dequantized_reference(hf, m):
    """A copy of the transformers model whose weights are mlxrun's dequantized ones."""
    be = m.transformer.be
    ref = copy.deepcopy(hf)
    sd = ref.state_dict()

    def host(w):
        return be.to_numpy(be.dequantize(w) if isinstance(w, QuantizedWeight) else w)

    def put(name, w):
        sd[name].copy_(torch.from_numpy(host(w)).reshape(sd[name].shape))

    t = m.transformer
    put("model.embed_tokens.weight", t.embed)
    put("lm_head.weight", t.head)
    for i, L in enumerate(t.layers):
        p = f"model.layers.{i}"
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(f"{p}.self_attn.{k}.weight", getattr(L, k))
        mlp = f"{p}.mlp.shared_expert" if L.moe is not None else f"{p}.mlp"
        for k in ("gate_proj", "up_proj", "down_proj"):
            put(f"{mlp}.{k}.weight", getattr(L, k))
        e = L.moe
        if e is not None:
            gu = np.concatenate([host(e.gate), host(e.up)], 1)
            sd[f"{p}.mlp.experts.gate_up_proj"].copy_(torch.from_numpy(gu))
            put(f"{p}.mlp.experts.down_proj", e.down)
            put(f"{p}.mlp.gate.weight", e.router)
            put(f"{p}.mlp.shared_expert_gate.weight", e.shared_gate)
    ref.load_state_dict(sd)
    return ref


def test_int4_matches_transformers_on_its_bytes(variant):
    """int4 g32 on load: the shared expert is quantized like the other linears, its gate
    and the router kept as stored; logits are transformers' on the dequantized bytes."""
    d, hf = variant()
    got = {}
    for backend in ("mlx", "cpu"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False, quant="int4",
                        group_size=32)  # fmt: skip
        L = m.transformer.layers[0]
        assert isinstance(L.gate_proj, QuantizedWeight) and isinstance(L.moe.gate, QuantizedWeight)
        assert not isinstance(L.moe.shared_gate, QuantizedWeight)
        ref, want = _hf(_dequantized_reference(hf, m), PROMPT[:20], 4)
        assert rel_err(ref, _hf(hf, PROMPT[:20], 1)[0]) > 1e-3  # quantized for real
        _check(m, PROMPT[:20], ref, want, 1e-4, backend)
        got[backend] = m.logits(PROMPT[:20])
    assert rel_err(got["cpu"], got["mlx"]) < 1e-4


def test_planner_counts_the_shared_expert(variant):
    _check_plan(*variant())


def test_qwen1_5_moe_shape_plans_by_total_and_reads_the_shared_expert():
    from mlxrun.backends import get_backend
    from mlxrun.bench import build_random, shape_config, weight_bytes
    from mlxrun.memory import config_shapes, footprint

    big = shape_config("shape:qwen1.5-moe-a2.7b")
    assert (big.moe.num_experts, big.moe.top_k, big.moe.shared_intermediate_size) == (60, 4, 5632)
    assert footprint(big, config_shapes(big), "bfloat16").n_params == pytest.approx(
        14.32e9, rel=2e-3
    )  # Qwen1.5-MoE-A2.7B: 14.3B
    c = ModelConfig.from_dict({**BASE, "model_type": "qwen2_moe", "mlp_only_layers": [1]})
    m = build_random(c, get_backend("mlx", "float32"), seed=1)
    E, k = c.moe.num_experts, c.moe.top_k
    moe = [L for L in m.layers if L.moe is not None]
    experts = sum(int(w.nbytes) for L in moe for w in (L.moe.gate, L.moe.up, L.moe.down))
    held, read1 = weight_bytes(m, 1)
    assert held == m.weight_bytes()
    rows = int(m.embed.nbytes) * (1 - 1 / c.vocab_size)  # the embedding: one row read
    # only the routed experts go unread; the shared expert and its gate are read every step
    assert held - read1 == pytest.approx(experts * (E - k) / E + rows, abs=len(m.layers))
    shared = sum(int(w.nbytes) for L in moe for w in (L.gate_proj, L.up_proj, L.down_proj))
    assert shared == 2 * 3 * 96 * 64 * 4


def test_shared_expert_options_are_checked():
    d = {**BASE, "model_type": "qwen2_moe"}
    with pytest.raises(MlxrunError, match="shared_expert_intermediate_size"):
        ModelConfig.from_dict({**d, "shared_expert_intermediate_size": 0})
    with pytest.raises(MlxrunError, match="use_sliding_window"):
        ModelConfig.from_dict({**d, "use_sliding_window": True})
    o = ModelConfig.from_dict({**d, "decoder_sparse_step": 2, "norm_topk_prob": True}).moe
    assert (o.layers, o.norm_topk) == ((False, True, False), True)  # as Qwen2MoeDecoderLayer
    assert not ModelConfig.from_dict({**d, "qkv_bias": False}).attention_bias
    assert ModelConfig.from_dict(d).attention_bias and not ModelConfig.from_dict(d).o_bias


@pytest.mark.long
def test_mlx_lm_interop_both_ways(tmp_path):
    """mlxrun convert's int4 output loads in mlx-lm with the same logits, and mlx_lm.convert's
    loads in mlxrun (mlx-lm's qwen2_moe has no dense layers: every layer sparse here)."""
    import json

    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlxrun.convert import convert

    d, _ = write_random(tmp_path / "src", "qwen2_moe", BASE, 0, std=0.2)
    cfg = json.loads((d / "config.json").read_text())  # mlx-lm's ModelArgs needs rope_theta
    cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
    (d / "config.json").write_text(json.dumps(cfg))
    ids = PROMPT[:12].tolist()
    assert convert(str(d), str(tmp_path / "ours"), quant="int4", group_size=32,
                   progress=False) == []  # fmt: skip
    mlx_lm.convert(hf_path=str(d), mlx_path=str(tmp_path / "theirs"), quantize=True,
                   q_group_size=32, q_bits=4)  # fmt: skip
    for path in (tmp_path / "ours", tmp_path / "theirs"):
        model, _ = mlx_lm.load(str(path))
        want = np.array(model(mx.array([ids])).astype(mx.float32))[0]
        m = mlxrun.load(str(path), backend="mlx", dtype="float32", progress=False)
        assert rel_err(m.logits(ids), want) < 1e-4, path.name
