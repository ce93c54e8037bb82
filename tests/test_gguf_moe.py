"""Mixture-of-experts GGUFs (qwen3moe, qwen2moe, Mixtral's llama) written with the `gguf`
package from tiny random transformers models, as llama.cpp lays them out (experts stacked
experts-first in ffn_*_exps, the router in ffn_gate_inp, the shared expert in ffn_*_shexp and
its gate a vector, llama's q/k rows permuted): logits within 1e-4 of transformers' own GGUF
loader (Mixtral: of the source model with the experts as written, which that loader does not
read in llama files) and greedy tokens equal on torch-cpu and MLX, in F16/F32 and with
quantized experts (Q8_0, Q4_K kept packed; Q6_K expanded with the import's note)."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.backends.base import QuantizedWeight
from mlxrun.errors import MlxrunError
from mlxrun.generate import generate_step
from mlxrun.quant.gguf_encode import q4_k, q6_k
from mlxrun.sampling import SamplingParams

from .conftest import hf_greedy, rel_err
from .test_gguf_archs import _add_tokenizer, byte_vocab

Q = gguf.GGMLQuantizationType
H, I, S, E, K = 256, 256, 512, 4, 2  # widths of whole 256-weight K-quant blocks
ARCHS = {  # GGUF architecture -> transformers model type and its MoE config
    "qwen3moe": ("qwen3_moe", dict(norm_topk_prob=True, head_dim=64)),
    "qwen2moe": ("qwen2_moe", dict(norm_topk_prob=False, shared_expert_intermediate_size=S)),
    "llama": ("mixtral", dict(num_local_experts=E)),  # Mixtral, as llama.cpp writes it
}
# experts in Q4_K (packed, exact affine), Q8_0 (packed) and Q6_K (no packed expert kernel:
# expanded at load); attention and the shared expert in Q8_0, F16 or F32 elsewhere
QUANT = dict(ffn_gate_exps="Q4_K", ffn_up_exps="Q8_0", ffn_down_exps="Q6_K", attn="Q8_0")


def _hf_random(arch: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    mt, kw = ARCHS[arch]
    moe = {} if mt == "mixtral" else dict(moe_intermediate_size=I, num_experts=E)
    cfg = AutoConfig.for_model(
        mt, hidden_size=H, intermediate_size=I, **moe,
        num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(byte_vocab()[0]), max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6, **kw,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_((0.2 if n.endswith("bias") else 0.06) * torch.randn_like(p))
    return model


def _encode(a: np.ndarray, kind: str) -> tuple[np.ndarray, object]:
    """float32 (..., n) -> (what GGUFWriter.add_tensor takes, raw_dtype)."""
    if kind in ("F32", "F16"):
        return a.astype(np.float32 if kind == "F32" else np.float16), None
    if kind in ("Q4_K", "Q6_K"):
        enc = {"Q4_K": q4_k, "Q6_K": q6_k}[kind](a.reshape(-1, a.shape[-1]))
        return enc.reshape(*a.shape[:-1], -1), Q[kind]
    return gguf.quants.quantize(a, Q[kind]), Q[kind]


def write_moe_gguf(path, arch: str, hf, types: dict) -> dict[str, np.ndarray]:
    """The transformers model `hf` as llama.cpp's converter writes an `arch` GGUF; returns
    {expert parameter: its values as written (dequantized), transformers' layout}."""
    from .test_gguf import llamacpp_permute

    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    c = hf.config
    tokens, merges, ttypes = byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if arch == "qwen3moe":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    if arch != "llama":  # llama.cpp's Mixtral: an expert is feed_forward_length wide
        w.add_expert_feed_forward_length(I)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(S)
    _add_tokenizer(w, "llama-bpe" if arch == "llama" else "qwen2", tokens, ttypes, merges)

    def put(name, a, kind="F32"):
        data, raw = _encode(np.ascontiguousarray(a, np.float32), kind)
        w.add_tensor(name, data, raw_dtype=raw)
        return data.astype(np.float32) if raw is None else gguf.quants.dequantize(data, raw)

    dense = "F32" if arch == "llama" else "F16"  # llama: F32, so the source is the reference
    written = {}

    put("token_embd.weight", sd["model.embed_tokens.weight"], types.get("attn", dense))
    put("output.weight", sd["lm_head.weight"], types.get("attn", dense))
    put("output_norm.weight", sd["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        for g, hf_n in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                        ("attn_output", "o_proj")):  # fmt: skip
            a = sd[f"{p}.self_attn.{hf_n}.weight"]
            if arch == "llama" and g in ("attn_q", "attn_k"):  # llama.cpp's rope row order
                a = llamacpp_permute(a, c.num_attention_heads if g == "attn_q" else
                                     c.num_key_value_heads)  # fmt: skip
            put(f"{b}.{g}.weight", a, types.get("attn", dense))
            if f"{p}.self_attn.{hf_n}.bias" in sd:
                put(f"{b}.{g}.bias", sd[f"{p}.self_attn.{hf_n}.bias"])
        put(f"{b}.attn_norm.weight", sd[f"{p}.input_layernorm.weight"])
        put(f"{b}.ffn_norm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        if arch == "qwen3moe":
            put(f"{b}.attn_q_norm.weight", sd[f"{p}.self_attn.q_norm.weight"])
            put(f"{b}.attn_k_norm.weight", sd[f"{p}.self_attn.k_norm.weight"])
        put(f"{b}.ffn_gate_inp.weight", sd[f"{p}.mlp.gate.weight"])  # llama.cpp keeps F32
        gu, down = sd[f"{p}.mlp.experts.gate_up_proj"], sd[f"{p}.mlp.experts.down_proj"]
        got = {
            g: put(f"{b}.{g}.weight", a, types.get(g, dense))  # (E, out, in)
            for g, a in (("ffn_gate_exps", gu[:, :I]), ("ffn_up_exps", gu[:, I:]),
                         ("ffn_down_exps", down))
        }  # fmt: skip
        written[f"{p}.mlp.experts.gate_up_proj"] = np.concatenate(
            [got["ffn_gate_exps"], got["ffn_up_exps"]], 1
        )
        written[f"{p}.mlp.experts.down_proj"] = got["ffn_down_exps"]
        if arch == "qwen2moe":
            for g, hf_n in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                            ("ffn_down_shexp", "down_proj")):  # fmt: skip
                put(f"{b}.{g}.weight", sd[f"{p}.mlp.shared_expert.{hf_n}.weight"],
                    types.get("attn", dense))  # fmt: skip
            put(f"{b}.ffn_gate_inp_shexp.weight", sd[f"{p}.mlp.shared_expert_gate.weight"][0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(
    scope="module",
    params=[pytest.param(("qwen3moe", "f16"), marks=pytest.mark.long), ("qwen3moe", "quant"),
            ("qwen2moe", "f16"), ("qwen2moe", "quant"), ("llama", "quant")],
)  # fmt: skip
def moe_file(request, tmp_path_factory):
    """(path, arch, "f16" or "quant", transformers model from the file by its own GGUF
    loader, fp32, and the source model the file was written from)."""
    from transformers import AutoModelForCausalLM

    arch, q = request.param
    d = tmp_path_factory.mktemp(f"gguf-{arch}-{q}")
    path = d / f"{arch}.gguf"
    src = _hf_random(arch)
    types = QUANT if q == "quant" else {}
    if arch == "llama":  # transformers' GGUF loader reads no experts in llama files: the
        # reference is the source model with the experts as written (the rest is F32)
        types = {k: v for k, v in types.items() if k != "attn"}
        ref = copy.deepcopy(src)
        sd = ref.state_dict()
        for n, a in write_moe_gguf(path, arch, src, types).items():
            sd[n].copy_(torch.from_numpy(a))
        ref.load_state_dict(sd)
        return path, arch, q, ref, src
    write_moe_gguf(path, arch, src, types)
    # transformers' GGUF config map has no expert_(shared_)feed_forward_length: given here
    extra = dict(moe_intermediate_size=I, norm_topk_prob=ARCHS[arch][1]["norm_topk_prob"])
    if arch == "qwen2moe":
        extra["shared_expert_intermediate_size"] = S
    hf = AutoModelForCausalLM.from_pretrained(
        str(d), gguf_file=path.name, dtype=torch.float32, local_files_only=True, **extra
    ).eval()
    return path, arch, q, hf, src


def test_moe_gguf_matches_transformers_gguf_loader(moe_file):
    path, arch, q, hf, src = moe_file
    ids = np.random.default_rng(3).integers(0, 259, size=24)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    want = hf_greedy(hf, ids, 4)
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(path), backend=backend, dtype="float32", progress=False)
        assert rel_err(m.logits(ids), ref) < 1e-4, backend
        steps = generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=4)
        assert [int(t[0]) for t in steps] == want, backend
    c = m.transformer.config
    o = c.moe
    assert (c.model_type, o.num_experts, o.top_k, o.intermediate_size) == (ARCHS[arch][0], E, K, I)
    assert o.norm_topk is (arch != "qwen2moe")
    assert o.shared_intermediate_size == (S if arch == "qwen2moe" else 0)
    e = m.transformer.layers[0].moe
    if q == "quant":  # Q4_K and Q8_0 experts stay packed with their E axis; Q6_K expands
        assert isinstance(e.gate, QuantizedWeight) and isinstance(e.up, QuantizedWeight)
        assert (e.gate.bits, e.up.bits, tuple(e.gate.weight.shape)) == (4, 8, (E, I, H // 8))
        assert not isinstance(e.down, QuantizedWeight)
        assert any("Q6_K x2" in n for n in m.notes), m.notes
    else:
        assert not isinstance(e.gate, QuantizedWeight) and tuple(e.gate.shape) == (E, I, H)
        # and the file holds the source model (to its F16 rounding): both loaders read the
        # experts, router and shared expert where the source had them
        with torch.no_grad():
            assert rel_err(m.logits(ids), src(torch.tensor(ids)[None]).logits[0].numpy()) < 3e-3


def test_moe_gguf_plans_what_it_loads(moe_file):
    """The planner's weight bytes from the import's shapes are what the loaded model holds:
    every expert, packed or expanded as the loader keeps it."""
    from mlxrun.memory import footprint
    from mlxrun.planning import model_shapes

    path, arch, q, _, _ = moe_file
    cfg, shapes = model_shapes(str(path))
    assert cfg.moe.num_experts == E and cfg.moe.intermediate_size == I
    m = mlxrun.load(str(path), backend="mlx", dtype="float32", progress=False)
    assert footprint(cfg, shapes, "float32", backend="mlx").weight_bytes == (
        m.transformer.weight_bytes()
    )


def test_unsupported_gguf_architecture_names_the_moe_ones(tmp_path):
    from mlxrun.gguf.names import arch_of

    with pytest.raises(MlxrunError) as err:
        arch_of(tmp_path / "x.gguf", "deepseek2")
    msg = str(err.value)
    assert "\n" not in msg and "deepseek2" in msg
    for a in ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "gpt-oss"):
        assert f"{a}," in msg or f"{a} " in msg


def write_gpt_oss_gguf(path, hf) -> dict[str, np.ndarray]:
    """The tiny gpt-oss `hf` as llama.cpp's converter writes it: experts MXFP4 (gate and up
    split from the interleaved gate_up_proj), biases split alike, sinks as attn_sinks.weight,
    YaRN and the window as keys. Returns {expert parameter: its values as written}."""
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    c = hf.config
    rp = c.rope_parameters
    tokens, merges, ttypes = byte_vocab()
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(I)
    w.add_sliding_window(c.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    _add_tokenizer(w, "gpt-4o", tokens, ttypes, merges)

    def put(name, a, kind=None):
        a = np.ascontiguousarray(a, np.float32)
        if kind is None:
            w.add_tensor(name, a)
            return a
        data = gguf.quants.quantize(a, kind)
        w.add_tensor(name, data, raw_dtype=kind)
        return gguf.quants.dequantize(data, kind)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output.weight", sd["lm_head.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    written = {}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        for g, n in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                     ("attn_output", "o_proj")):  # fmt: skip
            put(f"{b}.{g}.weight", sd[f"{p}.self_attn.{n}.weight"])
            put(f"{b}.{g}.bias", sd[f"{p}.self_attn.{n}.bias"])
        put(f"{b}.attn_sinks.weight", sd[f"{p}.self_attn.sinks"])
        put(f"{b}.attn_norm.weight", sd[f"{p}.input_layernorm.weight"])
        put(f"{b}.post_attention_norm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        put(f"{b}.ffn_gate_inp.weight", sd[f"{p}.mlp.router.weight"])
        put(f"{b}.ffn_gate_inp.bias", sd[f"{p}.mlp.router.bias"])
        gu, gub = sd[f"{p}.mlp.experts.gate_up_proj"], sd[f"{p}.mlp.experts.gate_up_proj_bias"]
        mx4 = Q.MXFP4
        g = put(f"{b}.ffn_gate_exps.weight", np.swapaxes(gu[..., 0::2], 1, 2), mx4)
        u = put(f"{b}.ffn_up_exps.weight", np.swapaxes(gu[..., 1::2], 1, 2), mx4)
        d = put(f"{b}.ffn_down_exps.weight", np.swapaxes(sd[f"{p}.mlp.experts.down_proj"], 1, 2),
                mx4)  # fmt: skip
        put(f"{b}.ffn_gate_exps.bias", gub[:, 0::2])
        put(f"{b}.ffn_up_exps.bias", gub[:, 1::2])
        put(f"{b}.ffn_down_exps.bias", sd[f"{p}.mlp.experts.down_proj_bias"])
        both = np.empty_like(gu)
        both[..., 0::2], both[..., 1::2] = np.swapaxes(g, 1, 2), np.swapaxes(u, 1, 2)
        written[f"{p}.mlp.experts.gate_up_proj"] = both
        written[f"{p}.mlp.experts.down_proj"] = np.swapaxes(d, 1, 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def gpt_oss_random():
    """A tiny random GptOssForCausalLM in fp32: windows of 8 on alternate layers, YaRN
    past 64 positions, biases and sinks randomised so they matter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "gpt_oss", hidden_size=H, intermediate_size=I, num_local_experts=E,
        num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=len(byte_vocab()[0]),
        max_position_embeddings=256, sliding_window=8, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64},
    )  # fmt: skip
    torch.manual_seed(1)
    src = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, prm in src.named_parameters():
            if "norm" in n:
                prm.copy_(1 + 0.2 * torch.randn_like(prm))
            else:
                prm.copy_((0.2 if n.endswith(("bias", "sinks")) else 0.06) * torch.randn_like(prm))
    return src


def test_gpt_oss_gguf_mxfp4_experts_load_as_stored(tmp_path):
    """gpt-oss as llama.cpp writes it, MXFP4 experts: kept as MLX's mxfp4 (the file's codes
    and scales re-laid, never re-quantized); sinks, biases, alternating windows (8, so the
    24-token prompt crosses it) and YaRN read from the file. Reference: GptOssForCausalLM
    holding the experts' written values (transformers' GGUF loader reads no llama.cpp
    gpt-oss experts), logits within 1e-4 and greedy tokens equal on torch-cpu and MLX."""
    src = gpt_oss_random()
    path = tmp_path / "gpt-oss.gguf"
    ref = copy.deepcopy(src)
    sd = ref.state_dict()
    for n, a in write_gpt_oss_gguf(path, src).items():
        sd[n].copy_(torch.from_numpy(a))
    ref.load_state_dict(sd)
    ids = np.random.default_rng(4).integers(0, 259, size=24)
    with torch.no_grad():
        want_logits = ref(torch.tensor(ids)[None]).logits[0].numpy()
        assert rel_err(want_logits, src(torch.tensor(ids)[None]).logits[0].numpy()) > 1e-3
    want = hf_greedy(ref, ids, 4)
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    stored = np.asarray(raw["blk.0.ffn_down_exps.weight"].data).reshape(-1, 17)
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(path), backend=backend, dtype="float32", progress=False)
        c = m.transformer.config
        assert (c.model_type, c.attention_sinks, c.layer_windows) == ("gpt_oss", True, (8, None))
        e = m.transformer.layers[0].moe
        assert (e.down.mode, e.down.group_size) == ("mxfp4", 32)
        s = e.down.scales
        s = s.numpy() if isinstance(s, torch.Tensor) else np.array(s)
        assert np.array_equal(s.reshape(-1), stored[:, 0])  # the file's E8M0 bytes
        assert rel_err(m.logits(ids), want_logits) < 1e-4, backend
        steps = generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=4)
        assert [int(t[0]) for t in steps] == want, backend


def test_mxfp4_relayout_is_exact():
    """GGUF MXFP4 blocks -> MLX mxfp4 words and scales: the numpy reference (bit-exact with
    mx.dequantize) decodes them to gguf's own dequantization, edge scales included."""
    from mlxrun.quant import gguf_blocks as gb
    from mlxrun.quant.formats import QuantSpec
    from mlxrun.quant.reference import dequantize

    from .test_gguf_blocks import random_rows

    raw = random_rows("MXFP4", 16, 8, 5, True)
    w, s = gb.mxfp4_to_mlx(raw)
    got = dequantize(w, s, None, QuantSpec("mxfp4", 4, 32), dtype="float32")
    with np.errstate(over="ignore"):  # the edge scales overflow to inf in both decodes
        want = gguf.quants.dequantize(raw, Q.MXFP4)
    np.testing.assert_array_equal(got, want)
