"""The memory model against numbers worked out by hand, mx.quantize's packed sizes and real
safetensors headers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxrun.config import ModelConfig
from mlxrun.device_memory import estimate_apple_working_set
from mlxrun.errors import MlxrunError
from mlxrun.memory import (
    DeviceMemory,
    GiB,
    MiB,
    check_fits,
    config_shapes,
    footprint,
    format_plan,
    header_shapes,
    make_plan,
    probe_device,
    workspace_bytes,
)
from mlxrun.quant.formats import QuantSpec
from mlxrun.weights import Tensor, bf16_bits, save_safetensors


def Q(mode: str, bits: int, group_size: int) -> QuantSpec:
    return QuantSpec(mode, bits, group_size).validate()


LLAMA3_8B = ModelConfig.from_dict(
    dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
         max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
)  # fmt: skip
SMOLLM2 = ModelConfig.from_dict(
    dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
)  # fmt: skip

# --- parameter counts by hand ---
# Llama-3-8B: embedding + lm_head 128256 x 4096 each; per layer q,o 4096x4096, k,v 1024x4096,
# gate,up,down 14336x4096, two 4096 norms; one final norm.
L_LAYER = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096
L_PARAMS = 2 * 128256 * 4096 + 32 * L_LAYER + 4096
L_NORMS = 32 * 2 * 4096 + 4096  # everything else is a 2-D matrix with in-dim 4096 or 14336
# SmolLM2-135M: tied 49152 x 576 embedding; q,o 576x576, k,v 192x576 (3 kv heads x 64),
# gate,up,down 1536x576, two 576 norms; final norm.
S_LAYER = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576 + 2 * 576
S_PARAMS = 49152 * 576 + 30 * S_LAYER + 576
S_NORMS = 30 * 2 * 576 + 576

L_BF16 = L_PARAMS * 2
# int4 = affine 4-bit g64 with bf16 scale and bias per 64 weights: 4/8 + 2*2/64 = 9/16 byte
L_INT4 = (L_PARAMS - L_NORMS) * 9 // 16 + L_NORMS * 2
L_KV = 32 * 2 * 8 * 128 * 2  # layers x (k, v) x kv_heads x head_dim x bf16
S_KV = 30 * 2 * 3 * 64 * 2


def test_hand_counts_match_the_published_sizes():
    assert L_PARAMS == 8_030_261_248  # Llama-3-8B's parameter count
    assert S_PARAMS == 134_515_008  # SmolLM2-135M's
    assert L_KV == 131072 and S_KV == 23040


# --- simulated devices ---
# Apple: 3 GiB in use by other processes; the working set macOS reports is 2/3 of RAM up to
# 36 GiB and 3/4 above (llama.cpp logs: 32 GB -> 21845.34 MB, 64 GB -> 48 GB, 96 GB -> 72 GB).
APPLE_WS = {8: 8 * GiB * 2 // 3, 16: 16 * GiB * 2 // 3, 36: 24 * GiB, 64: 48 * GiB,
            128: 96 * GiB, 192: 144 * GiB}  # fmt: skip


def apple(ram: int, used: int = 3) -> DeviceMemory:
    return DeviceMemory("apple", f"Apple {ram} GB", ram * GiB, (ram - used) * GiB, True,
                        APPLE_WS[ram], sources={"total_bytes": "simulated"})  # fmt: skip


GPU24 = DeviceMemory("cuda", "RTX 4090", 24 * GiB, 23 * GiB + 512 * MiB, False)
GPU80 = DeviceMemory("cuda", "H100 80GB", 80 * GiB, 79 * GiB, False)
CPU = DeviceMemory("cpu", "Xeon", 64 * GiB, 50 * GiB, False)

# budget = min(working set, available - max(2 GiB, 5% RAM)) on Apple;
# free - max(512 MiB, 3% VRAM) on CUDA; MemAvailable - max(1 GiB, 5% RAM) on CPU.
BUDGETS = {
    "apple8": (apple(8), 3 * GiB),  # 5 GiB available - 2 GiB < 5.33 GiB working set
    "apple16": (apple(16), 16 * GiB * 2 // 3),  # 10.67 GiB < 13 - 2
    "apple16_busy": (apple(16, used=8), 6 * GiB),  # 8 - 2 < 10.67
    "apple36": (apple(36), 24 * GiB),  # < 33 - 2 (5% = 1.8 GiB < 2 GiB)
    "apple64": (apple(64), 48 * GiB),  # < 61 - 3.2
    "apple128": (apple(128), 96 * GiB),  # < 125 - 6.4
    "apple192": (apple(192), 144 * GiB),  # < 189 - 9.6
    "gpu24": (GPU24, 23 * GiB + 512 * MiB - 24 * GiB * 3 // 100),  # 3% = 737 MiB > 512 MiB
    "gpu80": (GPU80, 79 * GiB - 80 * GiB * 3 // 100),
    "cpu": (CPU, 50 * GiB - 64 * GiB * 5 // 100),
}


@pytest.mark.parametrize("key", BUDGETS)
def test_budget_rule(key):
    dev, want = BUDGETS[key]
    assert dev.budget_bytes == want


def test_apple_working_set_estimate_matches_reported_values():
    for ram, ws in APPLE_WS.items():
        assert estimate_apple_working_set(ram * GiB) == ws
    # with no reported value the estimate stands in
    dev = DeviceMemory("apple", "M2", 64 * GiB, 61 * GiB, True, None)
    assert dev.budget_bytes == 48 * GiB


def test_budget_is_never_negative():
    assert DeviceMemory("cuda", "busy", 24 * GiB, 100 * MiB, False).budget_bytes == 0


# --- footprints ---


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


# --- plans ---


def ws_per_seq(context: int, chunk: int = 512) -> int:
    """Llama-3-8B prefill workspace per sequence, written out: C*(4096+2*4096+3*1024) bf16
    hidden, q, k, v and the rotated q, k + C*14336*3 bf16 MLP + 32 heads*C*context fp32
    scores + 128256 fp32 logits."""
    c = min(chunk, context)
    return c * 15360 * 2 + c * 14336 * 3 * 2 + 32 * c * context * 4 + 128256 * 4


def ws_cuda(context: int, batch: int = 1) -> int:
    """The same on PyTorch CUDA, whose SDPA never materialises scores: a chunk after the
    first holds its bool mask and the bf16 bias made of it (3 bytes x C x context) instead.
    A prefill pass there takes 2048 tokens of the batch, and at least 512 per sequence."""
    c = min(max(512, 2048 // batch), context)
    mask = 3 * c * context if context > c else 0
    return c * 15360 * 2 + c * 14336 * 3 * 2 + mask + 128256 * 4


def cuda_max_batch(budget: int, weights: int, context: int) -> int:
    """Largest batch whose weights + 128 MiB + per-sequence KV and workspace fit."""
    b = 0
    while weights + 128 * MiB + (b + 1) * (context * 131072 + ws_cuda(context, b + 1)) <= budget:
        b += 1
    return b


def ws_eager(cfg: ModelConfig, context: int, chunk: int = 512, dtype_bytes: int = 4) -> int:
    """PyTorch CPU's prefill workspace per sequence, written out: the larger of the MLP's
    live tensors (h, x, previous y, o, rotated q, gate, up, silu(gate), product) and those at
    q's rope (h, x, y, o, q, k, v, rotate_half's copy, q*cos, rot*sin, sum), C x width x
    dtype_bytes, + a later chunk's bool mask and its float bias + fp32 logits."""
    c = min(chunk, context)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    width = max(4 * h + q + 4 * i, 4 * h + 5 * q + 2 * kv)
    mask = (1 + dtype_bytes) * c * context if context > c else 0
    return c * width * dtype_bytes + mask + cfg.vocab_size * 4


TORCH_CPU_OVERHEAD = 24 * MiB + 40 * MiB  # load residue + glibc heap retained


def test_workspace_formula():
    assert ws_per_seq(8192) == 15_728_640 + 44_040_192 + 536_870_912 + 513_024
    # PyTorch CPU: flash SDPA (no scores), eager fp32 temporaries; Llama-3-8B's MLP phase
    # (4*4096 + 4096 + 4*14336 = 77824 wide) beats its rope phase (4*4096 + 5*4096 + 2*1024)
    assert ws_eager(LLAMA3_8B, 8192) == 512 * 77824 * 4 + 5 * 512 * 8192 + 128256 * 4
    ws = workspace_bytes(LLAMA3_8B, context=8192, batch=3, prefill_chunk=512, dtype_bytes=4,
                         backend="torch", kind="cpu")  # fmt: skip
    assert ws == 3 * ws_eager(LLAMA3_8B, 8192) + TORCH_CPU_OVERHEAD
    # SmolLM2, one chunk of 288 (no mask): 4*576 + 576 + 4*1536 = 9024 fp32 values a token
    assert ws_eager(SMOLLM2, 288) == 288 * 9024 * 4 + 49152 * 4 == 10_592_256
    ws = workspace_bytes(SMOLLM2, context=288, batch=8, prefill_chunk=512, dtype_bytes=4,
                         backend="torch", kind="cpu")  # fmt: skip
    assert ws == 8 * 10_592_256 + TORCH_CPU_OVERHEAD
    # a model whose q is much wider than its MLP peaks at q's rope instead
    wide_q = SMOLLM2.replace(num_attention_heads=36, intermediate_size=256)
    assert ws_eager(wide_q, 100) == 100 * (4 * 576 + 5 * 2304 + 2 * 192) * 4 + 49152 * 4
    ws = workspace_bytes(wide_q, context=100, batch=1, prefill_chunk=512, dtype_bytes=4,
                         backend="torch", kind="cpu")  # fmt: skip
    assert ws == ws_eager(wide_q, 100) + TORCH_CPU_OVERHEAD
    assert ws_cuda(8192) == 62_914_560 + 176_160_768 + 50_331_648 + 513_024
    ws = workspace_bytes(LLAMA3_8B, context=8192, batch=3, prefill_chunk=682, dtype_bytes=2,
                         backend="torch", kind="cuda")  # fmt: skip
    assert ws == 3 * ws_cuda(8192, batch=3) + 128 * MiB
    assert ws_cuda(2048) == 62_914_560 + 176_160_768 + 513_024  # one plain-causal chunk
    assert ws_cuda(2048, batch=32) == 15_728_640 + 44_040_192 + 3 * 512 * 2048 + 513_024
    # a context shorter than the chunk prefills in one piece of `context` tokens
    ws = workspace_bytes(SMOLLM2, context=100, batch=1, prefill_chunk=512, dtype_bytes=2,
                         backend="mlx", kind="apple")  # fmt: skip
    smol = 100 * (576 + 2 * 576 + 3 * 192) * 2 + 100 * 1536 * 3 * 2 + 9 * 100 * 100 * 4 + 49152 * 4
    assert ws == smol + 64 * MiB


def test_plan_8b_bf16_on_24gb_gpu():
    fp = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16")
    plan = make_plan(LLAMA3_8B, fp, GPU24, context=8192, batch=1)
    budget = BUDGETS["gpu24"][1]
    assert plan.weight_bytes == L_BF16
    assert plan.kv_bytes == 8192 * 131072 == GiB
    assert plan.prefill_chunk == 2048
    assert plan.workspace_bytes == ws_cuda(8192) + 128 * MiB
    assert plan.total_bytes == L_BF16 + GiB + ws_cuda(8192) + 128 * MiB
    assert plan.budget_bytes == budget and plan.fits and plan.advice == ""
    # batch: the weights and the fixed overhead once, KV + workspace per sequence
    assert plan.max_batch == cuda_max_batch(budget, L_BF16, 8192) == 7
    assert plan.max_context == 8192  # capped at max_position_embeddings
    check_fits(plan)  # no error


def test_max_context_for_a_long_context_model():
    cfg = LLAMA3_8B.replace(max_position_embeddings=131072)
    fp = footprint(cfg, config_shapes(cfg), "bfloat16")
    budget = BUDGETS["gpu24"][1]
    plan = make_plan(cfg, fp, GPU24, context=8192)
    # above the 2048-token chunk the need is linear in the context: per token 131072 KV bytes
    # + 3 x 2048 mask bytes; the rest is fixed
    fixed = L_BF16 + 128 * MiB + 2048 * 15360 * 2 + 2048 * 14336 * 6 + 128256 * 4
    want = (budget - fixed) // (131072 + 3 * 2048)
    assert plan.max_context == want == 58488
    assert make_plan(cfg, fp, GPU24, context=want).fits
    assert not make_plan(cfg, fp, GPU24, context=want + 1).fits


def test_does_not_fit_message_lists_what_would():
    fp = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16")
    plan = make_plan(LLAMA3_8B, fp, GPU24, context=8192, batch=8)
    budget = BUDGETS["gpu24"][1]
    kv, ws = 8 * 8192 * 131072, 8 * ws_cuda(8192, batch=8) + 128 * MiB
    assert (plan.kv_bytes, plan.workspace_bytes) == (kv, ws)
    assert not plan.fits and plan.max_batch == 7
    # longest context at batch 8 (512 tokens a sequence per pass), linear above the chunk
    fixed = L_BF16 + 128 * MiB + 8 * (512 * 15360 * 2 + 512 * 14336 * 6 + 128256 * 4)
    assert plan.max_context == (budget - fixed) // (8 * (131072 + 3 * 512)) == 7336
    int4_total = L_INT4 + kv + ws
    assert f"{(L_BF16 + kv + ws) / GiB:.2f}" == "23.63" and f"{int4_total / GiB:.2f}" == "12.88"
    with pytest.raises(MlxrunError) as e:
        check_fits(plan)
    assert str(e.value) == (
        "needs 23.63 GiB (weights 14.96 + KV 8.00 + workspace 0.67) but the device budget is "
        "22.78 GiB; try --quant int4 (12.88 GiB), --context 7336 or --batch-size 7"
    )


def test_apple_machines_8b_bf16_and_int4():
    fp = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16")
    need = L_BF16 + 4096 * 131072 + ws_per_seq(4096) + 64 * MiB  # 15.82 GiB with MLX
    assert need == 16_993_219_584
    fits = {8: False, 16: False, 36: True, 64: True, 128: True, 192: True}
    for ram, ok in fits.items():
        dev = apple(ram)
        plan = make_plan(LLAMA3_8B, fp, dev, context=4096, backend="mlx")
        assert plan.total_bytes == need and plan.fits == ok, ram
        per_seq = 4096 * 131072 + ws_per_seq(4096)
        assert plan.max_batch == max(0, (dev.budget_bytes - L_BF16 - 64 * MiB) // per_seq)
    assert make_plan(LLAMA3_8B, fp, apple(36), context=4096, backend="mlx").max_batch == 11
    assert make_plan(LLAMA3_8B, fp, apple(64), context=4096, backend="mlx").max_batch == 40
    # 16 GB: bf16 weights alone exceed 10.67 GiB; int4 fits
    plan = make_plan(LLAMA3_8B, fp, apple(16), context=4096, backend="mlx")
    assert plan.max_batch == 0 and plan.max_context == 0
    int4_need = L_INT4 + 4096 * 131072 + ws_per_seq(4096) + 64 * MiB
    assert (
        plan.advice
        == f"try --quant int4 ({int4_need / GiB:.2f} GiB)"
        == ("try --quant int4 (5.08 GiB)")
    )
    q4 = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16", Q("affine", 4, 64))
    assert make_plan(LLAMA3_8B, q4, apple(16), context=4096, backend="mlx").fits
    # 8 GB: 3 GiB budget, even int4 weights (4.21 GiB) do not fit
    plan = make_plan(LLAMA3_8B, fp, apple(8), context=4096, backend="mlx")
    with pytest.raises(MlxrunError) as e:
        check_fits(plan)
    assert str(e.value).endswith(
        "but the device budget is 3.00 GiB; nothing fits: the weights alone need 14.96 GiB "
        "(4.21 GiB as int4); use a device with more memory"
    )


def test_int4_with_shorter_context_when_neither_alone_fits():
    cfg = LLAMA3_8B.replace(max_position_embeddings=131072)
    fp = footprint(cfg, config_shapes(cfg), "bfloat16")
    plan = make_plan(cfg, fp, apple(16), context=131072, backend="mlx")
    budget = 16 * GiB * 2 // 3
    fixed = L_INT4 + 64 * MiB + 512 * 15360 * 2 + 512 * 14336 * 6 + 128256 * 4
    ctx4 = (budget - fixed) // (131072 + 32 * 512 * 4)
    assert plan.advice == f"try --quant int4 --context {ctx4}"


def test_gpus_and_cpu():
    fp = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16")
    for dev in (GPU24, GPU80):
        assert make_plan(LLAMA3_8B, fp, dev, context=8192).fits
    plan = make_plan(LLAMA3_8B, fp, GPU80, context=8192)
    budget = 79 * GiB - 80 * GiB * 3 // 100
    assert plan.max_batch == cuda_max_batch(budget, L_BF16, 8192) == 57
    plan = make_plan(LLAMA3_8B, fp, CPU, context=8192, backend="torch")
    assert plan.fits
    assert plan.workspace_bytes == ws_eager(LLAMA3_8B, 8192, dtype_bytes=2) + TORCH_CPU_OVERHEAD


def test_smollm2_fits_everywhere():
    fp = footprint(SMOLLM2, config_shapes(SMOLLM2), "bfloat16")
    for dev, _ in BUDGETS.values():
        plan = make_plan(SMOLLM2, fp, dev, context=8192, backend="mlx")
        assert plan.fits and plan.max_context == 8192
    plan = make_plan(SMOLLM2, fp, apple(8), context=8192, backend="mlx")
    ws = 512 * (576 + 2 * 576 + 3 * 192) * 2 + 512 * 1536 * 6 + 9 * 512 * 8192 * 4 + 49152 * 4
    assert plan.max_batch == (3 * GiB - S_PARAMS * 2 - 64 * MiB) // (8192 * S_KV + ws) == 8


# SmolLM2 as PyTorch CPU runs it: fp32 weights and KV cache
S_KV32 = 2 * S_KV
EXPAND = (4 << 20) // 4 * 10  # one 4 MiB block of dense rows expanded, ~10 bytes a weight


def test_torch_cpu_plan_smollm2():
    dev = DeviceMemory("cpu", "small", 8 * GiB, 3 * GiB, False)  # budget 2 GiB
    fp = footprint(SMOLLM2, config_shapes(SMOLLM2), "float32")
    plan = make_plan(SMOLLM2, fp, dev, context=288, batch=8, dtype_bytes=4, backend="torch")
    assert plan.weight_bytes == S_PARAMS * 4 and plan.kv_bytes == 8 * 288 * S_KV32
    assert plan.workspace_bytes == 8 * ws_eager(SMOLLM2, 288) + TORCH_CPU_OVERHEAD  # nothing packed
    assert plan.total_bytes == S_PARAMS * 4 + 8 * 288 * S_KV32 + plan.workspace_bytes
    # weights and overhead once, KV + workspace per sequence
    per_seq = 288 * S_KV32 + ws_eager(SMOLLM2, 288)
    assert plan.max_batch == (2 * GiB - S_PARAMS * 4 - TORCH_CPU_OVERHEAD) // per_seq == 64
    # the whole context's workspace even where the prompt is known (the heap calibration)
    known = make_plan(SMOLLM2, fp, dev, context=288, batch=8, dtype_bytes=4, backend="torch",
                      prompt_tokens=256)  # fmt: skip
    assert known.workspace_bytes == plan.workspace_bytes and known.max_batch == 64
    # int4 g64 packs every matrix: one dequantized block per call on top
    q4 = footprint(SMOLLM2, config_shapes(SMOLLM2), "float32", Q("affine", 4, 64))
    w4 = (S_PARAMS - S_NORMS) * 5 // 8 + S_NORMS * 4  # 4 bits + fp32 scale, bias per 64
    assert q4.weight_bytes == w4
    plan = make_plan(SMOLLM2, q4, dev, context=288, batch=8, dtype_bytes=4, backend="torch")
    assert plan.workspace_bytes == 8 * ws_eager(SMOLLM2, 288) + TORCH_CPU_OVERHEAD + EXPAND
    assert plan.max_batch == (2 * GiB - w4 - TORCH_CPU_OVERHEAD - EXPAND) // per_seq == 83


def test_load_peak_torch_cpu():
    dev = DeviceMemory("cpu", "small", 8 * GiB, 3 * GiB, False)
    shapes = config_shapes(SMOLLM2)  # BF16 on disk
    fp = footprint(SMOLLM2, shapes, "float32")
    assert fp.stored_bytes == S_PARAMS * 2 and fp.load_quantized == 0
    kw = dict(context=288, batch=1, dtype_bytes=4, backend="torch")
    # copied out of a memory map: fp32 copies + the bf16 pages read + 24 MiB load residue
    plan = make_plan(SMOLLM2, fp, dev, mapped=True, **kw)
    assert plan.load_bytes == S_PARAMS * 4 + S_PARAMS * 2 + 24 * MiB
    assert plan.peak_bytes == max(plan.total_bytes, plan.load_bytes) == plan.load_bytes
    assert plan.fits  # the load peak is reported, not budgeted (the pages are reclaimable)
    assert make_plan(SMOLLM2, fp, dev, **kw).load_bytes == S_PARAMS * 4 + 24 * MiB
    # quantizing at load: 21 bytes a weight of the largest matrix (the tied embedding)
    q4 = footprint(SMOLLM2, shapes, "float32", Q("affine", 4, 64))
    assert q4.load_quantized == 49152 * 576
    plan = make_plan(SMOLLM2, q4, dev, mapped=True, **kw)
    assert plan.load_bytes == 49152 * 576 * 21 + 24 * MiB  # > weights + pages (337 MiB)
    # other backends report no load peak (MLX's peak memory does not see loading)
    for backend, d in (("mlx", dev), ("torch", GPU24)):
        assert make_plan(SMOLLM2, fp, d, context=288, backend=backend, mapped=True).load_bytes == 0


def test_bad_context_and_batch():
    fp = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16")
    with pytest.raises(MlxrunError, match=r"max_position_embeddings \(8192\); use --context 8192"):
        make_plan(LLAMA3_8B, fp, GPU80, context=8193)
    with pytest.raises(MlxrunError, match="--batch-size must be at least 1"):
        make_plan(LLAMA3_8B, fp, GPU80, context=1024, batch=0)
    with pytest.raises(MlxrunError, match="at least 1"):
        make_plan(LLAMA3_8B, fp, GPU80, context=0)


def test_format_plan():
    fp = footprint(LLAMA3_8B, config_shapes(LLAMA3_8B), "bfloat16")
    text = format_plan(make_plan(LLAMA3_8B, fp, apple(16), context=4096, backend="mlx"))
    lines = dict(line.split(None, 1) for line in text.splitlines() if not line.startswith("s"))
    assert lines["weights"].strip() == "14.96 GiB"
    assert "512.0 MiB" in lines["KV"] and "128.0 KiB/token" in lines["KV"]
    assert "10.67 GiB" in lines["budget"] and "GPU working set" in lines["budget"]
    assert lines["fits"].strip() == "NO"
    assert "try --quant int4 (5.08 GiB)" in text
    assert "source: total_bytes  simulated" in text


# --- probing the machine the tests run on ---


def test_probe_cpu_reads_meminfo():
    meminfo = {k: int(v.split()[0]) * 1024 for k, v in
               (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}  # fmt: skip
    limit = Path("/sys/fs/cgroup/memory.max")
    cg = int(limit.read_text()) if limit.exists() and limit.read_text().strip().isdigit() else None
    for backend in ("torch", "mlx"):
        dev = probe_device(backend, "cpu")
        assert dev.kind == "cpu" and not dev.unified
        assert dev.total_bytes == min(meminfo["MemTotal"], cg or meminfo["MemTotal"])
        assert abs(dev.available_bytes - meminfo["MemAvailable"]) < 512 * MiB or cg
        assert "/proc/meminfo" in dev.sources["available_bytes"]
        reserve = max(GiB, dev.total_bytes * 5 // 100)
        assert dev.budget_bytes == max(0, dev.available_bytes - reserve)


def test_probe_missing_devices():
    import mlx.core as mx
    import torch

    if not (mx.metal.is_available() or mx.cuda.is_available()):
        with pytest.raises(MlxrunError, match="MLX has no GPU"):
            probe_device("mlx", "gpu")
    if not torch.cuda.is_available():
        with pytest.raises(MlxrunError, match="no CUDA GPU"):
            probe_device("torch", "cuda")
    with pytest.raises(MlxrunError, match="unknown device"):
        probe_device("torch", "tpu")


@pytest.mark.cuda
@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
def test_probe_cuda():
    import torch

    dev = probe_device("torch", "cuda")
    free, total = torch.cuda.mem_get_info()
    assert dev.kind == "cuda" and dev.total_bytes == total
    assert abs(dev.available_bytes - free) < 256 * MiB


def test_module_imports_without_backends():
    code = "import sys, mlxrun.memory; print(sorted({'torch', 'mlx'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


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


def ws_mlx_cpu(cfg: ModelConfig, context: int, chunk: int = 512, dtype_bytes: int = 4) -> int:
    """MLX CPU's prefill workspace per sequence, written out: its scheduler allocates ~55
    ops ahead, so the larger of (5 MLP-wide tensors + 5 hidden + 5 q-wide + 6 kv-wide, from
    the MLP into the next layer's rope) and (5 q-wide + 3 hidden + 3 fp32 score tensors,
    across the attention), + fp32 logits of the last position."""
    c = min(chunk, context)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    mlp = c * (5 * i + 5 * h + 5 * q + 6 * kv) * dtype_bytes
    attn = c * (5 * q + 3 * h) * dtype_bytes + 3 * cfg.num_attention_heads * c * context * 4
    return max(mlp, attn) + cfg.vocab_size * 4


def test_mlx_cpu_workspace_and_max_batch():
    # SmolLM2 at 288 tokens: the MLP side, 5*1536 + 5*576 + 5*576 + 6*192 = 14592 fp32 a token
    assert ws_mlx_cpu(SMOLLM2, 288) == 288 * 14592 * 4 + 49152 * 4 == 17_006_592
    # (the attention side is 288 * 4608 * 4 + 3 * 9 * 288 * 288 * 4 = 14_266_368, less)
    ws = workspace_bytes(SMOLLM2, context=288, batch=4, prefill_chunk=512, dtype_bytes=4,
                         backend="mlx", kind="cpu")  # fmt: skip
    assert ws == 4 * 17_006_592 + 8 * MiB
    # at 1024 tokens the three score tensors win: 1024 * 4608 * 4 + 3 * 9 * 1024 * 1024 * 4
    ws = workspace_bytes(SMOLLM2, context=1024, batch=1, prefill_chunk=512, dtype_bytes=4,
                         backend="mlx", kind="cpu")  # fmt: skip
    assert ws == ws_mlx_cpu(SMOLLM2, 1024) + 8 * MiB  # a chunk of 512 over 1024 keys
    assert ws_mlx_cpu(SMOLLM2, 1024) == 512 * 4608 * 4 + 3 * 9 * 512 * 1024 * 4 + 49152 * 4
    # a 2 GiB budget: weights and overhead once, KV + workspace per sequence
    dev = DeviceMemory("cpu", "small", 8 * GiB, 3 * GiB, False)
    fp = footprint(SMOLLM2, config_shapes(SMOLLM2), "float32", None, "mlx")
    plan = make_plan(SMOLLM2, fp, dev, context=288, batch=8, dtype_bytes=4, backend="mlx")
    assert plan.workspace_bytes == 8 * 17_006_592 + 8 * MiB
    per_seq = 288 * S_KV32 + 17_006_592
    assert plan.max_batch == (2 * GiB - S_PARAMS * 4 - 8 * MiB) // per_seq == 52
    # 256 of the 288 tokens prompt (generate's plan): the workspace is the 256-token prefill's,
    # the KV cache still the whole context's
    ws256 = 256 * 14592 * 4 + 49152 * 4
    plan = make_plan(SMOLLM2, fp, dev, context=288, batch=8, dtype_bytes=4, backend="mlx",
                     prompt_tokens=256)  # fmt: skip
    assert plan.workspace_bytes == 8 * ws256 + 8 * MiB
    assert plan.kv_bytes == 8 * 288 * S_KV32
    per_seq = 288 * S_KV32 + ws256
    assert plan.max_batch == (2 * GiB - S_PARAMS * 4 - 8 * MiB) // per_seq == 56
    with pytest.raises(MlxrunError, match="prompt"):
        make_plan(SMOLLM2, fp, dev, context=288, batch=1, backend="mlx", prompt_tokens=289)
