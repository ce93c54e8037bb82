"""Shared set-up of the Triton kernel tests (tests/test_triton_*.py).

Without a GPU the kernels run under TRITON_INTERPRET=1 at small sizes; the oracle is
mx.quantize / mx.dequantize (and an independent numpy decoder of the format, checked bit for
bit against mx.dequantize, which the GPU tests use where mlx is not installed). Importing this
module sets the interpreter up (before triton decorates the kernels) and skips the importing
test module where torch or triton is missing.
"""

import importlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()
# Over a minute each under the interpreter on 2 cores; on a GPU they take seconds and run
# by default (deselected on CPUs by pyproject's addopts; `pytest -m long` runs them).
LONG_ON_CPU = pytest.mark.long if not HAS_CUDA else pytest.mark.cuda
if not HAS_CUDA:
    # must be set before triton decorates the kernels
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed")

import mlxrun.quant.triton_kernels as tk  # noqa: E402

if not HAS_CUDA and type(tk._gemv_kernel).__name__ != "InterpretedFunction":
    # imported earlier without the interpreter: decorate the kernels again (the GEMV module
    # first: the GEMM imports its helpers), then rebind them where qmatmul launches them
    for part in ("triton_decode", "triton_gemv_step", "triton_gemv", "triton_gemv_stream",
                 "triton_gemm", "triton_gemm_tma"):  # fmt: skip
        importlib.reload(importlib.import_module(f"mlxrun.quant.{part}"))
    tk = importlib.reload(tk)

try:
    import mlx.core as mx
except ImportError:
    mx = None
need_mlx = pytest.mark.skipif(mx is None, reason="mlx is not installed (the oracle)")
cuda = pytest.mark.cuda
need_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
DEV = "cuda" if HAS_CUDA else "cpu"  # where the non-GPU-marked kernel tests run

# (mode, bits, group size): every format the kernels take
FORMATS = [
    ("affine", 4, 32),
    ("affine", 4, 64),
    ("affine", 4, 128),
    ("affine", 8, 32),
    ("affine", 8, 64),
    ("affine", 8, 128),
    ("mxfp4", 4, 32),
    ("nvfp4", 4, 16),
    ("mxfp8", 8, 32),
]
FMT_IDS = [f"{m}{b}g{g}" for m, b, g in FORMATS]

_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def _e4m3(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    return np.where(b >= 128, -mag, mag)


def ref_dequant(weight, scales, biases, mode, bits, group_size, f32=False) -> np.ndarray:
    """Independent float64 decoder of the canonical format (value i at bit offset i*bits).

    f32: round affine values as MLX does, fl(fl(q*s) + b) in float32 (fp modes are exact).
    """
    w = np.asarray(weight).astype(np.uint32).astype(np.int64)
    per = 32 // bits
    codes = (w[..., None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
    codes = codes.reshape(w.shape[0], -1)
    s = np.asarray(scales)
    if mode == "affine":
        ft = np.float32 if f32 else np.float64
        s = np.repeat(s.astype(ft), group_size, 1)
        b = np.repeat(np.asarray(biases).astype(ft), group_size, 1)
        return (codes.astype(ft) * s + b).astype(np.float64)
    if mode == "mxfp8":
        v = _e4m3(codes)
    else:
        v = np.where(codes >= 8, -1.0, 1.0) * _E2M1[codes & 7]
    sf = _e4m3(s) if mode == "nvfp4" else np.exp2(s.astype(np.float64) - 127)
    return v * np.repeat(sf, group_size, 1)


def random_packed(n, k, mode, bits, group_size, gen, device="cpu"):
    """Random codes with realistic scales: (weight uint32->int32 [N, K*bits/32], scales, biases)."""
    kw, kg = k * bits // 32, k // group_size
    weight = torch.randint(-(2**31), 2**31, (n, kw), generator=gen, dtype=torch.int64)
    weight = weight.to(torch.int32)
    if bits == 8 and mode == "mxfp8":
        # no quantizer writes the E4M3 NaN codes 0x7F / 0xFF (MLX saturates to 0x7E), and the
        # GEMV's hardware conversion decodes them as NaN: make them the largest finite code
        u = weight.view(torch.uint8)
        u[(u & 0x7F) == 0x7F] -= 1
    if mode == "affine":
        scales = (torch.rand(n, kg, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        biases = -(2 ** (bits - 1)) * scales.float() * (0.5 + torch.rand(n, kg, generator=gen))
        return weight.to(device), scales.to(device), biases.to(torch.bfloat16).to(device)
    if mode == "nvfp4":  # E4M3 codes of 2^-9 .. 2^-4, both mantissas, no sign/NaN
        scales = torch.randint(0x10, 0x3F, (n, kg), generator=gen).to(torch.uint8)
    else:  # E8M0 around 2^-6
        scales = torch.randint(118, 125, (n, kg), generator=gen).to(torch.uint8)
    return weight.to(device), scales.to(device), None


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output"
    return ((y.double() - ref).norm() / ref.norm()).item()
