"""What a model needs: weight bytes as they will sit in memory (after quantization) and KV
bytes per token, from config.json and checkpoint headers alone (no weights read).

Backend-free at import (numpy and the standard library only).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ModelConfig
from .errors import MlxrunError
from .weights import read_header

if TYPE_CHECKING:
    from mlxrun.quant.formats import QuantSpec

# The quantization that `--quant int4` means (DESIGN.md: INT4 = affine 4-bit, mlx-lm's group)
INT4_GROUP_SIZE = 64

# Compute dtype names accepted -> (canonical name, bytes per element)
DTYPES = {
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2), "BF16": ("bfloat16", 2),
    "float16": ("float16", 2), "fp16": ("float16", 2), "F16": ("float16", 2),
    "float32": ("float32", 4), "fp32": ("float32", 4), "F32": ("float32", 4),
}  # fmt: skip
# Stored size of each safetensors dtype, for tensors counted as they sit on disk.
STORED_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip

# Bytes per weight of GGUF K-quant matrices kept as their blocks (Tensor.block; their
# "dtype" in a shapes map is the block type and their shape the logical [out, in]), as the
# CUDA kernels hold them (quant/kquant_layout.py)
GGUF_HELD = {"Q4_K": 4.625 / 8, "Q5_K": 5.625 / 8, "Q6_K": 6.5625 / 8}

Shapes = dict[str, tuple[tuple[int, ...], str]]


def header_shapes(path: str | os.PathLike) -> Shapes:
    """{tensor name: (shape, safetensors dtype)} of a safetensors file or checkpoint directory.

    Reads headers only (sharded checkpoints through model.safetensors.index.json).
    """
    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise MlxrunError(f"{path} holds no .safetensors files; is it a model directory?")
    elif path.exists():
        files = [path]
    else:
        raise MlxrunError(f"{path} does not exist")
    out: Shapes = {}
    for f in files:
        _, header = read_header(f)
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (tuple(info["shape"]), info["dtype"])
    return out


def config_shapes(config: ModelConfig, dtype: str = "BF16") -> Shapes:
    """The Hugging Face tensor names and shapes a checkpoint of `config` holds (no file)."""
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    out: Shapes = {"model.embed_tokens.weight": ((c.vocab_size, h), dtype)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        moe = c.moe is not None and c.moe.is_moe(i)
        mlp = [
            ("mlp.gate_proj.weight", (c.intermediate_size, h)),
            ("mlp.up_proj.weight", (c.intermediate_size, h)),
            ("mlp.down_proj.weight", (h, c.intermediate_size)),
        ]
        for n, shape in [
            ("self_attn.q_proj.weight", (q, h)),
            ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)),
            ("self_attn.o_proj.weight", (h, q)),
            *([] if moe else mlp),
            ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,)),
        ]:
            out[p + n] = (shape, dtype)
        if moe:  # every expert is held: the planner counts them all
            from .moe import layer_shapes  # noqa: PLC0415

            out.update(layer_shapes(c, p, dtype))
        if c.attention_bias:
            for n, width in (("q", q), ("k", kv), ("v", kv)):
                out[f"{p}self_attn.{n}_proj.bias"] = ((width,), dtype)
        if c.o_bias:
            out[f"{p}self_attn.o_proj.bias"] = ((h,), dtype)
        if c.mlp_bias:
            for n, width in (("gate", c.intermediate_size), ("up", c.intermediate_size)):
                out[f"{p}mlp.{n}_proj.bias"] = ((width,), dtype)
            out[f"{p}mlp.down_proj.bias"] = ((h,), dtype)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = ((d,), dtype)
            out[p + "self_attn.k_norm.weight"] = ((d,), dtype)
    out["model.norm.weight"] = ((h,), dtype)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ((c.vocab_size, h), dtype)
    return out


def packed_bytes(
    out_dim: int, in_dim: int, mode: str, bits: int, group_size: int, dtype_bytes: int
) -> int:
    """Bytes of one quantized [out, in] matrix in the canonical (mlx) format.

    weight uint32 [out, in*bits/32]; scales [out, in/group] (affine: `dtype_bytes` each,
    mxfp4/mxfp8/nvfp4: 1 byte); biases like scales, affine only.
    """
    assert in_dim % group_size == 0 and in_dim * bits % 32 == 0, (in_dim, group_size, bits)
    groups = out_dim * (in_dim // group_size)
    if mode == "affine":
        return out_dim * (in_dim * bits // 32) * 4 + 2 * groups * dtype_bytes
    return out_dim * (in_dim * bits // 32) * 4 + groups


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _layer_bits(config: ModelConfig, prefix: str) -> int:
    """Bits of quantized layer `prefix`, from config.json's quantization (per-layer first)."""
    q = config.quantization
    if not q:
        raise MlxrunError(
            f"checkpoint has quantized tensors ({prefix}.scales) but config.json "
            "has no 'quantization' entry; re-download config.json"
        )
    from mlxrun.quant.formats import layer_spec  # noqa: PLC0415

    # per-layer entries as the loader reads them (null: the mode's default)
    spec = layer_spec(q, prefix)
    return 4 if spec is None else spec.bits


def _keeps_stored(
    config: ModelConfig, prefix: str, quant: QuantSpec | None, group_asked: bool
) -> bool:
    """Whether the loader keeps stored quantized layer `prefix` as it is (build._Builder)."""
    if quant is None:
        return True
    from mlxrun.quant.formats import layer_spec  # noqa: PLC0415

    have = layer_spec(config.quantization or {}, prefix)
    if have is None or (have.mode, have.bits) != (quant.mode, quant.bits):
        return False
    return have == quant or not group_asked


def _requant_spec(config: ModelConfig, quant: QuantSpec | None, group_asked: bool):
    """The format a stored layer is re-quantized to (build.target_spec)."""
    from mlxrun.build import target_spec  # noqa: PLC0415

    return target_spec(quant, config.quantization, group_asked)


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes a model needs, from config.json and checkpoint headers alone.

    weight_bytes: the weights as they will sit in memory (after quantization).
    kv_bytes_per_token: one token of one sequence's KV cache (layers x 2 x kv_heads x
    head_dim x dtype size) while no layer's window is full. dense_weight_bytes /
    int4_weight_bytes: the same weights unquantized at the compute dtype, and quantized to
    `--quant int4` (affine 4-bit, group 64). kv_windows: each layer's attention window (or
    None), from config.layer_windows; empty when no layer slides.
    """

    weight_bytes: int
    kv_bytes_per_token: int
    n_params: int
    dense_weight_bytes: int
    int4_weight_bytes: int
    dtype: str
    label: str  # how the weights are stored, e.g. "bfloat16" or "affine 4-bit g64"
    largest_packed: int = 0  # weights of the largest matrix held packed (0: none)
    stored_bytes: int = 0  # the tensors the loader reads, as stored (tied head once)
    load_quantized: int = 0  # weights of the largest matrix quantized at load (0: none)
    kv_windows: tuple[int | None, ...] = ()

    def kv_bytes(self, tokens: int, batch: int = 1, chunk: int | None = None) -> int:
        """KV-cache bytes for `batch` sequences of `tokens` tokens; with `chunk` (the most
        tokens a pass brings), a sliding-window layer holds window + chunk - 1 of them, as
        the caches do (backends.base.ring_capacity)."""
        if not self.kv_windows or chunk is None:
            return self.kv_bytes_per_token * tokens * batch
        from mlxrun.backends.base import ring_capacity  # noqa: PLC0415

        per_layer = self.kv_bytes_per_token // len(self.kv_windows)
        held = sum(ring_capacity(w, tokens, chunk) for w in self.kv_windows)
        return per_layer * held * batch

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes / self.n_params


def footprint(
    config: ModelConfig,
    tensor_shapes: Shapes,
    dtype: str = "bfloat16",
    quant: QuantSpec | None = None,
    backend: str = "torch",
    group_asked: bool = False,
) -> ModelFootprint:
    """Weight and KV bytes of a model: `tensor_shapes` from `header_shapes` or `config_shapes`.

    A checkpoint that is already quantized (`p.scales` present) counts its quantized tensors
    as stored (on MLX, float scales and biases at the compute dtype, as its quantized matmul
    wants them); `quant` for an unquantized checkpoint packs every 2-D `.weight` whose in-dim
    divides by the group size (embedding and lm_head too, as mlx-lm does). Other tensors count
    at the compute `dtype`. A tied lm_head stored in the file is not counted twice.

    `quant` on a quantized checkpoint follows the loader (mlxrun/build.py): a stored layer
    already in quant's mode and bits (and its group size, when `group_asked`) is kept as
    stored; the others are re-quantized, in the checkpoint's group size unless one was asked.
    """
    if dtype not in DTYPES:
        raise MlxrunError(f"unknown dtype {dtype!r}: use bfloat16, float16 or float32")
    dtype, db = DTYPES[dtype]
    shapes = dict(tensor_shapes)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # the loader drops it and uses the embedding
    quantized = {n[: -len(".scales")] for n in shapes if n.endswith(".scales")}
    kept = {p for p in quantized if _keeps_stored(config, p, quant, group_asked)}
    weight = dense = int4 = n_params = largest = stored = requant = 0
    for name, (shape, sdt) in shapes.items():
        if sdt in GGUF_HELD:  # kept as stored whatever is asked (a re-quantization is
            n = _numel(shape)  # one layer at a time, no larger than its dense copy)
            stored += int(n * GGUF_HELD[sdt])
            weight += int(n * GGUF_HELD[sdt])
            n_params += n
            dense += n * db
            int4 += packed_bytes(*shape, "affine", 4, INT4_GROUP_SIZE, db)
            largest = max(largest, n)
            continue
        stored += _numel(shape) * STORED_BYTES.get(sdt, db)
        if config.moe is not None and name.endswith(("_blocks", "_scales")):
            # OpenAI's MXFP4 experts (gpt-oss): held as stored, two values a block byte
            weight += _numel(shape)
            if name.endswith("_blocks"):
                n_params += 2 * _numel(shape)
                dense += 2 * _numel(shape) * db
            int4 += _numel(shape)
            continue
        prefix, _, leaf = name.rpartition(".")
        is_q = prefix in quantized and leaf in ("weight", "scales", "biases")
        if is_q:
            if prefix in kept:  # kept as stored; else re-quantized below
                cast = backend == "mlx" and leaf != "weight" and sdt in ("F16", "BF16", "F32")
                weight += _numel(shape) * (db if cast else STORED_BYTES[sdt])
            if leaf != "weight":
                continue
            # uint32 [..., out, in*bits/32] -> the logical [..., out, in]
            shape = (*shape[:-1], shape[-1] * 32 // _layer_bits(config, prefix))
        n = _numel(shape)
        n_params += n
        dense += n * db
        # a matrix, or a stack of them (MoE experts (E, out, in)); a MoE router and a shared
        # expert's gate stay as stored (build._Builder.stored_or_dense)
        router = config.moe is not None and prefix.endswith(
            (".gate", ".router", ".shared_expert_gate")
        )
        matrix = leaf == "weight" and len(shape) in (2, 3) and not router
        stack = _numel(shape[:-2]) if matrix else 1
        int4 += (
            stack * packed_bytes(*shape[-2:], "affine", 4, INT4_GROUP_SIZE, db)
            if matrix and shape[-1] % INT4_GROUP_SIZE == 0
            else n * db
        )
        if is_q and prefix in kept:
            largest = max(largest, n)
            continue
        # a stored layer is re-quantized in the checkpoint's group size when none was asked
        q = _requant_spec(config, quant, group_asked) if is_q else quant
        if q is not None and matrix and shape[-1] % q.group_size == 0:
            largest, requant = max(largest, n), max(requant, n)
            weight += stack * packed_bytes(*shape[-2:], q.mode, q.bits, q.group_size, db)
        else:
            weight += n * db
    if quant is not None:
        t = _requant_spec(config, quant, group_asked) if quantized else quant
        label = f"{t.mode} {t.bits}-bit g{t.group_size}"
    elif quantized:
        from mlxrun.quant.formats import from_config  # noqa: PLC0415

        g = from_config(config.quantization or {})
        label = f"{g.mode} {g.bits}-bit g{g.group_size}"
        if any(isinstance(v, dict) for v in (config.quantization or {}).values()):
            label += " (mixed per layer)"
    else:
        label = dtype
    c = config
    kv = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * db
    quantizing = requant if quant is not None else 0
    return ModelFootprint(
        weight, kv, n_params, dense, int4, dtype, label, largest, stored, quantizing,
        tuple(c.layer_windows),
    )  # fmt: skip
