"""GGUF import: exact dequantization against gguf / transformers / MLX, config and error
messages, and the atomic directory conversion (the tokenizer: test_gguf_tokenizer.py)."""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import gguf
import numpy as np
import pytest

from mlxrun.config import ModelConfig
from mlxrun.convert import convert
from mlxrun.errors import MlxrunError
from mlxrun.gguf import read_gguf
from mlxrun.weights import bf16_bits, load_safetensors

from .conftest import REAL, needs_real
from .test_gguf_tokenizer import spm_vocab

Q = gguf.GGMLQuantizationType

# ------------------------------------------------------------------------------ test helpers


def canonical_dequant(tensors, module: str) -> np.ndarray:
    """float32 [out, in] from the canonical affine tensors: unpack q (LSB first), scales*q+b."""
    w = tensors[f"{module}.weight"].data
    scales = tensors[f"{module}.scales"].data.astype(np.float32)
    biases = tensors[f"{module}.biases"].data.astype(np.float32)
    n_in = scales.shape[1] * 32
    bits = w.shape[1] * 32 // n_in
    b = np.ascontiguousarray(w).view(np.uint8)  # little-endian words: value order = byte order
    if bits == 8:
        q = b.astype(np.float32)
    else:
        q = np.stack([b & 15, b >> 4], axis=-1).reshape(w.shape[0], n_in).astype(np.float32)
    return np.repeat(scales, 32, axis=1) * q + np.repeat(biases, 32, axis=1)


def maps_file(a: np.ndarray) -> bool:
    """Whether `a` is a view of a memory-mapped file (not a copy in RAM)."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to q/k (HF -> GGUF)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


DIMS = dict(hidden=64, heads=4, kv=2, head_dim=16, ff=96, layers=2)
# per-layer GGUF types: layer 0 mostly 4-bit, layer 1 mixes dense and 8-bit in q/k
LAYER_TYPES = [
    {
        "attn_q": Q.Q4_0,
        "attn_k": Q.Q4_0,
        "attn_v": Q.Q8_0,
        "attn_output": Q.F16,
        "ffn_gate": Q.Q4_1,
        "ffn_up": Q.Q4_0,
        "ffn_down": Q.Q4_0,
    },
    {
        "attn_q": Q.F16,
        "attn_k": Q.BF16,
        "attn_v": Q.F32,
        "attn_output": Q.Q4_0,
        "ffn_gate": Q.Q4_0,
        "ffn_up": Q.Q4_1,
        "ffn_down": Q.Q8_0,
    },
]
HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def add_tensor(w: gguf.GGUFWriter, name: str, a: np.ndarray, qtype) -> None:
    """Store float32 HF-shaped `a` ([out, in]) as GGUF type `qtype`."""
    if qtype == Q.F32:
        w.add_tensor(name, a.astype(np.float32))
    elif qtype == Q.F16:
        w.add_tensor(name, a.astype(np.float16))
    elif qtype == Q.BF16:
        # raw bytes [out, 2*in]; the writer derives the element shape from the byte shape
        w.add_tensor(name, bf16_bits(a).view(np.uint8).reshape(a.shape[0], -1), raw_dtype=Q.BF16)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_synthetic(path: Path, *, arch: str = "llama", bad_type=None) -> dict[str, np.ndarray]:
    """A tiny llama GGUF (q/k permuted like llama.cpp) -> the HF-layout float32 weights."""
    d = DIMS
    tokens, scores, types, _ = spm_vocab()
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(d["layers"])
    w.add_context_length(2048)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["ff"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv"])
    w.add_rope_dimension_count(d["head_dim"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    hf = {}

    def mat(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) * 0.05).astype(np.float32)

    emb = mat(len(tokens), d["hidden"])
    add_tensor(w, "token_embd.weight", emb, Q.F16)
    hf["model.embed_tokens.weight"] = emb
    shapes = {
        "attn_q": (d["heads"] * d["head_dim"], d["hidden"]),
        "attn_k": (d["kv"] * d["head_dim"], d["hidden"]),
        "attn_v": (d["kv"] * d["head_dim"], d["hidden"]),
        "attn_output": (d["hidden"], d["heads"] * d["head_dim"]),
        "ffn_gate": (d["ff"], d["hidden"]),
        "ffn_up": (d["ff"], d["hidden"]),
        "ffn_down": (d["hidden"], d["ff"]),
    }
    for i, lt in enumerate(LAYER_TYPES):
        for name, qtype in lt.items():
            a = mat(*shapes[name])
            hf[f"model.layers.{i}.{HF[name]}.weight"] = a
            stored = a
            if name == "attn_q":
                stored = llamacpp_permute(a, d["heads"])
            elif name == "attn_k":
                stored = llamacpp_permute(a, d["kv"])
            if bad_type is not None and (i, name) == (1, "ffn_down"):
                shape = gguf.quant_shape_to_byte_shape((a.shape[0], 256), bad_type)
                w.add_tensor(
                    f"blk.{i}.{name}.weight", np.zeros(shape, np.uint8), raw_dtype=bad_type
                )
                continue
            add_tensor(w, f"blk.{i}.{name}.weight", stored, qtype)
        for name, hname in (
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
        ):
            a = (1 + 0.1 * rng.standard_normal(d["hidden"])).astype(np.float32)
            w.add_tensor(f"blk.{i}.{name}.weight", a)
            hf[f"model.layers.{i}.{hname}.weight"] = a
    a = np.ones(d["hidden"], np.float32)
    w.add_tensor("output_norm.weight", a)
    hf["model.norm.weight"] = a
    out = mat(len(tokens), d["hidden"])
    add_tensor(w, "output.weight", out, Q.Q8_0)
    hf["lm_head.weight"] = out
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def expected(a: np.ndarray, qtype) -> np.ndarray:
    """What a lossless import must give for HF weight `a` stored as `qtype` (float32)."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        # quantization is per row, so it commutes with llama.cpp's row permutation
        return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
    if qtype == Q.F16:
        return a.astype(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)
    return a


# ------------------------------------------------------------------------------- real model


@needs_real
def test_real_config(real):
    c = real.config
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["max_position_embeddings"]) == (49152, 8192)
    assert c["rope_theta"] == 100000.0 and c["rms_norm_eps"] == 1e-5
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in real.tensors
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert c["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    mc = ModelConfig.from_dict(c)
    assert mc.quantization == c["quantization"] and mc.eos_token_id == (2,)
    norm = real.tensors["model.layers.0.input_layernorm.weight"]
    assert norm.dtype == "F32" and maps_file(norm.data)
    assert maps_file(real.tensors["model.norm.weight"].data)
    assert not maps_file(real.tensors["model.layers.0.mlp.up_proj.weight"].data)  # repacked
    emb = real.tensors
    assert emb["model.embed_tokens.weight"].dtype == "U32"
    assert emb["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)
    assert emb["model.layers.3.mlp.down_proj.weight"].shape == (576, 1536 * 4 // 32)
    assert emb["model.layers.3.mlp.down_proj.scales"].shape == (576, 1536 // 32)


@needs_real
@pytest.mark.slow
def test_real_dequant_matches_gguf_and_mlx(real):
    """Layer 0 and the Q8_0 embedding: ours == gguf's dequantize (un-permuted with
    transformers' reverse permutation) == mx.dequantize of our packed tensors."""
    import mlx.core as mx
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    unperm = LlamaTensorProcessor()._reverse_permute_weights
    raw = {t.name: t for t in gguf.GGUFReader(REAL).tensors}
    names = {"token_embd": "model.embed_tokens"}
    names.update({f"blk.0.{k}": f"model.layers.0.{v}" for k, v in HF.items()})
    seen = set()
    for g, module in names.items():
        t = raw[f"{g}.weight"]
        seen.add(t.tensor_type.name)
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        if g.endswith("attn_q"):
            ref = unperm(ref, 9, 9)
        elif g.endswith("attn_k"):
            ref = unperm(ref, 9, 3)
        ours = canonical_dequant(real.tensors, module)
        np.testing.assert_array_equal(ours, ref, err_msg=module)
        bits = 8 if t.tensor_type == Q.Q8_0 else 4
        m = mx.dequantize(
            mx.array(np.asarray(real.tensors[f"{module}.weight"].data)),
            mx.array(real.tensors[f"{module}.scales"].float32()),
            mx.array(real.tensors[f"{module}.biases"].float32()),
            group_size=32,
            bits=bits,
        )
        np.testing.assert_array_equal(np.array(m), ref, err_msg=f"mlx {module}")
    assert seen == {"Q4_1", "Q8_0"}


@needs_real
@pytest.mark.slow
def test_real_matches_transformers_loader(real):
    """Every parameter equals what transformers' GGUF loader (dequantize + un-permute) makes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = {k: v for k, v in real.config.items() if not k.startswith("quantization")}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    ref = load_gguf_checkpoint(str(REAL), return_tensors=True, model_to_load=model)
    for k in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
        "head_dim",
        "rope_theta",
        "bos_token_id",
        "tie_word_embeddings",
    ):
        assert ref["config"][k] == real.config[k], k
    theirs = ref["tensors"]
    ours = {}
    for name, t in real.tensors.items():
        if name.endswith(".weight"):
            module = name[: -len(".weight")]
            ours[name] = (
                canonical_dequant(real.tensors, module) if t.dtype == "U32" else t.float32()
            )
    assert set(ours) == set(theirs)
    for name, a in ours.items():
        np.testing.assert_array_equal(a, theirs[name].numpy(), err_msg=name)


# -------------------------------------------------------------------------- synthetic files


def test_synthetic_exact(synthetic):
    """Q4_0 / Q4_1 / Q8_0 / F16 / BF16 / F32, q/k un-permuted, all exact; quantization block."""
    import mlx.core as mx

    path, hf = synthetic
    m = read_gguf(path)
    types = {"model.embed_tokens": Q.F16, "lm_head": Q.Q8_0}
    for i, lt in enumerate(LAYER_TYPES):
        types.update({f"model.layers.{i}.{HF[k]}": v for k, v in lt.items()})
    for module, qtype in types.items():
        want = expected(hf[f"{module}.weight"], qtype)
        t = m.tensors[f"{module}.weight"]
        if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            assert t.dtype == "U32" and m.tensors[f"{module}.scales"].dtype == "F16"
            got = canonical_dequant(m.tensors, module)
            bits = 8 if qtype == Q.Q8_0 else 4
            mx_got = mx.dequantize(
                mx.array(t.data),
                mx.array(m.tensors[f"{module}.scales"].float32()),
                mx.array(m.tensors[f"{module}.biases"].float32()),
                group_size=32,
                bits=bits,
            )
            np.testing.assert_array_equal(np.array(mx_got), want, err_msg=module)
        else:
            assert t.dtype == qtype.name, module
            got = t.float32()
        np.testing.assert_array_equal(got, want, err_msg=module)
    for name in ("model.layers.1.input_layernorm.weight", "model.norm.weight"):
        np.testing.assert_array_equal(m.tensors[name].data, hf[name])
    assert set(m.tensors) == {
        f"{k}.{s}"
        for k, q in types.items()
        for s in (("weight", "scales", "biases") if q in (Q.Q4_0, Q.Q4_1, Q.Q8_0) else ("weight",))
    } | {k for k in hf if "norm" in k}

    q8 = {"group_size": 32, "bits": 8, "mode": "affine"}
    assert m.config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": False,
        "model.layers.0.self_attn.v_proj": q8,
        "model.layers.0.self_attn.o_proj": False,
        "model.layers.1.self_attn.q_proj": False,
        "model.layers.1.self_attn.k_proj": False,
        "model.layers.1.self_attn.v_proj": False,
        "model.layers.1.mlp.down_proj": q8,
        "lm_head": q8,
    }
    c = m.config
    assert c["tie_word_embeddings"] is False and c["num_key_value_heads"] == 2
    assert c["rope_theta"] == 50000.0 and c["rms_norm_eps"] == 1e-6
    assert ModelConfig.from_dict(c).head_dim == 16
    assert m.generation_config == {"bos_token_id": 1, "eos_token_id": 2}


def test_q4_0_extreme_values():
    """Q4_0 biases -8*d are exact fp16 even for large and subnormal scales."""
    from mlxrun.quant.gguf_blocks import to_affine

    rng = np.random.default_rng(1)
    a = (rng.standard_normal((4, 64)) * np.array([[1e3], [1e-6], [3e-8], [1.0]])).astype(np.float32)
    for qtype in (Q.Q4_0, Q.Q8_0):
        blocks = gguf.quants.quantize(a, qtype)
        w, s, b = to_affine(blocks, qtype.name)
        t = {
            "m.weight": type("T", (), {"data": w})(),
            "m.scales": type("T", (), {"data": s})(),
            "m.biases": type("T", (), {"data": b})(),
        }
        np.testing.assert_array_equal(
            canonical_dequant(t, "m"), gguf.quants.dequantize(blocks, qtype)
        )


def test_llama3_rope_freqs(tmp_path):
    """llama.cpp's rope_freqs tensor (Llama 3.1 scaling) becomes HF llama3 rope_scaling."""
    dim, theta = 128, 500000.0
    hs = dict(factor=8.0, low=1.0, high=4.0, old=8192)
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    factors = []  # llama.cpp convert_hf_to_gguf: divisor per frequency
    for f in inv:
        wl = 2 * math.pi / f
        if wl < hs["old"] / hs["high"]:
            factors.append(1.0)
        elif wl > hs["old"] / hs["low"]:
            factors.append(hs["factor"])
        else:
            s = (hs["old"] / wl - hs["low"]) / (hs["high"] - hs["low"])
            factors.append(1 / ((1 - s) / hs["factor"] + s))
    path = tmp_path / "r.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for fn, v in (
        (w.add_block_count, 1),
        (w.add_embedding_length, dim),
        (w.add_head_count, 1),
        (w.add_feed_forward_length, 64),
        (w.add_rope_freq_base, theta),
    ):
        fn(v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.add_tensor("token_embd.weight", np.zeros((2, dim), np.float16))
    w.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = read_gguf(path)
    rs = m.config["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["factor"] == 8.0
    assert (rs["low_freq_factor"], rs["high_freq_factor"]) == (1.0, 4.0)
    assert rs["original_max_position_embeddings"] == 8192
    np.testing.assert_allclose(
        ModelConfig.from_dict(m.config).rope_freqs(), inv / np.array(factors), rtol=1e-6
    )
    assert "rope_freqs.weight" not in m.tensors


# ---------------------------------------------------------------------------------- errors


def test_errors(tmp_path, synthetic):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(MlxrunError, match="not a GGUF file"):
        read_gguf(junk)
    cut = tmp_path / "cut.gguf"
    for n in (30, 4000, 20000):
        cut.write_bytes(synthetic[0].read_bytes()[:n])
        with pytest.raises(MlxrunError, match="corrupt or truncated GGUF"):
            read_gguf(cut)
    with pytest.raises(MlxrunError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf")

    g = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(g), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        MlxrunError, match=r"'gpt2' is not supported: mlxrun reads llama, qwen2, qwen3"
    ):
        read_gguf(g)

    for bad in (Q.IQ2_XXS, Q.TQ1_0):
        p = tmp_path / f"{bad.name}.gguf"
        write_synthetic(p, bad_type=bad)
        with pytest.raises(MlxrunError) as e:
            read_gguf(p)
        msg = str(e.value)
        assert "blk.1.ffn_down.weight" in msg and bad.name in msg and "\n" not in msg
        assert "reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K" in msg
        assert "IQ4_NL, IQ4_XS, MXFP4" in msg and "quantize" not in msg


# --------------------------------------------------------------------------------- convert


def test_convert_roundtrip(tmp_path, synthetic):
    path, _ = synthetic
    m = read_gguf(path)
    out = tmp_path / "out"
    out.mkdir()  # an empty directory may be reused
    convert(str(path), str(out), progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    back, meta = load_safetensors(out / "model.safetensors")
    assert set(back) == set(m.tensors) and meta == {"format": "mlx"}
    for k, t in m.tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        np.testing.assert_array_equal(back[k].data, t.data, err_msg=k)
    assert json.loads((out / "config.json").read_text()) == m.config
    assert json.loads((out / "tokenizer_config.json").read_text()) == m.tokenizer_config
    assert json.loads((out / "generation_config.json").read_text()) == m.generation_config
    assert (out / "tokenizer.json").read_text() == m.tokenizer_json
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left

    with pytest.raises(MlxrunError, match="not empty"):
        convert(str(path), str(out), progress=False)


def test_convert_failure_leaves_nothing(tmp_path, synthetic, monkeypatch):
    import mlxrun.convert as mc

    bad = tmp_path / "src" / "bad.gguf"
    bad.parent.mkdir()
    write_synthetic(bad, bad_type=Q.IQ2_XXS)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(MlxrunError, match="IQ2_XXS"):
        convert(str(bad), str(dest / "out"), progress=False)
    assert list(dest.iterdir()) == []

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mc, "save_safetensors", boom)
    with pytest.raises(MlxrunError, match="No space left"):
        convert(str(synthetic[0]), str(dest / "out"), progress=False)
    assert list(dest.iterdir()) == []
