"""Quantized KV caches (`--kv-quant int8|fp8`): the formats, their sizes, and the PyTorch
quantize / dequantize that the caches and their tests share.

PyTorch (CPU, MPS, CUDA) keeps each key and value vector, one head at one position, as
`head_dim` one-byte codes and one float32 scale (symmetric, no zero point):

- int8: code = round(x / s), s = max|x| / 127
- fp8:  code = E4M3(x / s),  s = max|x| / 448 (E4M3's largest finite value), stored as
  its byte (uint8: CPU torch has no indexing kernels for float8 tensors)

One scale per head and position: a new token's quantization never touches the codes
already written (a group spanning positions would), the decode attention loads one scale
per key row and applies it after the dot product, and rotated keys have no common
offset across a head to gain from a zero point. The scale is 4 bytes per head_dim values
(6% of int8 at head_dim 64, 3% at 128).

MLX keeps mlx-lm's layout (its QuantizedKVCache with --kv-bits): mx.quantize groups of 64
along head_dim (int8: affine 8-bit, a scale and a bias a group; fp8: mxfp8, E4M3 codes with
a power-of-two scale per 32), read by mx.quantized_matmul in the attention.
"""

from __future__ import annotations

from typing import Any

from .errors import MlxrunError

KV_QUANTS = ("int8", "fp8")
FP8_MAX = 448.0  # the largest finite E4M3 value
MLX_GROUP = {"int8": 64, "fp8": 32}  # mx.quantize group size along head_dim
MLX_MODE = {"int8": "affine", "fp8": "mxfp8"}


def parse_kv_quant(value: str | None) -> str | None:
    """'int8' | 'fp8' -> itself; None, '' or 'none' -> None; anything else: MlxrunError."""
    if value is None:
        return None
    key = value.strip().lower()
    if key in ("", "none"):
        return None
    if key not in KV_QUANTS:
        raise MlxrunError(f"--kv-quant {value!r} is not a KV-cache format: use int8, fp8 or none")
    return key


def parse_kv_list(value: str | None) -> list[str | None]:
    """A comma list as bench and eval take it ('none,int8,fp8') -> [None, 'int8', 'fp8']."""
    if value is None:
        return [None]
    return [parse_kv_quant(v) for v in value.split(",")]


def kv_label(kind: str | None) -> str:
    return kind or "none"


def kv_bytes_per_value(kind: str | None, head_dim: int, itemsize: int, backend: str) -> float:
    """Bytes one cached element takes, its share of the scales included: `itemsize` (the
    compute dtype's) unquantized; one byte plus the scales of its head vector or group."""
    if kind is None:
        return float(itemsize)
    if backend == "mlx":  # a scale (and in affine mode a bias) a group, in the compute dtype
        g = min(MLX_GROUP[kind], head_dim)
        per_group = 1 if kind == "fp8" else 2 * itemsize  # mxfp8: one E8M0 byte
        return 1.0 + per_group / g
    return 1.0 + 4.0 / head_dim


def check_head_dim(kind: str | None, head_dim: int, backend: str) -> None:
    """Refuse a head size the format cannot split into its groups (MLX's)."""
    if kind is None or backend != "mlx":
        return
    g = min(MLX_GROUP[kind], head_dim)
    if head_dim % g or head_dim < 32:
        raise MlxrunError(
            f"--kv-quant {kind} on MLX quantizes keys in groups of {MLX_GROUP[kind]} and this "
            f"model's heads hold {head_dim} values; use --backend cpu/cuda or --kv-quant none"
        )


def torch_code_dtype(kind: str):
    import torch  # noqa: PLC0415

    return torch.int8 if kind == "int8" else torch.uint8


def torch_quantize(x: Any, kind: str) -> tuple[Any, Any]:
    """x (..., D) float -> (codes (..., D) int8 or uint8 E4M3 bytes, scales (...) float32)."""
    import torch  # noqa: PLC0415

    xf = x.float()
    amax = xf.abs().amax(-1)
    top = 127.0 if kind == "int8" else FP8_MAX
    s = amax / top
    inv = torch.where(amax > 0, top / amax.clamp_min(1e-30), torch.zeros_like(amax))
    y = xf * inv[..., None]
    if kind == "int8":
        return torch.round(y).clamp_(-127, 127).to(torch.int8), s
    return y.to(torch.float8_e4m3fn).view(torch.uint8), s


def torch_dequantize(codes: Any, scales: Any, kind: str, dtype: Any) -> Any:
    """The inverse of torch_quantize: codes (..., D), scales (...) -> (..., D) in `dtype`."""
    import torch  # noqa: PLC0415

    c = codes.float() if kind == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (c * scales[..., None]).to(dtype)


def kv_footprint(fp: Any, config: Any, kind: str | None, backend: str) -> Any:
    """A memory.ModelFootprint with its KV bytes per token at `kind`'s size (scales
    included); unchanged for None."""
    if kind is None:
        return fp
    import dataclasses  # noqa: PLC0415
    import math  # noqa: PLC0415

    c = config
    itemsize = 4 if fp.dtype == "float32" else 2
    per = kv_bytes_per_value(kind, c.head_dim, itemsize, "mlx" if backend == "mlx" else "torch")
    values = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
    return dataclasses.replace(fp, kv_bytes_per_token=math.ceil(values * per))
