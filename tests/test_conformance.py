"""Conformance against transformers: each option that changes the arithmetic, one at a time
(plus the combinations real checkpoints ship), on tiny random models built with
transformers' own classes. Logits at every position within 1e-4 on torch-cpu and MLX, and
greedy tokens equal through the decode path over a prompt longer than any window. What
mlxrun does not run is refused with one line naming the option."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

from .conftest import hf_greedy, random_models, rel_err, write_random
from .test_cuda import assert_graph_cache_equals_eager

VOCAB = 64
BASE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
WINDOW = 6  # prompt 20 tokens, prefill in chunks of 7: chunks and decode cross the window

# name -> (model_type, options varied from BASE)
VARIANTS = {
    "llama_attention_bias": ("llama", dict(attention_bias=True)),
    "llama_mlp_bias": ("llama", dict(mlp_bias=True)),
    "llama_gelu_pytorch_tanh": ("llama", dict(hidden_act="gelu_pytorch_tanh")),
    "llama_gelu": ("llama", dict(hidden_act="gelu")),
    "llama_relu": ("llama", dict(hidden_act="relu")),
    "llama_head_dim_tied": ("llama", dict(head_dim=16, tie_word_embeddings=True)),
    # biased Llama-class exports (InternLM/Yi-style) with tanh-GELU and llama3 rope
    "llama_biases_gelu_llama3": (
        "llama",
        dict(
            attention_bias=True,
            mlp_bias=True,
            hidden_act="gelu_pytorch_tanh",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "mistral_window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2_window": (  # layer 1 slides, layer 0 does not
        "qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3_bias_window": (
        "qwen3",
        dict(
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=0,
            head_dim=16,
        ),
    ),  # fmt: skip
    "qwen3_relu_tied": ("qwen3", dict(hidden_act="relu", tie_word_embeddings=True)),
}


def _make(root, name: str, mt: str, opts: dict, seed: int = 0):
    """A random checkpoint written by transformers; returns (dir, fp32 model)."""
    return write_random(root / name, mt, {**BASE, **opts}, seed, std=0.2, bias_std=0.3)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    return random_models(tmp_path_factory.mktemp("conform"), VARIANTS, BASE, std=0.2, bias_std=0.3)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(variant, name):
    d, hf = variant(name)
    ids = np.random.default_rng(1).integers(3, VOCAB, size=20)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    want = hf_greedy(hf, ids, 8)
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
        assert rel_err(m.logits(ids), ref) < 1e-4, backend
        steps = generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=8,
                              prefill_chunk=7)  # fmt: skip
        assert [int(t[0]) for t in steps] == want, backend


def test_window_is_per_layer_and_matters(variant):
    """The window is a per-layer option (qwen2: layers from max_window_layers on), and a
    model run without it differs past the window: the test above could not pass by luck."""
    d, hf = variant("qwen2_window")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    assert m.transformer.config.layer_windows == (None, WINDOW)
    ids = np.random.default_rng(1).integers(3, VOCAB, size=20)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m.transformer.config = m.transformer.config.replace(layer_windows=())
    got = m.logits(ids)
    assert rel_err(got[:WINDOW], ref[:WINDOW]) < 1e-4  # inside the window: the same
    assert rel_err(got[WINDOW:], ref[WINDOW:]) > 1e-2


def _cfg(mt: str = "llama", **kw) -> dict:
    return {"model_type": mt, **BASE, **kw}


@pytest.mark.parametrize(
    "d, words",
    [
        (_cfg(hidden_act="gelu_fast"), ["hidden_act", "gelu_fast"]),
        (_cfg(final_logit_softcapping=30.0), ["final_logit_softcapping", "30.0"]),
        (_cfg(attn_logit_softcapping=50.0), ["attn_logit_softcapping"]),
        (_cfg(logits_scaling=8.0), ["logits_scaling", "8.0"]),
        (_cfg(embedding_multiplier=12.0), ["embedding_multiplier"]),
        (_cfg(partial_rotary_factor=0.5), ["partial_rotary_factor", "0.5"]),
        (_cfg(rope_scaling={"rope_type": "longrope", "factor": 4.0}), ["rope_scaling", "longrope"]),
        (_cfg(sliding_window=512), ["sliding_window", "512", "mistral"]),
        (_cfg("mistral", sliding_window=0), ["sliding_window", "0"]),
        (
            _cfg("qwen2", use_sliding_window=True, layer_types=["full_attention", "chunked"]),
            ["layer_types", "chunked"],
        ),
        (_cfg(num_local_experts=8), ["num_local_experts", "8"]),
        (
            _cfg(quantization_config={"quant_method": "gptq", "bits": 4}),
            ["quant_method", "gptq"],
        ),
    ],
)
def test_unrun_options_are_refused(d, words):
    with pytest.raises(MlxrunError) as e:
        ModelConfig.from_dict(d)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_neutral_and_inert_keys_are_accepted():
    c = ModelConfig.from_dict(
        _cfg(
            final_logit_softcapping=None,
            partial_rotary_factor=1.0,
            attention_dropout=0.1,
            pretraining_tp=2,  # transformers 5 ignores it
            hidden_act="swish",
            sliding_window=None,
        )
    )
    assert c.hidden_act == "silu" and c.layer_windows == ()
    assert ModelConfig.from_dict(_cfg(hidden_act="gelu_new")).hidden_act == "gelu_new"
    # transformers' Mistral slides every layer, 4096 keys when the config names no window
    assert ModelConfig.from_dict(_cfg("mistral")).layer_windows == (4096, 4096)
    assert ModelConfig.from_dict(_cfg("mistral", sliding_window=None)).layer_windows == ()
    # Qwen2's q/k/v always carry biases and o never; Qwen3 follows attention_bias
    q2 = ModelConfig.from_dict(_cfg("qwen2", attention_bias=False, mlp_bias=True))
    assert (q2.attention_bias, q2.o_bias, q2.mlp_bias) == (True, False, False)


def test_unused_tensor_refuses_the_load(variant, tmp_path):
    """A checkpoint with biases whose config.json does not say so: every bias would be
    dropped, so the load is refused, naming the first tensors."""
    import shutil

    src, _ = variant("llama_attention_bias")
    d = tmp_path / "m"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attention_bias"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MlxrunError, match=r"8 tensor\(s\).*layers\.0\.self_attn\.k_proj\.bias"):
        mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)


@pytest.mark.parametrize(
    "key, value, refused",
    [
        ("llama.attention.sliding_window", 4096, True),
        ("llama.final_logit_softcapping", 30.0, True),
        ("llama.rope.scaling.attn_factor", 0.5, True),
        ("llama.attention.value_length", 8, True),  # values narrower than keys (16)
        ("llama.embedding_scale", 1.0, False),  # the neutral value
        ("llama.rope.scaling.finetuned", True, False),  # no effect on the arithmetic
        ("quantize.imatrix.file", "imatrix.dat", False),  # another namespace
    ],
)
def test_gguf_metadata_keys(tmp_path, monkeypatch, key, value, refused):
    """The same rule for GGUF: a llama.* key that changes the arithmetic and that the import
    does not carry into the config refuses the file, naming the key and its value."""
    import gguf

    from mlxrun.gguf import read_gguf

    from .test_gguf import DIMS, write_synthetic

    assert DIMS["head_dim"] == 16

    class Writer(gguf.GGUFWriter):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            put = {bool: self.add_bool, int: self.add_uint32, float: self.add_float32}
            put.get(type(value), self.add_string)(key, value)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    p = tmp_path / "m.gguf"
    write_synthetic(p)
    if not refused:
        assert read_gguf(p).config["model_type"] == "llama"
        return
    with pytest.raises(MlxrunError) as e:
        read_gguf(p)
    msg = str(e.value)
    assert key in msg and repr(value) in msg and "\n" not in msg


def test_graph_mode_window_masks_equal_eager(variant):
    """The CUDA graph's device-side sliding-window masks (moved on with the position, the
    fused advance kernel stepping aside) give the eager logits, decoding past the window
    with a left-padded batch; run here without capture."""
    d, _ = variant("qwen3_bias_window")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    steps = [[[13 + i], [30 + i]] for i in range(8)]  # positions 5..12: past the window of 6
    graph = assert_graph_cache_equals_eager(m, steps, 14)
    assert set(graph._windowed) == {WINDOW}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "name", ["mistral_window", "qwen3_bias_window", "llama_biases_gelu_llama3"]
)
def test_cuda_graph_decode_matches_transformers(variant, name):
    """On a GPU: the captured decode step with windows, biases and activations."""
    d, hf = variant(name)
    ids = np.random.default_rng(1).integers(3, VOCAB, size=20)
    want = hf_greedy(hf, ids, 12)
    m = mlxrun.load(str(d), backend="cuda", dtype="float32", progress=False)
    steps = generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=12)
    assert [int(t[0]) for t in steps] == want
