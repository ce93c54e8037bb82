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

from .conftest import hf_greedy, rel_err, write_random

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
    want = hf_greedy(hf, ids, 6)
    assert toks == want


# The GGUF file fixes what llama.cpp fixes: every 6th layer global, local rope base 10000,
# attention scaled by head_dim^-0.5
GEMMA3_GGUF = dict(
    GEMMA3, num_hidden_layers=6, vocab_size=262, query_pre_attn_scalar=32,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
    },
)  # fmt: skip
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip


def write_gemma3_gguf(path, hf) -> None:
    """hf's weights as llama.cpp writes a Gemma 3 file: GGUF names, norms stored as 1 + w."""
    import gguf

    from .test_gguf_archs import byte_vocab

    c = hf.config
    tokens, merges, types = byte_vocab()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(1000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    for name, p in hf.state_dict().items():
        a = p.detach().float().numpy()
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}.{_GGUF_NAMES[rest.rsplit('.', 1)[0]]}.weight"
        if name.endswith("norm.weight"):
            a = a + 1
        w.add_tensor(out, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_gguf_logits_match_transformers(tmp_path, backend):
    """The same weights written as llama.cpp writes a gemma3 GGUF read back to
    transformers' logits (the model's own, in fp32), past the window."""
    d, hf = write_random(tmp_path / "hf", "gemma3_text", dict(GEMMA3_GGUF))
    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(path, hf)
    ids = np.random.default_rng(1).integers(0, 259, size=12)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m = mlxrun.load(str(path), backend=backend, dtype="float32", progress=False)
    assert m.transformer.config.layer_windows == (4,) * 5 + (None,)
    assert rel_err(m.logits(ids), ref) < 1e-4
