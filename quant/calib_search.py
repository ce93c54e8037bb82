"""The numerics of calibrated quantization (quant/calibrate.py drives them layer by layer):
group grids in each format's parameters, the AWQ scale and clip searches scored by output
error, and GPTQ's error-feedback codes. numpy on the host, float32 with float64 sums."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlxrun.quant.formats import QuantSpec
from mlxrun.quant.reference import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    float_scales,
    pack,
    round_to,
)

# ---------------------------------------------------------------- group grids


@dataclass
class Grid:
    """Per-group quantization parameters of one [out, in] matrix in `spec`'s format:
    affine: scale, bias [out, groups] (float32 values of the stored dtype); float modes:
    the stored scale bytes [out, groups] and their float32 values."""

    spec: QuantSpec
    dtype: str
    scale: np.ndarray
    bias: np.ndarray | None = None
    sbytes: np.ndarray | None = None

    def codes(self, w: np.ndarray, cols: slice | None = None) -> np.ndarray:
        """Nearest codes for weights w [out, k] (columns `cols` of the matrix; None: all)."""
        g = self.spec.group_size
        idx = np.arange(w.shape[1]) + (cols.start if cols else 0)
        s = self.scale[:, idx // g]
        if self.spec.mode == "affine":
            n = (1 << self.spec.bits) - 1
            b = self.bias[:, idx // g]
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.rint((w - b) / s)
            return np.clip(np.nan_to_num(q), 0, n).astype(np.uint32)
        with np.errstate(divide="ignore", invalid="ignore"):
            x = round_to(w / s, self.dtype)
        return (e2m1_encode(x) if self.spec.bits == 4 else e4m3_encode(x)).astype(np.uint32)

    def values(self, q: np.ndarray, cols: slice | None = None) -> np.ndarray:
        """Dequantized float32 values of codes q [out, k] (as the float32 backends compute
        them)."""
        g = self.spec.group_size
        idx = np.arange(q.shape[1]) + (cols.start if cols else 0)
        s = self.scale[:, idx // g]
        if self.spec.mode == "affine":
            return q.astype(np.float32) * s + self.bias[:, idx // g]
        v = e2m1_decode(q) if self.spec.bits == 4 else e4m3_decode(q)
        return (v * s).astype(np.float32)

    def tensors(self, q: np.ndarray) -> dict[str, np.ndarray]:
        """Codes [out, in] -> the stored {"weight", "scales"[, "biases"]} (float32 scales
        and biases, or uint16 bfloat16 bits / float16 per `dtype`; see `_store_float`)."""
        out = {"weight": pack(q, self.spec.bits)}
        if self.spec.mode == "affine":
            out["scales"], out["biases"] = self.scale, self.bias
        else:
            out["scales"] = self.sbytes
        return out


def make_grid(w: np.ndarray, spec: QuantSpec, dtype: str, shrink=None) -> Grid:
    """Group parameters for w [out, in] as `mx.quantize` computes them from the values,
    after shrinking each group's range by `shrink` [out, groups] (1: MLX's own)."""
    g = spec.group_size
    wg = w.reshape(w.shape[0], -1, g)
    shrink = np.ones(wg.shape[:2], np.float32) if shrink is None else shrink
    if spec.mode == "affine":
        from mlxrun.quant.reference import _affine_params  # noqa: PLC0415

        lo = wg.min(-1) * shrink
        hi = wg.max(-1) * shrink
        s, b = _affine_params(lo[..., None], hi[..., None], spec.bits)
        return Grid(spec, dtype, round_to(s[..., 0], dtype), round_to(b[..., 0], dtype))
    amax = np.abs(wg).max(-1) * shrink
    s = round_to(amax / np.float32(6.0 if spec.bits == 4 else 448.0), dtype)
    sb, val = float_scales(s, spec.mode)
    return Grid(spec, dtype, val.astype(np.float32), None, sb)


def fake_quant(w: np.ndarray, spec: QuantSpec, dtype: str, shrink=None) -> np.ndarray:
    """w [out, in] rounded to nearest in `spec` (optionally clipped): float32 values."""
    grid = make_grid(w, spec, dtype, shrink)
    return grid.values(grid.codes(w))


# ---------------------------------------------------------------- searches


def output_error(e: np.ndarray, h: np.ndarray) -> float:
    """tr(E H E^T): the summed squared output error of weight error E [out, in] on the
    inputs whose Gram matrix is H [in, in]."""
    return float(np.einsum("oi,oi->", e @ h, e))


def sample_error(e: np.ndarray, x: np.ndarray) -> float:
    """Mean squared output error of weight error E [out, in] over input rows x [n, in]:
    an estimate of tr(E H E^T) at n*out*in operations instead of in*out*in."""
    return float(((x @ e.T) ** 2).sum() / len(x))


def search_scales(ws: list[np.ndarray], x: np.ndarray, xmean: np.ndarray, specs, dtype, grid):
    """Per input channel scales s [in] for the matrices `ws` (one shared input): the
    s = xmean^a (a in [0, 1), `grid` steps, normalised to geometric mean ~1) whose rounded
    W*s, divided back by s, gives the least total output error on the input rows x
    [n, in]. a = 0 (s = 1) is plain rounding, so the result is never worse than that on
    these inputs. specs: one QuantSpec per matrix of `ws` (or one for all)."""
    specs = specs if isinstance(specs, list | tuple) else [specs] * len(ws)
    best, best_s = None, np.ones_like(xmean)
    for k in range(grid):
        s = np.maximum(xmean ** (k / grid), 1e-4).astype(np.float32)
        s = s / np.sqrt(s.max() * s.min())
        err = 0.0
        for w, spec in zip(ws, specs, strict=True):
            err += sample_error(fake_quant(w * s, spec, dtype) / s - w, x)
        if best is None or err < best:
            best, best_s = err, s
    return best_s


def search_clip(w: np.ndarray, h: np.ndarray, spec, dtype, steps: int = 10) -> np.ndarray:
    """Per group range shrink [out, groups] in {1, 0.95, ..., 0.55}: the one with the least
    output error of the group, error_g^T H_gg error_g (H's diagonal block of the group)."""
    g = spec.group_size
    out, n = w.shape
    hb = np.stack([h[i : i + g, i : i + g] for i in range(0, n, g)])  # [groups, g, g]
    best_err = np.full((out, n // g), np.inf, np.float32)
    best = np.ones((out, n // g), np.float32)
    for k in range(steps):
        p = np.float32(1.0 - 0.05 * k)
        shrink = np.full((out, n // g), p, np.float32)
        e = (fake_quant(w, spec, dtype, shrink) - w).reshape(out, n // g, g).transpose(1, 0, 2)
        err = (np.matmul(e, hb) * e).sum(-1).T  # [out, groups]; a batched BLAS product
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, p, best)
    return best


def gptq_codes(w: np.ndarray, h: np.ndarray, grid: Grid, block: int = 128) -> np.ndarray:
    """Codes [out, in] for w on a fixed `grid`, chosen column by column with each column's
    rounding error spread over the later columns by the inverse Hessian (GPTQ)."""
    w = w.astype(np.float32).copy()
    n = w.shape[1]
    h = h.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(n)] += 0.01 * np.mean(np.diag(h))
    # upper Cholesky factor of H^-1: row i holds the update weights for columns after i
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T.astype(np.float32)
    q = np.zeros(w.shape, np.uint32)
    for i0 in range(0, n, block):
        i1 = min(i0 + block, n)
        wb = w[:, i0:i1].copy()
        err = np.zeros_like(wb)
        hb = hinv[i0:i1, i0:i1]
        for j in range(i1 - i0):
            col = slice(i0 + j, i0 + j + 1)
            qj = grid.codes(wb[:, j : j + 1], col)
            q[:, i0 + j] = qj[:, 0]
            e = (wb[:, j] - grid.values(qj, col)[:, 0]) / hb[j, j]
            wb[:, j + 1 :] -= np.outer(e, hb[j, j + 1 :])
            err[:, j] = e
        w[:, i1:] -= err @ hinv[i0:i1, i1:]
    return q
