"""Model footprints (mlxrun/model_footprint.py) against parameter counts worked out by
hand, mx.quantize's packed sizes and real safetensors headers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError
from mlxrun.memory import config_shapes, footprint, header_shapes
from mlxrun.weights import Tensor, bf16_bits, save_safetensors

from ._memory import (
    L_BF16,
    L_INT4,
    L_KV,
    L_NORMS,
    L_PARAMS,
    LLAMA3_8B,
    S_KV,
    S_NORMS,
    S_PARAMS,
    SMOLLM2,
    Q,
)


def test_hand_counts_match_the_published_sizes():
    assert L_PARAMS == 8_030_261_248  # Llama-3-8B's parameter count
    assert S_PARAMS == 134_515_008  # SmolLM2-135M's
    assert L_KV == 131072 and S_KV == 23040


def test_footprint_llama3_8b():
    fp = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16")
    assert fp.n_params == L_PARAMS
    assert fp.weight_bytes == fp.dense_weight_bytes == L_BF16 == 16_060_522_496
    assert fp.kv_bytes_per_token == L_KV
    assert fp.int4_weight_bytes == L_INT4 == 4_517_404_672
    assert fp.kv_bytes(8192, batch=2) == 2 * 8192 * 131072
    q4 = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16", Q("affine", 4, 64))
    assert q4.weight_bytes == L_INT4 and q4.n_params == L_PARAMS
    assert abs(q4.bits_per_weight - 4.5) < 1e-3
    # mxfp4: 4-bit values + one 1-byte E8M0 scale per 32 = 17/32 byte; no biases
    mx4 = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16", Q("mxfp4", 4, 32))
    assert mx4.weight_bytes == (L_PARAMS - L_NORMS) * 17 // 32 + L_NORMS * 2
    # fp32 compute doubles the dense bytes and the KV cache
    f32 = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "float32")
    assert f32.weight_bytes == L_PARAMS * 4 and f32.kv_bytes_per_token == 2 * L_KV


def test_footprint_smollm2_tied_and_group_divisibility():
    shapes = config_shapes(SMOLLM2)
    assert "lm_head.weight" not in shapes
    fp = footprint(SMOLLM2, shapes, "bf16")
    assert fp.weight_bytes == S_PARAMS * 2 and fp.kv_bytes_per_token == S_KV
    # a tied checkpoint that also stores lm_head does not count it twice
    with_head = dict(shapes, **{"lm_head.weight": ((49152, 576), "BF16")})
    assert footprint(SMOLLM2, with_head, "bf16").weight_bytes == S_PARAMS * 2
    # g64 divides 576 and 1536: every matrix packs (4/8 + 4/64 byte per weight)
    q64 = footprint(SMOLLM2, shapes, "bfloat16", Q("affine", 4, 64))
    assert q64.weight_bytes == (S_PARAMS - S_NORMS) * 9 // 16 + S_NORMS * 2
    # g128 divides only down_proj's in-dim 1536 (576 = 4.5 x 128): the rest stays bf16
    q128 = footprint(SMOLLM2, shapes, "bfloat16", Q("affine", 4, 128))
    down = 576 * 1536
    packed = 30 * (down // 2 + 2 * (down // 128) * 2)
    assert q128.weight_bytes == (S_PARAMS - 30 * down) * 2 + packed


def test_int4_estimate_keeps_indivisible_matrices_dense():
    cfg = ModelConfig.from_dict(
        dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=3, num_key_value_heads=1, vocab_size=100,
             tie_word_embeddings=False)
    )  # fmt: skip
    fp = footprint(cfg, config_shapes(cfg), "bfloat16")
    # only down_proj [96, 128] has an in-dim divisible by 64; everything else stays bf16
    params = 2 * 100 * 96 + 2 * 96 * 96 + 2 * 32 * 96 + 3 * 128 * 96 + 3 * 96
    assert fp.n_params == params
    assert fp.int4_weight_bytes == (params - 96 * 128) * 2 + 96 * 128 * 9 // 16


def test_unknown_dtype():
    with pytest.raises(MlxrunError, match="unknown dtype"):
        footprint(SMOLLM2, config_shapes(SMOLLM2), "int8")


# --- checkpoints on disk ---

TINY = ModelConfig.from_dict(
    dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
         tie_word_embeddings=True)
)  # fmt: skip


def tiny_tensors() -> dict[str, Tensor]:
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (256, 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                   p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                   p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64),
                   p + "mlp.down_proj.weight": (64, 128), p + "input_layernorm.weight": (64,),
                   p + "post_attention_layernorm.weight": (64,)}  # fmt: skip
    return {n: Tensor("BF16", bf16_bits(rng.standard_normal(s).astype(np.float32)))
            for n, s in shapes.items()}  # fmt: skip


def test_header_shapes_file_and_sharded_dir(tmp_path):
    tensors = tiny_tensors()
    want = {n: (t.shape, "BF16") for n, t in tensors.items()}
    save_safetensors(tmp_path / "one.safetensors", tensors)
    assert header_shapes(tmp_path / "one.safetensors") == want
    shard = tmp_path / "sharded"
    shard.mkdir()
    names = list(tensors)
    parts = {"model-00001-of-00002.safetensors": names[:7],
             "model-00002-of-00002.safetensors": names[7:]}  # fmt: skip
    for fname, part in parts.items():
        save_safetensors(shard / fname, {n: tensors[n] for n in part})
    index = {"weight_map": {n: f for f, part in parts.items() for n in part}}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    (shard / "stray.safetensors").write_bytes(b"")  # not in the index: never opened
    assert header_shapes(shard) == want
    assert config_shapes(TINY) == want  # the layout config_shapes assumes is the real one
    (tmp_path / "empty").mkdir()
    with pytest.raises(MlxrunError, match="no .safetensors"):
        header_shapes(tmp_path / "empty")


def test_footprint_from_header_matches_mx_quantize(tmp_path):
    import mlx.core as mx

    tensors = tiny_tensors()
    save_safetensors(tmp_path / "model.safetensors", tensors)
    shapes = header_shapes(tmp_path / "model.safetensors")
    fp = footprint(TINY, shapes, "bfloat16")
    assert fp.weight_bytes == fp.stored_bytes == sum(t.nbytes for t in tensors.values())
    f32 = footprint(TINY, shapes, "float32")  # the loader's copies double, not the file
    assert f32.weight_bytes == 2 * f32.stored_bytes == 2 * fp.stored_bytes
    assert fp.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    for mode, bits, group in [("affine", 4, 32), ("affine", 8, 64), ("affine", 3, 32),
                              ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]:  # fmt: skip
        want = 0
        for t in tensors.values():
            if t.data.ndim == 2:  # every in-dim here (64, 128) divides by the group
                w = mx.array(t.float32()).astype(mx.bfloat16)
                want += sum(a.nbytes for a in mx.quantize(w, group_size=group, bits=bits,
                                                         mode=mode))  # fmt: skip
            else:
                want += t.nbytes
        got = footprint(TINY, shapes, "bfloat16", Q(mode, bits, group))
        assert got.weight_bytes == want, (mode, bits, group)


def test_footprint_of_a_quantized_checkpoint(tmp_path):
    import mlx.core as mx

    tensors, stored = tiny_tensors(), {}
    for name, t in tensors.items():
        if t.data.ndim == 2:
            w = mx.array(t.float32()).astype(mx.bfloat16)
            wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
            p = name[: -len(".weight")]
            stored[name] = Tensor("U32", np.array(wq))
            stored[p + ".scales"] = Tensor("BF16", bf16_bits(np.array(scales.astype(mx.float32))))
            stored[p + ".biases"] = Tensor("BF16", bf16_bits(np.array(biases.astype(mx.float32))))
        else:
            stored[name] = t
    save_safetensors(tmp_path / "model.safetensors", stored)
    cfg = TINY.replace(quantization={"group_size": 32, "bits": 4})
    fp = footprint(cfg, header_shapes(tmp_path / "model.safetensors"), "bfloat16")
    dense = footprint(TINY, {n: (t.shape, "BF16") for n, t in tensors.items()}, "bfloat16")
    assert fp.weight_bytes == fp.stored_bytes == sum(t.nbytes for t in stored.values())
    assert fp.load_quantized == 0  # kept as stored
    assert fp.n_params == dense.n_params == sum(t.data.size for t in tensors.values())
    assert fp.int4_weight_bytes == dense.int4_weight_bytes
    assert fp.label == "affine 4-bit g32"
    # --quant on a quantized checkpoint follows the loader (build.py). Another format with a
    # group size asked re-quantizes every layer: the dense model quantized
    shapes = header_shapes(tmp_path / "model.safetensors")
    bf16 = {n: (t.shape, "BF16") for n, t in tensors.items()}
    requant = footprint(cfg, shapes, "bfloat16", Q("affine", 8, 64), group_asked=True)
    want = footprint(TINY, bf16, "bfloat16", Q("affine", 8, 64))
    assert (requant.weight_bytes, requant.label) == (want.weight_bytes, "affine 8-bit g64")
    assert requant.load_quantized == 256 * 64  # the largest matrix, the embedding
    # ... with none asked, in the checkpoint's group size (32)
    requant = footprint(cfg, shapes, "bfloat16", Q("affine", 8, 64))
    want = footprint(TINY, bf16, "bfloat16", Q("affine", 8, 32))
    assert (requant.weight_bytes, requant.label) == (want.weight_bytes, "affine 8-bit g32")
    # the stored format itself (4-bit) with no group asked: every layer kept as stored
    kept = footprint(cfg, shapes, "bfloat16", Q("affine", 4, 64))
    assert kept.weight_bytes == fp.weight_bytes and kept.load_quantized == 0
    # ... and with g64 asked, re-quantized to g64
    regroup = footprint(cfg, shapes, "bfloat16", Q("affine", 4, 64), group_asked=True)
    want = footprint(TINY, bf16, "bfloat16", Q("affine", 4, 64))
    assert regroup.weight_bytes == want.weight_bytes
    with pytest.raises(MlxrunError, match="no 'quantization' entry"):
        footprint(TINY, header_shapes(tmp_path / "model.safetensors"), "bfloat16")


def smollm2_q4_shapes() -> dict:
    """SmolLM2-135M as `mlxrun convert --model smollm2` stores it: layers affine 4-bit g32,
    the (tied) embedding 8-bit g32, uint32 weights with F16 scales and biases; F32 norms."""
    out = {}
    for name, (shape, _) in config_shapes(SMOLLM2).items():
        if len(shape) == 1:
            out[name] = (shape, "F32")
            continue
        p, (rows, cols) = name[: -len(".weight")], shape
        bits = 8 if p == "model.embed_tokens" else 4
        out[name] = ((rows, cols * bits // 32), "U32")
        out[p + ".scales"] = out[p + ".biases"] = ((rows, cols // 32), "F16")
    return out


SMOL_Q4 = SMOLLM2.replace(
    quantization={"group_size": 32, "bits": 4, "mode": "affine",
                  "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}}
)  # fmt: skip
S_MATS = S_PARAMS - S_NORMS - 49152 * 576  # the 30 layers' matrices


def test_footprint_smollm2_q4_with_quant_int4_on_mlx():
    # as stored, float32 on MLX: 4-bit layers (1/2 byte + 2 fp32 values per 32 weights =
    # 3/4 byte a weight), the 8-bit embedding (1 + 1/4 byte), fp32 norms
    fp = footprint(SMOL_Q4, smollm2_q4_shapes(), "float32", None, "mlx")
    assert fp.weight_bytes == S_MATS * 3 // 4 + 49152 * 576 * 5 // 4 + S_NORMS * 4
    # --quant int4: the loader keeps the 210 4-bit layers as stored and re-quantizes only the
    # embedding, to 4 bits in the checkpoint's group of 32 (not int4's default 64): 96.32
    # MiB, what mlxrun.load(..., quant="int4") holds (Transformer.weight_bytes)
    q4 = footprint(SMOL_Q4, smollm2_q4_shapes(), "float32", Q("affine", 4, 64), "mlx")
    assert q4.weight_bytes == (S_MATS + 49152 * 576) * 3 // 4 + S_NORMS * 4 == 101_000_448
    assert q4.load_quantized == 49152 * 576 and q4.label == "affine 4-bit g32"
