"""`x @ W.T` for a packed weight without a full-precision copy of W (PyTorch CPU/MPS).

Expanding a whole packed matrix per call costs out*in*4 bytes at once: for a 49152x576 tied
head that is 113 MB, more than the rest of an int4 model. Rows of the packed weight (and of
its scales and biases) are independent, so we expand a block of rows at a time, multiply,
and write that block's output columns; each column is the same dot product as with the
full matrix, so results agree with `F.linear(x, dequantize(...))` to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlxrun.quant.torch_dequant import dequantize


def block_rows(out_features: int, in_features: int, max_chunk_bytes: int) -> int:
    """Rows of dense weight expanded per block: whole rows, at least one, within budget.

    A dense row is costed at 4 bytes a value whatever the compute dtype, because
    `dequantize` works in float32 before its final cast. Its temporaries (codes, product,
    sum) make the real transient about 2.3x the budget for affine weights.
    """
    return max(1, min(out_features, max_chunk_bytes // (in_features * 4)))


def packed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor | None,
    mode: str,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    max_chunk_bytes: int = 4 << 20,
) -> torch.Tensor:
    """x (..., in) @ dequantize(weight, ...).T -> (..., out) in x's dtype, computed in
    `dtype`, expanding at most `max_chunk_bytes` of dense weight at a time.

    The 4 MiB default was the fastest of 1-16 MiB on a 2-core AVX2 CPU for a 49152x576 int4
    head, 3-5x faster than expanding it whole (M=1 and M=64 tokens): a small block stays in
    cache and its temporaries are reused instead of freshly mapped (page-faulted) per call.
    """
    out_features = weight.shape[0]
    in_features = weight.shape[1] * 32 // bits
    rows = block_rows(out_features, in_features, max_chunk_bytes)
    if rows == out_features:  # one block: no copy into a preallocated output needed
        w = dequantize(weight, scales, biases, mode, bits, group_size, dtype)
        return F.linear(x.to(dtype), w).to(x.dtype)

    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).to(dtype)
    y = torch.empty(x2.shape[0], out_features, dtype=dtype, device=x.device)
    for r0 in range(0, out_features, rows):
        r1 = min(r0 + rows, out_features)
        w = dequantize(
            weight[r0:r1],
            scales[r0:r1],
            None if biases is None else biases[r0:r1],
            mode,
            bits,
            group_size,
            dtype,
        )
        # A column slice of row-major y is a valid BLAS output (ld = out_features): no copy.
        torch.mm(x2, w.t(), out=y[:, r0:r1])
        del w  # free this block before the next one is expanded
    return y.reshape(*lead, out_features).to(x.dtype)
