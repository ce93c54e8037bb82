"""The memory plan (mlxrun/memory.py): prefill workspace and plans against numbers worked
out by hand, on the simulated devices of tests/_memory.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError
from mlxrun.memory import (
    DeviceMemory,
    GiB,
    MiB,
    check_fits,
    config_shapes,
    footprint,
    format_plan,
    make_plan,
    workspace_bytes,
)

from ._memory import (
    BUDGETS,
    CPU,
    GPU24,
    GPU80,
    L_BF16,
    L_INT4,
    LLAMA3_8B,
    S_KV,
    S_NORMS,
    S_PARAMS,
    SMOLLM2,
    Q,
    apple,
)


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


def test_module_imports_without_backends():
    code = "import sys, mlxrun.memory; print(sorted({'torch', 'mlx'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
