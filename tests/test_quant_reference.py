"""The numpy reference quantizer against its oracle, mx.quantize / mx.dequantize (MLX CPU):
packed weights, scales, biases and dequantized values equal bit for bit, for every mode,
width, group size and input dtype; plus hand-computed values and the formats' errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mlxrun.errors import MlxrunError
from mlxrun.quant import formats as F
from mlxrun.quant import reference as R
from mlxrun.quant.formats import QuantSpec
from mlxrun.weights import bf16_bits

mx = pytest.importorskip("mlx.core")

DTYPES = ["float32", "float16", "bfloat16"]
SPECS = [
    QuantSpec(mode, bits, g)
    for mode, (bits_ok, groups_ok) in F.ALLOWED.items()
    for bits, g in itertools.product(sorted(bits_ok), sorted(groups_ok))
]
FP_SPECS = [s for s in SPECS if s.mode != "affine"]


def _inputs(vals: np.ndarray, dtype: str):
    """float32 values -> (numpy input for the reference, mx array), same numbers in both."""
    vals = np.asarray(vals, dtype=np.float32)
    if dtype == "float32":
        return vals, mx.array(vals)
    if dtype == "float16":
        v = vals.astype(np.float16)
        return v, mx.array(v)
    b = bf16_bits(vals)
    return b, mx.array(b).view(mx.bfloat16)


def _np(a) -> np.ndarray:
    """An mx array as numpy, bfloat16 as its uint16 bits."""
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _mx_dequantize(out, spec: QuantSpec, dtype: str | None = None) -> np.ndarray:
    kw = dict(group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    if dtype:
        kw["dtype"] = getattr(mx, dtype)
    biases = out[2] if spec.has_biases else None
    return np.array(mx.dequantize(out[0], out[1], biases, **kw).astype(mx.float32))


def _check(vals: np.ndarray, spec: QuantSpec, dtype: str) -> None:
    """Reference == MLX on every stored array (raw bits and dtype) and on dequantize."""
    wn, wm = _inputs(vals, dtype)
    bf16 = dtype == "bfloat16"
    out = mx.quantize(wm, spec.group_size, spec.bits, mode=spec.mode)
    ref = R.quantize(wn, spec, bf16=bf16)
    names = ["weight", "scales", "biases"] if spec.has_biases else ["weight", "scales"]
    assert sorted(ref) == sorted(names)
    for arr, key in zip(out, names, strict=True):
        got = _np(arr)
        assert ref[key].dtype == got.dtype, key
        assert np.array_equal(ref[key], got), f"{key} differs in {np.sum(ref[key] != got)} places"
    # dequantize: MLX's default output dtype, and each explicit one for the float modes
    for ddt in [None] if spec.has_biases else [None, *DTYPES]:
        want = _mx_dequantize(out, spec, ddt)
        got = R.dequantize(
            ref["weight"], ref["scales"], ref.get("biases"), spec, bf16=bf16, dtype=ddt
        )
        assert got.dtype == np.float32 and got.shape == vals.shape
        assert np.array_equal(got, want, equal_nan=True), f"dequantize ({ddt}) differs"


def _cases(spec: QuantSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Random tensors of two shapes and the edge cases, as float32 values."""
    g = spec.group_size
    out = [rng.standard_normal((64, 256)) * 0.02, rng.standard_normal((3, 128))]
    edge = rng.standard_normal((12, 128)).astype(np.float32)
    edge[0] = 0.0  # all-zero groups
    edge[1] = 0.37  # constant groups
    edge[2, :g] = -2.5  # one constant negative group among random ones
    edge[3] *= 1e4  # very large magnitudes
    edge[4] *= 1e-6  # very small magnitudes
    edge[5] = -np.abs(edge[5])  # negative only
    edge[6] = np.abs(edge[6]) + 3.0  # positive only, away from zero
    edge[7, ::2] *= -1  # mixed signs, alternating
    edge[8, g // 2 :] = 0.0  # half-zero groups
    edge[9] *= np.exp(rng.uniform(-14, 10, 128))  # wildly mixed magnitudes in a row
    edge[10] = np.linspace(-1, 1, 128)
    edge[11, 1::2] = 0.0
    return [*out, edge]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.bits}b-g{s.group_size}")
def test_matches_mlx(spec, dtype):
    rng = np.random.default_rng(spec.bits * 1000 + spec.group_size)
    for vals in _cases(spec, rng):
        _check(vals, spec, dtype)


def _all_values(dtype: str) -> np.ndarray:
    """Every finite value of a 16-bit float type, as float32."""
    if dtype == "bfloat16":
        v = R.bf16_to_float32(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
    else:
        v = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    v = v.astype(np.float32)
    return v[np.isfinite(v)]


# the scale of every mode, and affine's, for every possible group maximum
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "spec",
    [*FP_SPECS, QuantSpec("affine", 4, 32), QuantSpec("affine", 3, 32)],
    ids=lambda s: f"{s.mode}-{s.bits}b",
)
def test_every_group_maximum(spec, dtype):
    v = _all_values(dtype)
    v = v[v > 0][: (v > 0).sum() // 2 * 2]
    w = np.zeros((len(v), spec.group_size), np.float32)
    w[:, 0], w[:, 1] = v, -v / 3
    _check(R.round_to(w, dtype), spec, dtype)


# every value of the type quantized under a spread of group maxima (every E4M3 scale for nvfp4)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "spec", [*FP_SPECS, QuantSpec("affine", 4, 64)], ids=lambda s: f"{s.mode}-{s.bits}b"
)
def test_every_element_value(spec, dtype):
    v = _all_values(dtype)
    g = spec.group_size
    if spec.mode == "nvfp4":
        maxima = 6 * R.E4M3_VALUES[1:127]
    else:
        maxima = np.float32([1.0, 0.7, 3.3, 0.013, 100.0, 1e-3, 5e-5, 2e4])
    rows = []
    for amax in R.round_to(maxima, dtype):
        if not 0 < amax < np.inf:
            continue
        x = v[(np.abs(v) <= amax) & (np.abs(v) >= amax * 2.0**-12)]
        x = np.concatenate([x, np.zeros(-len(x) % (g - 1), np.float32)]).reshape(-1, g - 1)
        rows.append(np.concatenate([np.full((len(x), 1), amax, np.float32), x], axis=1))
    w = np.concatenate(rows)
    _check(w[: len(w) // 2 * 2], spec, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", FP_SPECS, ids=lambda s: s.mode)
def test_dequantize_every_scale_byte(spec, dtype):
    rng = np.random.default_rng(0)
    scales = np.repeat(np.arange(256, dtype=np.uint8), 2)[:, None]
    codes = rng.integers(0, 1 << spec.bits, (512, spec.group_size)).astype(np.uint8)
    wq = R.pack(codes, spec.bits)
    want = mx.dequantize(
        mx.array(wq),
        mx.array(scales),
        group_size=spec.group_size,
        bits=spec.bits,
        mode=spec.mode,
        dtype=getattr(mx, dtype),
    )
    got = R.dequantize(wq, scales, None, spec, dtype=dtype)
    assert np.array_equal(got, np.array(want.astype(mx.float32)), equal_nan=True)


# ---------------------------------------------------------------- hand-computed values


def test_affine_hand_example():
    spec = QuantSpec("affine", 2, 32)
    w = np.zeros((2, 32), np.float32)
    # [-1, 2]: s = -(3/3) = -1, the edge is max = 2, q0 = rint(2 / -1) = -2 -> s = -1, b = 2;
    # q = rint((w - 2) / -1): 0.5 -> rint(1.5) = 2 and 1.5 -> rint(0.5) = 0 (ties to even)
    w[0, :5] = [-1.0, 0.0, 2.0, 0.5, 1.5]
    # [-3, 1]: |min| wins, s = 4/3, q0 = rint(-3 / (4/3)) = rint(-2.25) = -2 -> s = 1.5,
    # b = -3: zero stays exact (code 2), and the maximum 1 moves to 1.5 (code 3)
    w[1, :3] = [-3.0, 0.0, 1.0]
    out = R.quantize(w, spec)
    assert out["scales"].tolist() == [[-1.0], [1.5]]
    assert out["biases"].tolist() == [[2.0], [-3.0]]
    q = R.unpack(out["weight"], 2)
    assert q[0, :5].tolist() == [3, 2, 0, 2, 0] and q[1, :3].tolist() == [0, 2, 3]
    deq = R.dequantize(out["weight"], out["scales"], out["biases"], spec)
    assert deq[0, :5].tolist() == [-1.0, 0.0, 2.0, 0.0, 2.0]
    assert deq[1, :3].tolist() == [-3.0, 0.0, 1.5]


def test_pack_layout():
    q = np.arange(1, 9, dtype=np.uint8)[None]  # 1..8 at 4 bits: nibble i = value i
    assert R.pack(q, 4).tolist() == [[0x87654321]]
    # 3 bits straddle words: value 10 (0..31) of a 32-run starts at bit 30 of word 0
    v = np.zeros((1, 32), np.uint8)
    v[0, 10] = 0b101
    assert R.pack(v, 3).tolist() == [[0x40000000, 0x00000001, 0]]
    rng = np.random.default_rng(1)
    for bits in (2, 3, 4, 5, 6, 8):
        q = rng.integers(0, 1 << bits, (3, 5, 64)).astype(np.uint8)
        assert np.array_equal(R.unpack(R.pack(q, bits), bits), q)


def test_code_helpers():
    x = np.float32([0.25, 0.26, 0.75, 1.25, 2.5, 5.0, 5.01, 9.0, -0.2, -0.75, -7.0])
    assert R.e2m1_decode(R.e2m1_encode(x)).tolist() == [
        0.0,
        0.5,
        0.5,
        1.0,
        2.0,
        4.0,
        6.0,
        6.0,
        0.0,
        -0.5,
        -6.0,
    ]
    assert R.e2m1_encode(np.float32([-0.2]))[0] == 0  # +0, not -0
    e4 = R.e4m3_encode(
        np.float32([1.0, 448.0, 1000.0, -1e9, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 0.1, np.nan])
    )
    assert e4.tolist() == [0x38, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x02, 0x1D, 0x7E]
    assert R.e4m3_decode(np.uint8([0x38, 0x7E, 0x01, 0x1D])).tolist() == [
        1.0,
        448.0,
        2.0**-9,
        0.1015625,
    ]
    s = np.float32([0.0, 1.0, 1.0000001, 0.75, 0.5, 2.0**-127, 2.0**-130])
    assert R.e8m0_encode(s).tolist() == [127, 127, 128, 127, 126, 0, 253]  # last one wraps
    assert R.e8m0_decode(np.uint8([127, 128, 0])).tolist() == [1.0, 2.0, 2.0**-127]


def test_rounding_helpers():
    assert R.round_to(np.float32([1 + 2**-8, 1 + 3 * 2**-9]), "bfloat16").tolist() == [
        1.0,
        1 + 2**-7,
    ]  # ties to even
    assert R.round_to(np.float32([70000.0]), "float16").tolist() == [np.inf]


# ---------------------------------------------------------------- clip search


def test_clip_search_lowers_error():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 512)).astype(np.float32) * 0.02
    w[rng.random(w.shape) < 0.01] *= 12  # outliers stretch some groups' ranges
    spec = QuantSpec("affine", 4, 64)
    for dtype in ("float32", "bfloat16"):
        wn, _ = _inputs(w, dtype)
        bf16 = dtype == "bfloat16"
        truth = R.round_to(w, dtype)
        plain = R.quantize(wn, spec, bf16=bf16)
        clip = R.quantize(wn, spec, bf16=bf16, clip_search=True)
        err = {}
        for name, out in (("plain", plain), ("clip", clip)):
            deq = R.dequantize(out["weight"], out["scales"], out["biases"], spec, bf16=bf16)
            # still the canonical format: MLX reads the same bytes to the same values
            mxo = [mx.array(out["weight"])]
            for k in ("scales", "biases"):
                a = mx.array(out[k])
                mxo.append(a.view(mx.bfloat16) if bf16 else a)
            assert np.array_equal(deq, _mx_dequantize(mxo, spec))
            err[name] = float(np.mean((deq - truth) ** 2))
        assert err["clip"] < 0.9 * err["plain"], err
    with pytest.raises(MlxrunError, match="affine"):
        R.quantize(w, QuantSpec("mxfp4", 4, 32), clip_search=True)


# ---------------------------------------------------------------- refusals and formats


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_refuses_non_finite(bad):
    w = np.zeros((2, 64), np.float32)
    w[1, 5] = bad
    with pytest.raises(MlxrunError, match="model.layers.3.mlp.up_proj.weight"):
        R.quantize(w, F.resolve("int4"), name="model.layers.3.mlp.up_proj.weight")
    with pytest.raises(MlxrunError, match="lm_head"):
        R.quantize(bf16_bits(w), F.resolve("fp4"), bf16=True, name="lm_head.weight")


def test_refuses_bad_group():
    with pytest.raises(
        MlxrunError, match="group size 48 is not allowed for int4 \\(affine\\): use 32, 64 or 128"
    ):
        F.resolve("int4", group_size=48)
    with pytest.raises(
        MlxrunError, match="group size 64 is not allowed for fp4 \\(mxfp4\\): use 32"
    ):
        F.resolve("fp4", group_size=64)
    with pytest.raises(MlxrunError, match="multiple of the group size 64"):
        R.quantize(np.zeros((2, 96), np.float32), F.resolve("int4"), name="x")
    with pytest.raises(MlxrunError, match="use 2, 3, 4, 5, 6 or 8 bits"):
        QuantSpec("affine", 7, 64).validate()


def test_resolve():
    assert F.resolve("int4") == QuantSpec("affine", 4, 64)
    assert F.resolve("INT8", group_size=128) == QuantSpec("affine", 8, 128)
    assert F.resolve("fp8") == QuantSpec("mxfp8", 8, 32)
    assert F.resolve("fp4", bits=4) == QuantSpec("mxfp4", 4, 32)
    assert F.resolve("nvfp4") == QuantSpec("nvfp4", 4, 16)
    with pytest.raises(MlxrunError, match="int4, int8, fp8, fp4 or nvfp4"):
        F.resolve("q4_k")
    with pytest.raises(MlxrunError, match="use int8 or fp8 for 8-bit"):
        F.resolve("int4", bits=8)
    with pytest.raises(MlxrunError, match="not 3-bit"):
        F.resolve("int4", bits=3)
    with pytest.raises(ValueError):
        F.resolve("auto")


def test_config_round_trip_and_layers():
    assert F.from_config({"group_size": 32, "bits": 8}) == QuantSpec("affine", 8, 32)
    assert F.from_config({"mode": "nvfp4"}) == QuantSpec("nvfp4", 4, 16)
    for spec in SPECS:
        assert F.from_config(F.to_config(spec)) == spec
    with pytest.raises(MlxrunError, match="'fp6'.*affine, mxfp4, nvfp4 or mxfp8"):
        F.from_config({"group_size": 32, "bits": 6, "mode": "fp6"})
    with pytest.raises(MlxrunError, match="integer"):
        F.from_config({"group_size": "64", "bits": 4})
    q = {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
        "model.embed_tokens": False,
        "lm_head": {"mode": "mxfp8"},
    }
    assert F.layer_spec(q, "model.layers.0.self_attn.q_proj") == QuantSpec("affine", 4, 64)
    assert F.layer_spec(q, "model.layers.0.mlp.down_proj") == QuantSpec("affine", 8, 32)
    assert F.layer_spec(q, "model.embed_tokens") is None
    assert F.layer_spec(q, "lm_head") == QuantSpec("mxfp8", 8, 32)


def test_sizes():
    spec = F.resolve("int4")
    assert F.packed_shape(4096, 14336, spec) == {
        "weight": (4096, 1792),
        "scales": (4096, 224),
        "biases": (4096, 224),
    }
    assert F.packed_shape(8, 64, F.resolve("nvfp4")) == {"weight": (8, 8), "scales": (8, 4)}
    assert F.bytes_per_weight(spec, 2) == 0.5 + 4 / 64
    assert F.bytes_per_weight(F.resolve("fp8")) == 1 + 1 / 32
    # the sizes agree with what quantize really stores
    out = R.quantize(np.ones((8, 64), np.float16), F.resolve("int8", group_size=32))
    shapes = F.packed_shape(8, 64, F.resolve("int8", group_size=32))
    assert {k: v.shape for k, v in out.items()} == shapes
    assert sum(v.nbytes for v in out.values()) == 8 * 64 * F.bytes_per_weight(
        F.resolve("int8", group_size=32), 2
    )
    with pytest.raises(MlxrunError, match="not a multiple"):
        F.packed_shape(8, 100, spec)
