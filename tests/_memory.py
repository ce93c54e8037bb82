"""The hand-worked models and simulated devices the memory tests share
(tests/test_device_memory.py, tests/test_model_footprint.py, tests/test_memory.py): Llama-3-8B
and SmolLM2-135M's configs with their parameter and KV counts worked out by hand, and devices
with the budget each must get."""

from __future__ import annotations

from mlxrun.config import ModelConfig
from mlxrun.device_memory import DeviceMemory, GiB, MiB
from mlxrun.quant.formats import QuantSpec


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
