"""packed_linear (row-blocked dequantize + matmul) equals F.linear over the fully expanded
weight for every mode, and never expands more rows at once than its byte budget allows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlxrun.quant import torch_linear
from mlxrun.quant.formats import QuantSpec
from mlxrun.quant.reference import quantize
from mlxrun.quant.torch_dequant import dequantize

SPECS = [QuantSpec("affine", b, g) for b in (4, 8) for g in (32, 64, 128)] + [
    QuantSpec("mxfp4", 4, 32),
    QuantSpec("mxfp8", 8, 32),
    QuantSpec("nvfp4", 4, 16),
]
IN = 256
OUT = 77  # not a multiple of the block rows below
BUDGET = 10 * IN * 4  # 10 float32 rows per block -> 8 blocks, the last of 7 rows


def _packed(spec: QuantSpec, out: int = OUT, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((out, IN)).astype(np.float32)
    parts = quantize(w, spec)
    biases = parts.get("biases")
    return (
        torch.from_numpy(parts["weight"]),
        torch.from_numpy(parts["scales"]),
        None if biases is None else torch.from_numpy(biases),
    )


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}{s.bits}g{s.group_size}")
@pytest.mark.parametrize("shape", [(1, IN), (2, 5, IN)], ids=["2d", "3d"])
def test_matches_full_expansion(spec, shape):
    wq, s, b = _packed(spec)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    args = (spec.mode, spec.bits, spec.group_size, torch.float32)
    want = F.linear(x, dequantize(wq, s, b, *args))
    got = torch_linear.packed_linear(x, wq, s, b, *args, max_chunk_bytes=BUDGET)
    assert got.shape == (*shape[:-1], OUT) and got.dtype == x.dtype
    assert _rel_err(got, want) < 1e-6
    # the single-block path (default budget) agrees too
    one = torch_linear.packed_linear(x, wq, s, b, *args)
    assert _rel_err(one, want) < 1e-6


def test_bfloat16_compute_matches():
    spec = QuantSpec("affine", 4, 64)
    wq, s, b = _packed(spec)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    args = (spec.mode, spec.bits, spec.group_size, torch.bfloat16)
    want = F.linear(x, dequantize(wq, s, b, *args))
    got = torch_linear.packed_linear(x, wq, s, b, *args, max_chunk_bytes=BUDGET)
    assert got.dtype == torch.bfloat16
    assert _rel_err(got.float(), want.float()) < 1e-2  # bf16 output rounding only


@pytest.mark.parametrize(
    "budget, rows",
    [(BUDGET, 10), (BUDGET + IN * 4 - 1, 10), (1, 1), (1 << 30, OUT)],
    ids=["exact", "round-down", "below-one-row", "whole"],
)
def test_expansion_respects_budget(monkeypatch, budget, rows):
    spec = QuantSpec("affine", 4, 64)
    wq, s, b = _packed(spec)
    seen: list[int] = []

    def recording(weight, *a, **k):
        seen.append(weight.shape[0])
        return dequantize(weight, *a, **k)

    monkeypatch.setattr(torch_linear, "dequantize", recording)
    x = torch.randn(4, IN)
    got = torch_linear.packed_linear(x, wq, s, b, "affine", 4, 64, torch.float32, budget)
    assert max(seen) == rows
    assert max(seen) * IN * 4 <= max(budget, IN * 4)  # at least one row, else in budget
    assert sum(seen) == OUT
    want = F.linear(x, dequantize(wq, s, b, "affine", 4, 64))
    assert _rel_err(got, want) < 1e-6
