"""Numpy reference quantizer: the bit-exact twin of `mx.quantize` / `mx.dequantize`.

Every stored byte (packed weight, scales, biases) and every dequantized value equals what
MLX 0.32 produces on the CPU for float32, float16 and bfloat16 inputs. bfloat16 travels as
its raw uint16 bits (numpy has no bfloat16; see `mlxrun.weights`).

The rules, as MLX implements them (T is the input dtype):

affine (per group of G values, all arithmetic in float32):
    n = 2**bits - 1; lo, hi = min, max of the group
    s = max((hi - lo) / n, 1e-7); the edge is lo if |lo| > |hi| (s > 0), else hi (s = -s)
    q0 = rint(edge / s); if q0 != 0: s = edge / q0, b = edge   (so 0.0 is exactly on the grid)
                         else:       b = 0
    q = clip(rint((w - b) / s), 0, n)       -- with the float32 s and b, before rounding
    stored: scales = T(s), biases = T(b)    -- rounded to the input dtype (RNE)
    dequantize: T(T(q * scales) + biases)   -- each operation rounded to T

mxfp4 / mxfp8 (G = 32, E8M0 scales):
    s = T(max|w| / m), m = 6 (E2M1) or 448 (E4M3), rounded to the input dtype
    e = ceil(log2(s)) exactly (the smallest power of two >= s); e = 0 when s == 0
    scale byte = (e + 127) mod 256          -- MLX wraps for s < 2**-127 (degenerate groups)
    x = w / 2**e; mxfp4: E2M1 nearest, ties to the smaller magnitude, tiny negatives to +0
    (the first entry of the code table at the least float32 distance: MLX's argmin);
    mxfp8: E4M3 round-to-nearest-even, |x| >= 448 saturates to +-448
    dequantize (dtype D, bf16 by default): D(value * D(2**(byte - 127)))

nvfp4 (G = 16, E4M3 scales):
    byte = E4M3(T(max|w| / 6)) (RNE; groups with max|w| below ~6 * 2**-10 get scale 0)
    x = T(w / E4M3value(byte)) (the quotient rounded to the input dtype), then E2M1 as
    above; a zero scale stores code 0 everywhere
    dequantize: D(value * D(E4M3value(byte)))

Where a power-of-two scale sits below the true range (never for E8M0: it rounds up) or the
E4M3 scale rounds down, |x| can exceed the largest code; those values saturate (6 or 448).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from mlxrun.errors import MlxrunError
from mlxrun.quant.formats import QuantSpec
from mlxrun.weights import bf16_bits

FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# E2M1 code -> value; codes 8..15 are the negatives (8 is -0.0)
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
# midpoints between consecutive E2M1 magnitudes; a tie goes to the lower magnitude because
# MLX takes the first minimum of |x - value| over the table above (argmin)
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    """All 256 E4M3 (fn) values as float32: bias 7, 3 mantissa bits, 0x7F/0xFF are NaN."""
    b = np.arange(256, dtype=np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()


# ---------------------------------------------------------------- dtype rounding


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded (nearest even) to `dtype` precision, returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_to_float32(bf16_bits(x))
    raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, not {dtype!r}")


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values already rounded to `dtype` -> the array MLX would hand to numpy."""
    if dtype == "float32":
        return x.astype(np.float32)
    if dtype == "float16":
        return x.astype(np.float16)
    return bf16_bits(x)


# ---------------------------------------------------------------- element codes


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes (uint8, 0..15) as MLX picks them: the first table entry at the
    least float32 distance |x - value|. So: nearest, ties to the smaller magnitude, values
    in [-0.25, 0] -> +0 (code 0), |x| > 5 -> 6.0; NaN -> 0, and for |x| beyond ~2**22 the
    distances round together and the first entry, +0, wins (only reachable through a
    saturated nvfp4 scale, i.e. group maxima above 2688)."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.searchsorted(_E2M1_MIDPOINTS, np.abs(x), side="left").astype(np.uint8)
    codes = np.where((x < 0) & (mag > 0), mag | 8, mag).astype(np.uint8)
    with np.errstate(invalid="ignore"):
        far = ~(np.abs(x) <= 8.0)  # NaN too; below 8 every distance is exact in float32
    if far.any():
        with np.errstate(invalid="ignore", over="ignore"):
            dist = np.abs(x[far][:, None] - E2M1_VALUES)
        codes[far] = np.argmin(dist, axis=-1)  # numpy, like MLX, keeps the first minimum
    return codes


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (0..15) -> float32 values."""
    return E2M1_VALUES[np.asarray(codes) & 0xF]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 bytes as MLX's `to_fp8`: nearest even, |x| >= 448 (also inf and NaN)
    saturates to 0x7E with the sign of x, never the NaN code."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    sign = np.signbit(x).astype(np.uint8) << 7
    with np.errstate(invalid="ignore"):
        sat = ~(a < 448.0)  # NaN included
        a = np.where(sat, 0.0, a).astype(np.float32)
    # subnormals: multiples of 2**-9 below 2**-6; scaling by a power of two is exact, rint is
    # nearest-even, and 8 * 2**-9 carries into the smallest normal (code 0x08) by itself
    sub = np.rint(a * np.float32(512.0))
    mant, exp = np.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    frac = np.rint((mant * np.float32(2.0) - np.float32(1.0)) * np.float32(8.0))
    norm = (exp - 1 + 7) * 8 + frac  # (biased exponent << 3) + mantissa; a carry rolls over
    code = np.where(a < 2.0**-6, sub, norm).astype(np.int64)
    code = np.where(sat, 0x7E, code)
    return (code.astype(np.uint8) & 0x7F) | sign


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """E4M3 bytes -> float32 values (0x7F / 0xFF -> NaN)."""
    return E4M3_VALUES[np.asarray(b, dtype=np.uint8)]


def _ceil_log2(s: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(s)) for positive finite float32 s, subnormals included (int64)."""
    mant, exp = np.frexp(np.asarray(s, dtype=np.float64))
    return np.where(mant == 0.5, exp - 1, exp).astype(np.int64)


def e8m0_encode(s: np.ndarray) -> np.ndarray:
    """Group scales (float32, >= 0) -> E8M0 bytes as MLX does: the smallest power of two
    2**e >= s, byte = (e + 127) mod 256; s == 0 -> 127 (scale 1). The values are divided by
    2**`e8m0_exponent(s)`, which differs from the byte only where MLX wraps (s < 2**-127)."""
    return ((e8m0_exponent(s) + 127) & 0xFF).astype(np.uint8)


def e8m0_exponent(s: np.ndarray) -> np.ndarray:
    """The exponent e MLX divides the group by: ceil(log2(s)), 0 when s == 0 (int64)."""
    s = np.asarray(s, dtype=np.float32)
    return np.where(s == 0, 0, _ceil_log2(np.where(s == 0, 1.0, s)))


def e8m0_decode(b: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2**(b - 127); 0 -> 2**-127 (subnormal), 255 -> inf as in MLX."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int32)
    with np.errstate(over="ignore"):
        return np.ldexp(np.float32(1.0), b - 127).astype(np.float32)


def float_scales(s: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """A float format's group scales (float32, already rounded to the input dtype) -> their
    bytes (uint8) and the float32 divisor each stands for, as MLX computes them: E4M3 for
    nvfp4, E8M0 (a power of two, `e8m0_exponent`) for mxfp4 and mxfp8."""
    with np.errstate(divide="ignore", invalid="ignore"):
        if mode == "nvfp4":
            b = e4m3_encode(s)
            return b, e4m3_decode(b)
        b = e8m0_encode(s)
        return b, np.ldexp(np.float32(1.0), e8m0_exponent(s)).astype(np.float32)


# ---------------------------------------------------------------- bit packing


def _block(bits: int) -> tuple[int, int]:
    """(values, uint32 words) of the smallest run that ends on a word boundary."""
    values = 32 // math.gcd(32, bits)
    return values, values * bits // 32


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Integer values `[..., n]` (each < 2**bits) -> uint32 `[..., n*bits/32]`.

    Value i of a row sits at bit offset i*bits of the row's little-endian bit stream, least
    significant bit first; with 3, 5 or 6 bits a value may straddle two words.
    """
    q = np.asarray(q)
    n = q.shape[-1]
    if not 1 <= bits <= 8 or (n * bits) % 32:
        raise ValueError(f"cannot pack {n} values of {bits} bits into whole uint32 words")
    if q.size and (q.min() < 0 or q.max() >= (1 << bits)):
        raise ValueError(f"values do not fit in {bits} bits")
    nv, nw = _block(bits)
    v = q.reshape(*q.shape[:-1], n // nv, nv).astype(np.uint64)
    words = np.zeros((*v.shape[:-1], nw), dtype=np.uint64)
    for j in range(nv):
        wi, sh = divmod(j * bits, 32)
        words[..., wi] |= v[..., j] << np.uint64(sh)
    # bits that spilled past bit 31 belong to the low end of the next word
    for wi in range(nw - 1):
        words[..., wi + 1] |= words[..., wi] >> np.uint64(32)
    words &= np.uint64(0xFFFFFFFF)
    return words.astype(np.uint32).reshape(*q.shape[:-1], n * bits // 32)


def unpack(packed: np.ndarray, bits: int, n: int | None = None) -> np.ndarray:
    """uint32 `[..., w]` -> uint8 values `[..., n]` (n defaults to w*32/bits); see `pack`."""
    packed = np.asarray(packed, dtype=np.uint32)
    nv, nw = _block(bits)
    w = packed.shape[-1]
    if w % nw:
        raise ValueError(f"{w} words do not hold whole runs of {bits}-bit values")
    p = packed.reshape(*packed.shape[:-1], w // nw, nw).astype(np.uint64)
    out = np.empty((*p.shape[:-1], nv), dtype=np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for j in range(nv):
        wi, sh = divmod(j * bits, 32)
        val = p[..., wi] >> np.uint64(sh)
        if sh + bits > 32:
            val |= p[..., wi + 1] << np.uint64(32 - sh)
        out[..., j] = (val & mask).astype(np.uint8)
    out = out.reshape(*packed.shape[:-1], w * 32 // bits)
    return out if n is None else out[..., :n]


# ---------------------------------------------------------------- quantize


def _input(w: np.ndarray, bf16: bool, name: str, group_size: int) -> tuple[np.ndarray, str]:
    """Check a weight and return (float32 values `[..., in]`, its dtype name)."""
    w = np.asarray(w)
    if bf16:
        if w.dtype != np.uint16:
            raise TypeError(f"bf16=True wants uint16 bfloat16 bits, got {w.dtype}")
        vals, dtype = bf16_to_float32(w), "bfloat16"
    elif w.dtype == np.float16:
        vals, dtype = w.astype(np.float32), "float16"
    elif w.dtype in (np.float32, np.float64):
        # float64 has no MLX counterpart: it is rounded to float32 first
        vals, dtype = w.astype(np.float32), "float32"
    else:
        raise TypeError(f"cannot quantize {w.dtype}; pass float32/float16, or bf16 bits")
    if w.ndim < 1 or w.shape[-1] % group_size:
        raise MlxrunError(
            f"cannot quantize {name}: its last dimension ({w.shape[-1] if w.ndim else 0}) is "
            f"not a multiple of the group size {group_size}; pick another group size or "
            "keep this tensor unquantized"
        )
    bad = ~np.isfinite(vals)
    if bad.any():
        what = "NaN" if np.isnan(vals).any() else "infinite"
        raise MlxrunError(
            f"cannot quantize {name}: it holds {int(bad.sum())} {what} value(s); the "
            "checkpoint is corrupt or overflowed, re-download or re-export it"
        )
    return vals, dtype


def _affine_params(lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """MLX's float32 (scale, bias) for groups spanning [lo, hi] (any matching shapes)."""
    n_bins = np.float32((1 << bits) - 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.maximum((hi - lo) / n_bins, np.float32(1e-7))
        neg_edge = np.abs(lo) > np.abs(hi)
        scale = np.where(neg_edge, scale, -scale)
        edge = np.where(neg_edge, lo, hi)
        q0 = np.rint(edge / scale)
        nz = q0 != 0
        scale = np.where(nz, edge / np.where(nz, q0, np.float32(1.0)), scale)
        bias = np.where(nz, edge, np.float32(0.0))
    return scale.astype(np.float32), bias.astype(np.float32)


def _affine_codes(wg: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> np.ndarray:
    """Codes of groups `[..., G]` for float32 scale/bias `[..., 1]`: clip(rint((w - b)/s))."""
    q = np.rint((wg - bias) / scale)
    return np.clip(q, 0, (1 << bits) - 1).astype(np.uint8)


def _affine_dequant(q: np.ndarray, scale: np.ndarray, bias: np.ndarray, dtype: str) -> np.ndarray:
    """MLX's dequantize: T(T(q * s) + b) with s, b already in T (float32 `[..., 1]`)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return round_to(round_to(q.astype(np.float32) * scale, dtype) + bias, dtype)


def _clip_search(wg: np.ndarray, bits: int, dtype: str, grid: int) -> tuple:
    """Least-squared-error scale/bias per group `[..., G]`, searched over the stored format.

    Candidates: MLX's own result, then min-max grids over [lo*a, hi*b] for `grid` shrinks
    a, b in (0.5, 1] of each end (a clipped outlier costs less than a coarse grid for every
    other value), then a few rounds of a least-squares refit of scale and bias to the
    chosen codes. Every candidate is scored with the stored (dtype-rounded) scale and bias
    and MLX's dequantize rounding; a group only ever moves to a lower error.
    """
    n_bins = np.float32((1 << bits) - 1)
    lo = wg.min(-1, keepdims=True)
    hi = wg.max(-1, keepdims=True)

    def score(s32, b32):
        s, b = round_to(s32, dtype), round_to(b32, dtype)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = _affine_codes(wg, s, b, bits)
        return q, s, b, ((_affine_dequant(q, s, b, dtype) - wg) ** 2).sum(-1, keepdims=True)

    s32, b32 = _affine_params(lo, hi, bits)
    q = _affine_codes(wg, s32, b32, bits)  # exactly MLX's codes, as the starting point
    best_s, best_b = round_to(s32, dtype), round_to(b32, dtype)
    best_q = q
    err = ((_affine_dequant(q, best_s, best_b, dtype) - wg) ** 2).sum(-1, keepdims=True)

    def keep(cand) -> None:
        nonlocal best_q, best_s, best_b, err
        q, s, b, e = cand
        better = e < err
        best_q = np.where(better, q, best_q)
        best_s, best_b = np.where(better, s, best_s), np.where(better, b, best_b)
        err = np.where(better, e, err)

    shrinks = [np.float32(1.0 - 0.5 * k / grid) for k in range(grid)]
    for a, b in itertools.product(shrinks, shrinks):
        lo_c, hi_c = lo * a, hi * b
        keep(score(np.maximum((hi_c - lo_c) / n_bins, np.float32(1e-7)), lo_c))
    for _ in range(3):  # refit w ~ s*q + b to the current codes
        q = best_q.astype(np.float32)
        qm, wm = q.mean(-1, keepdims=True), wg.mean(-1, keepdims=True)
        var = ((q - qm) ** 2).sum(-1, keepdims=True)
        cov = ((q - qm) * (wg - wm)).sum(-1, keepdims=True)
        ok = var > 0
        s_fit = np.where(ok, cov / np.where(ok, var, 1), best_s).astype(np.float32)
        s_fit = np.where(np.abs(s_fit) < 1e-7, best_s, s_fit)
        keep(score(s_fit, (wm - s_fit * qm).astype(np.float32)))
    return best_q, best_s, best_b


def quantize(
    w: np.ndarray,
    spec: QuantSpec,
    *,
    bf16: bool = False,
    name: str = "weight",
    clip_search: bool = False,
    clip_grid: int = 6,
) -> dict[str, np.ndarray]:
    """Quantize `w` `[..., in]` exactly as `mx.quantize(w, G, bits, mode=...)` does.

    Returns {"weight": uint32 `[..., in*bits/32]`, "scales": `[..., in/G]`} plus "biases"
    for affine. Affine scales/biases have the input dtype (uint16 bf16 bits when
    bf16=True); the float modes' scales are uint8 (E8M0 or E4M3 bytes).

    clip_search=True (affine only) searches each group's scale and bias for the least
    squared error after dequantization (`clip_grid`**2 clipped ranges plus a least-squares
    refit, about 40 passes over the tensor; see `_clip_search`). The bytes are still the
    canonical format, but no longer identical to MLX's.
    float64 input is rounded to float32 first (MLX has no float64 quantization).
    Raises MlxrunError for NaN/inf values or a last dimension not divisible by G.
    """
    spec.validate()
    vals, dtype = _input(w, bf16, name, spec.group_size)
    g, bits = spec.group_size, spec.bits
    lead, n = vals.shape[:-1], vals.shape[-1]
    wg = vals.reshape(*lead, n // g, g)

    if spec.mode == "affine":
        if clip_search:
            # row chunks of ~1M values keep the per-candidate temporaries small
            flat = wg.reshape(-1, n // g, g)
            step = max(1, (1 << 20) // n)
            parts = [
                _clip_search(flat[i : i + step], bits, dtype, clip_grid)
                for i in range(0, len(flat), step)
            ]
            q, s, b = (
                np.concatenate(p).reshape(*lead, n // g, -1) for p in zip(*parts, strict=True)
            )
        else:
            lo, hi = wg.min(-1, keepdims=True), wg.max(-1, keepdims=True)
            s32, b32 = _affine_params(lo, hi, bits)
            q = _affine_codes(wg, s32, b32, bits)  # from the unrounded float32 scale/bias
            s, b = round_to(s32, dtype), round_to(b32, dtype)
        return {
            "weight": pack(q.reshape(*lead, n), bits),
            "scales": _store(s[..., 0], dtype),
            "biases": _store(b[..., 0], dtype),
        }
    if clip_search:
        raise MlxrunError(f"clip search applies to affine formats only, not {spec.label}")

    maxval = np.float32(6.0 if bits == 4 else 448.0)
    # the group scale is computed in the input dtype: amax / maxval rounded to T
    s = round_to(np.abs(wg).max(-1, keepdims=True) / maxval, dtype)
    sbytes, div = float_scales(s, spec.mode)
    with np.errstate(divide="ignore", invalid="ignore"):
        # the quotient is rounded to the input dtype (exact for the powers of two of E8M0)
        x = round_to(wg / div, dtype)
    if bits == 4:
        codes = e2m1_encode(x)  # a zero nvfp4 scale gives 0/0 or +-inf: code 0 (+0)
    else:
        codes = e4m3_encode(x)
    return {"weight": pack(codes.reshape(*lead, n), bits), "scales": sbytes[..., 0]}


# ---------------------------------------------------------------- dequantize


def dequantize(
    weight: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray | None,
    spec: QuantSpec,
    *,
    bf16: bool = False,
    dtype: str | None = None,
) -> np.ndarray:
    """Float32 `[..., in]` equal to `mx.dequantize(...)` cast to float32.

    Affine computes in the scales' dtype (float32/float16, or bfloat16 when bf16=True and
    scales/biases are uint16 bits), rounding after the multiply and after the add; `dtype`
    only casts the result, as in MLX. The float modes compute in `dtype`, default
    "bfloat16" like `mx.dequantize`: D(value * D(scale)).
    """
    spec.validate()
    g, bits = spec.group_size, spec.bits
    weight = np.asarray(weight, dtype=np.uint32)
    q = unpack(weight, bits)
    lead, n = q.shape[:-1], q.shape[-1]
    if scales.shape != (*lead, n // g):
        raise ValueError(f"scales {scales.shape} do not match weight {weight.shape} for {spec}")
    qg = q.reshape(*lead, n // g, g)

    if spec.mode == "affine":
        if biases is None or biases.shape != scales.shape:
            raise ValueError("affine dequantize needs biases shaped like the scales")
        if bf16:
            sdt, s, b = "bfloat16", bf16_to_float32(scales), bf16_to_float32(biases)
        elif scales.dtype not in (np.float32, np.float16):
            raise TypeError(
                f"affine scales must be float32/float16 or bf16 bits, not {scales.dtype}"
            )
        else:
            sdt = "float16" if scales.dtype == np.float16 else "float32"
            s, b = scales.astype(np.float32), biases.astype(np.float32)
        out = _affine_dequant(qg, s[..., None], b[..., None], sdt)
        return round_to(out, dtype or sdt).reshape(*lead, n)

    if scales.dtype != np.uint8:
        raise TypeError(f"{spec.mode} scales are uint8 bytes, not {scales.dtype}")
    dtype = dtype or "bfloat16"
    if spec.mode == "nvfp4":
        sc = round_to(e4m3_decode(scales), dtype)
    else:
        sc = round_to(e8m0_decode(scales), dtype)
    vals = e2m1_decode(qg) if bits == 4 else e4m3_decode(qg)
    with np.errstate(invalid="ignore", over="ignore"):
        out = round_to(vals * sc[..., None], dtype)
    return out.reshape(*lead, n)
