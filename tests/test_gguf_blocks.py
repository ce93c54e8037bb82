"""GGUF block types: the numpy reference decode against `gguf.quants.dequantize` (fp32, bit
for bit) on random blocks with edge scales, and the exact affine maps against both."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from mlxrun.errors import MlxrunError
from mlxrun.quant import gguf_blocks as gb
from mlxrun.quant.reference import unpack

Q = gguf.GGMLQuantizationType

# byte offsets of each type's fp16 scale fields inside a block
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
EDGE_F16 = np.array(
    [0.0, -0.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, 1.0, -1.0, np.inf, -np.inf],
    np.float16,
)


def random_rows(kind: str, rows: int, nblocks: int, seed: int, edges: bool) -> np.ndarray:
    """uint8 [rows, nblocks*block_bytes]: random codes and sub-scales (every sign pattern,
    every bit set somewhere); with `edges`, the fp16 (or E8M0) scales cycle through zero,
    the extremes, subnormals and infinities, else they are ordinary small numbers."""
    nbytes, _ = gb.BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, nblocks, nbytes), dtype=np.uint8)
    if kind == "MXFP4":
        if edges:
            e = np.array([0, 1, 2, 100, 127, 128, 200, 253, 254], np.uint8)
            raw[..., 0] = np.resize(e, raw[..., 0].shape)
        else:
            raw[..., 0] = rng.integers(110, 140, raw[..., 0].shape)
        return raw.reshape(rows, -1)
    for i, off in enumerate(F16_FIELDS[kind]):
        if edges:
            d = np.resize(np.roll(EDGE_F16, 3 * i), (rows, nblocks))
        else:
            d = (rng.standard_normal((rows, nblocks)) * 0.01).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, nblocks, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", gb.TYPES)
@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_dequantize_equals_gguf(kind, edges):
    raw = random_rows(kind, rows=7, nblocks=3, seed=len(kind) + edges, edges=edges)
    want = gguf.quants.dequantize(raw, Q[kind])
    got = gb.dequantize(raw, kind)
    assert got.dtype == np.float32 and got.shape == want.shape
    want = want.astype(np.float32)
    # bit for bit (so -0.0 is not 0.0), except a NaN's sign bit (inf * 0 scales)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    if not edges:  # the test sees real values, not only zeros
        assert np.count_nonzero(got) > got.size // 2


@pytest.mark.parametrize("kind", sorted(gb.AFFINE))
def test_to_affine_is_exact(kind):
    raw = random_rows(kind, rows=5, nblocks=2, seed=7, edges=False)
    bits, sdt = gb.AFFINE[kind]
    w, s, b = gb.to_affine(raw, kind)
    n = gb.dequantize(raw, kind).shape[1]
    assert w.dtype == np.uint32 and w.shape == (5, n * bits // 32)
    assert s.dtype == b.dtype == {"F16": np.float16, "F32": np.float32}[sdt]
    q = unpack(w, bits).astype(np.float32).reshape(5, -1, 32)
    got = (s.astype(np.float32)[..., None] * q + b.astype(np.float32)[..., None]).reshape(5, n)
    want = gguf.quants.dequantize(raw, Q[kind])
    np.testing.assert_array_equal(got, want)


def test_k_scales_need_float32():
    """Q4_K's d*sc: fp32 holds every product exactly, fp16 (the canonical scale dtype of the
    16-bit models) rounds most of them, so Q4_K/Q5_K keep fp32 scales."""
    raw = random_rows("Q4_K", rows=64, nblocks=4, seed=3, edges=False)
    dec = gb.decode(raw, "Q4_K")
    d = raw.reshape(64, 4, 144)[..., 0:2].copy().view(np.float16).astype(np.float64)
    sc = gb._k_scales(raw.reshape(64, 4, 144)[..., 4:16])[0].astype(np.float64)
    np.testing.assert_array_equal(dec.scales.reshape(64, 4, 8), d * sc)  # exact in fp32
    rounded = dec.scales.astype(np.float16).astype(np.float32) != dec.scales
    assert rounded.mean() > 0.7  # 0.80 on these blocks


def test_affine_overflow_and_bad_rows():
    raw = random_rows("Q4_0", rows=1, nblocks=1, seed=0, edges=False)
    raw[0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # -8 * d overflows fp16
    with pytest.raises(MlxrunError, match="overflows float16"):
        gb.to_affine(raw, "Q4_0")
    with pytest.raises(MlxrunError, match="whole 144-byte blocks"):
        gb.decode(np.zeros((2, 100), np.uint8), "Q4_K")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_encoders_roundtrip(kind):
    """The benchmark encoders write blocks that decode (by gguf itself) close to the input."""
    from mlxrun.quant.gguf_encode import ENCODERS

    w = (np.random.default_rng(4).standard_normal((6, 512)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero sub-block
    raw = ENCODERS[kind](w)
    assert raw.shape == (6, 2 * gb.BLOCKS[kind][0]) and raw.dtype == np.uint8
    back = gguf.quants.dequantize(raw, Q[kind])
    np.testing.assert_array_equal(back, gb.dequantize(raw, kind))
    assert np.all(back[0, :32] == 0)
    err = np.abs(back - w).max(axis=1) / np.abs(w).max(axis=1)
    assert err.max() < {"Q4_K": 0.12, "Q6_K": 0.03}[kind], err
