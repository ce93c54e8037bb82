"""Fused Triton kernels for MLX-format quantized weights (quant/triton_kernels.py).

Without a GPU the kernels run under TRITON_INTERPRET=1 at small sizes; the oracle is
mx.quantize / mx.dequantize (and an independent numpy decoder of the format, checked bit for
bit against mx.dequantize, which the GPU tests use where mlx is not installed). The oracle
tests run on the GPU where there is one and mlx is installed beside it.
"""

import dataclasses
import importlib
import os
import types

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
from mlxrun.errors import MlxrunError  # noqa: E402

if not HAS_CUDA and type(tk._gemv_kernel).__name__ != "InterpretedFunction":
    # imported earlier without the interpreter: decorate the kernels again (the GEMV module
    # first: the GEMM imports its helpers), then rebind them where qmatmul launches them
    for part in ("triton_gemv", "triton_gemv_stream", "triton_gemm"):
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


# ----------------------------------------------------------------------------- oracle checks


@need_mlx
@pytest.mark.parametrize("mode,bits,group_size", FORMATS, ids=FMT_IDS)
def test_reference_decoder_matches_mlx(mode, bits, group_size):
    mx.random.seed(1)
    w = mx.random.normal((16, 256)) * 0.05
    out = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    want = np.array(mx.dequantize(*out, group_size=group_size, bits=bits, mode=mode,
                                  dtype=mx.float32))  # fmt: skip
    b = np.array(out[2]) if mode == "affine" else None
    got = ref_dequant(np.array(out[0]), np.array(out[1]), b, mode, bits, group_size, f32=True)
    np.testing.assert_array_equal(got.astype(np.float32), want)


@need_mlx
@pytest.mark.parametrize("mode,bits,group_size", FORMATS, ids=FMT_IDS)
def test_prepare_roundtrip_matches_mlx(mode, bits, group_size):
    """prepare() repacks (group-transposed codes, row-tiled scales); dequantize_torch undoes it."""
    mx.random.seed(2)
    w = mx.random.normal((20, 256)) * 0.05  # 20 rows: the scale tiles of 8 rows get padding
    out = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    want = np.array(mx.dequantize(*out, group_size=group_size, bits=bits, mode=mode,
                                  dtype=mx.float32))  # fmt: skip
    biases = np.array(out[2]) if mode == "affine" else None
    q = tk.prepare(np.array(out[0]), np.array(out[1]), biases, mode, bits, group_size)
    assert q.weight.shape == (20, 256 * bits // 32) and q.weight.dtype == torch.int32
    np.testing.assert_array_equal(tk.dequantize_torch(q).numpy(), want)
    if mode == "affine":  # bf16 scales and biases, as in real checkpoints
        s16, b16 = (torch.from_numpy(np.array(a)).to(torch.bfloat16) for a in out[1:])
        q16 = tk.prepare(np.array(out[0]), s16, b16, mode, bits, group_size)
        ref = ref_dequant(np.array(out[0]), s16.float().numpy(), b16.float().numpy(), mode,
                          bits, group_size, f32=True)  # fmt: skip
        np.testing.assert_array_equal(tk.dequantize_torch(q16).numpy(), ref.astype(np.float32))
        assert q16.nbytes == 20 * 256 * bits // 8 + 2 * 20 * 256 // group_size * 2


# ----------------------------------------------------------------------------- kernels (CPU)


def _mlx_case(n, k, mode, bits, group_size, seed):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) * 0.05
    out = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    ref = np.array(mx.dequantize(*out, group_size=group_size, bits=bits, mode=mode,
                                 dtype=mx.float32))  # fmt: skip
    b = np.array(out[2]) if mode == "affine" else None
    q = tk.prepare(np.array(out[0]), np.array(out[1]), b, mode, bits, group_size)
    on = dict(weight=q.weight.to(DEV), scales=q.scales.to(DEV))
    if q.biases is not None:
        on["biases"] = q.biases.to(DEV)
    return dataclasses.replace(q, **on), torch.from_numpy(ref).double()


@need_mlx
@pytest.mark.parametrize("mode,bits,group_size", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("m", [1, 3, 33])
def test_qmatmul_matches_mlx(mode, bits, group_size, m):
    """M=1, 3 run the GEMV kernel, M=33 the tensor-core GEMM (two row tiles on the CPU)."""
    n = 36 if m == 3 else 64  # 36: a partial tile of 8 rows
    q, ref = _mlx_case(n, 256, mode, bits, group_size, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=gen)
    y = tk.qmatmul(x.to(DEV), q).cpu()
    assert rel_err(y, x.double() @ ref.T) < 1e-5  # fp32: far below 1e-3
    xb = x.to(torch.bfloat16)
    y = tk.qmatmul(xb.to(DEV), q).cpu()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, xb.double() @ ref.T) < 1e-2


@need_mlx
@pytest.mark.parametrize(
    "cfg",
    [
        tk.KernelConfig("gemv", 1, 8, 2, prefetch=False),
        tk.KernelConfig("gemv", 1, 16, 1, prefetch=True),
        tk.KernelConfig("gemv", 1, 8, 1, num_warps=2),
        tk.KernelConfig("gemv", 1, 16, 1, num_warps=4),
        tk.KernelConfig("gemm", 16, 16, 3, ng=4, num_warps=4),
        tk.KernelConfig("gemm", 16, 32, 2, ng=2, num_warps=4, swap=True),
    ],
    ids=[
        "gemv-split2",
        "gemv-prefetch",
        "gemv-2warps",
        "gemv-4warps-past-k",
        "gemm-split3",
        "gemm-swap-split2",
    ],
)
@pytest.mark.parametrize("mode,bits,group_size", [FORMATS[1], FORMATS[6]], ids=["affine", "mxfp4"])
def test_split_k_and_prefetch(cfg, mode, bits, group_size):
    """Split-K sums partials through the ticket epilogue; a second call reuses the tickets.
    GEMV warps split each k-step inside the program (4 warps: one masked step of 2 rows' K)."""
    q, ref = _mlx_case(16, 2048, mode, bits, group_size, seed=7)  # 2 GEMV k-steps of 1024
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(3))
    want = x.double() @ ref.T
    for _ in range(2):
        assert rel_err(tk.qmatmul(x.to(DEV), q, cfg).cpu(), want) < 1e-5
    x16 = x.to(torch.float16)
    assert rel_err(tk.qmatmul(x16.to(DEV), q, cfg).cpu(), x16.double() @ ref.T) < 1e-2


PACKED_FORMATS = [FORMATS[i] for i in (0, 1, 2, 6, 7, 8)]  # affine 4-bit, fp4, fp8


@pytest.mark.parametrize(
    "mode,bits,group_size", PACKED_FORMATS, ids=[f"{m}{b}g{g}" for m, b, g in PACKED_FORMATS]
)
@pytest.mark.parametrize("m", [32, 33])
def test_gemm_small_m_swap_packed(mode, bits, group_size, m):
    """Batched decode (M = 32): the config choose_config gives a GPU for 4 < M <= 64 (BM=32,
    BN=128, swap, split-K) with bf16 x (and bf16 affine scales), i.e. the packed bf16x2
    decode, against the float64 decoder; N=136 leaves a partial tile, M=33 a
    row tile of one row."""
    gen = torch.Generator().manual_seed(group_size + m)
    n, k = 136, 512
    w, s, b = random_packed(n, k, mode, bits, group_size, gen)
    sn = s.float().numpy() if mode == "affine" else s.numpy()
    bn = None if b is None else b.float().numpy()
    ref = ref_dequant(w.numpy(), sn, bn, mode, bits, group_size)
    q = tk.prepare(w.to(DEV), s.to(DEV), None if b is None else b.to(DEV), mode, bits, group_size)
    assert tk._packed_gemm(q, torch.bfloat16)
    ng = 128 // group_size
    cfg = tk.KernelConfig("gemm", 32, 128, 2, ng, num_warps=4, num_stages=4, swap=True)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = x.double() @ torch.from_numpy(ref).T
    for _ in range(2):  # the split-K tickets reset
        y = tk.qmatmul(x.to(DEV), q, cfg)
        assert y.dtype == torch.bfloat16 and rel_err(y.cpu(), want) < 1e-2
    # fp32 x takes the per-element path with the same config: the two agree
    y32 = tk.qmatmul(x.float().to(DEV), q, cfg)
    assert rel_err(y.cpu(), y32.double().cpu()) < 1e-2
    # the packed decode as the second (shared-memory) operand: no swap
    cfg = tk.KernelConfig("gemm", 32, 64, 1, ng, num_warps=4, num_stages=3)
    assert rel_err(tk.qmatmul(x.to(DEV), q, cfg).cpu(), want) < 1e-2


@pytest.mark.parametrize(
    "spec,m",
    [("", 8), ("", 64), ("256,8,3,2,1", 64), ("64,4,3,4,2", 17)],
    ids=["default-m8", "default-m64", "256rows-m64", "64rows-k256-m17"],
)
def test_small_m_gemm_launches_as_an_h100_runs_them(monkeypatch, spec, m):
    """The batched-decode launches (triton_launch.SMALL_M_GEMM, MLXRUN_SMALL_M_GEMM) as
    choose_config gives them a 132-SM GPU, against the float64 decoder: int4 g64, N = 264
    (a partial row tile for 64, 128 and 256 rows), K = 576 (a part k-step), split-K, row
    tiles of 32 or 64 with M = 8, 17 (masked rows), 32 and 64; on a GPU (PDL) the L2
    prefetch before the wait too."""
    import mlxrun.quant.triton_launch as launch

    if spec:
        monkeypatch.setattr(launch, "SMALL_M_GEMM", launch._small_m_gemm(spec))
        monkeypatch.setattr(launch, "SMALL_M_GEMM_64", launch._small_m_gemm(spec))
    monkeypatch.setattr(launch, "_num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(m)
    n, k = 264, 576  # 4.5 k-steps of 128 inputs: the last one masked
    w, s, b = random_packed(n, k, "affine", 4, 64, gen)
    ref = ref_dequant(w.numpy(), s.float().numpy(), b.float().numpy(), "affine", 4, 64)
    q = tk.prepare(w.to(DEV), s.to(DEV), b.to(DEV), "affine", 4, 64)
    cfg = tk.choose_config(m, q, types.SimpleNamespace(type="cuda"), torch.bfloat16)
    bn = int((spec or "128").split(",")[0])
    assert (cfg.kernel, cfg.block_n, cfg.swap) == ("gemm", bn, True) and cfg.split_k > 1
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    y = tk.qmatmul(x.to(DEV), q, cfg)
    assert y.shape == (m, n) and rel_err(y.cpu(), x.double() @ torch.from_numpy(ref).T) < 1e-2


@LONG_ON_CPU
@pytest.mark.parametrize(
    "mode,bits,group_size", [FORMATS[1], FORMATS[6], FORMATS[8]], ids=["int4", "mxfp4", "mxfp8"]
)
def test_silu_in_the_gate_up_epilogue(mode, bits, group_size):
    """The joint [gate; up] GEMV, in 16-row tiles (8 gate rows and their 8 up rows) and in
    8-row tiles (4 and 4), gives silu(gate) * up bit for bit as the GEMV then
    cuda_ops.silu_mul do, with and without split-K (across programs and across the warps of
    one), at 1 and 3 rows; the GEMM refuses."""
    from mlxrun.backends import cuda_ops

    gen = torch.Generator().manual_seed(9)
    n, k = 48, 2048  # 24 gate rows (3 tiles)
    packed = random_packed(n, k, mode, bits, group_size, gen)
    w = tk.prepare(*(None if t is None else t.to(DEV) for t in packed), mode, bits, group_size)
    cfgs = [
        tk.KernelConfig("gemv", 1, bn, s, num_warps=nw)
        for bn, s, nw in ((16, 1, 1), (16, 2, 1), (16, 1, 2), (16, 1, 4), (8, 1, 2), (8, 2, 1))
    ]
    for cfg in cfgs:
        for m in (1, 3):
            x = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
            y = tk.qmatmul(x, w, cfg)
            want = cuda_ops.silu_mul(y[:, : n // 2], y[:, n // 2 :])
            for _ in range(2):  # the split-K tickets reset
                assert torch.equal(tk.qmatmul(x, w, cfg, silu=True), want)
    gemm = tk.KernelConfig("gemm", 16, 16, 1, ng=1, num_warps=4)
    assert not tk.silu_fusable(x, w, gemm)
    with pytest.raises(ValueError, match="silu"):
        tk.qmatmul(x, w, gemm, silu=True)


EIGHT_BIT = [FORMATS[i] for i in (3, 4, 5, 8)]  # affine 8-bit g32/64/128, mxfp8


@LONG_ON_CPU
@pytest.mark.parametrize(
    "mode,bits,group_size", EIGHT_BIT, ids=[f"{m}{b}g{g}" for m, b, g in EIGHT_BIT]
)
def test_streaming_gemv_equals_the_one_shot_gemv(mode, bits, group_size):
    """The persistent 8-bit GEMV (programs streaming row tiles, the next tile's words loaded
    during the last k-step) gives the one-shot GEMV's result bit for bit (the same per-lane
    sums in the same order), on bf16 and fp32 x, 1 and 3 rows, 8 and 16 rows a tile, 1, 2
    and 4 warps, fewer programs than tiles (so each streams several, and the last ones
    clamp their look-ahead), with the SiLU epilogue, and within tolerance of the float64
    decoder; mxfp8 also decoded a word at a time (cvt: PTX on a GPU); shapes it does not
    take run the one-shot kernel."""
    from mlxrun.backends import cuda_ops

    gen = torch.Generator().manual_seed(group_size + bits)
    n, k = 80, 1024  # 10 tiles of 8 rows (5 of 16), 1 to 2 k-steps
    w, s, b = random_packed(n, k, mode, bits, group_size, gen)
    sn = s.float().numpy() if mode == "affine" else s.numpy()
    ref = ref_dequant(w.numpy(), sn, None if b is None else b.float().numpy(), mode, bits,
                      group_size)  # fmt: skip
    q = tk.prepare(w.to(DEV), s.to(DEV), None if b is None else b.to(DEV), mode, bits, group_size)
    ref = torch.from_numpy(ref)
    cases = [(8, 1, 1, False), (16, 2, 1, False), (8, 4, 2, False), (16, 1, 3, False)]
    if mode == "mxfp8":  # E4M3 decoded a word at a time: the same products, in another order
        cases += [(8, 1, 1, True), (16, 4, 2, True)]
    for bn, nw, per_sm, cvt in cases:
        st = tk.KernelConfig("stream", 1, bn, 1, num_warps=nw, per_sm=per_sm, cvt=cvt)
        one = tk.KernelConfig("gemv", 1, bn, 1, num_warps=nw)
        for m, dt in ((1, torch.bfloat16), (3, torch.float32)):
            x = torch.randn(m, k, generator=gen).to(dt).to(DEV)
            y = tk.qmatmul(x, q, st)
            if cvt:  # bf16 outputs may round the other way; fp32 ones differ in the last bits
                tol = 1e-2 if dt == torch.bfloat16 else 1e-6
                assert rel_err(y.cpu(), tk.qmatmul(x, q, one).double().cpu()) < tol
            else:
                assert torch.equal(y, tk.qmatmul(x, q, one)), (bn, nw, m)
            assert rel_err(y.cpu(), x.double().cpu() @ ref.T) < (1e-2 if m == 1 else 1e-5)
            if m == 1:
                want = cuda_ops.silu_mul(y[:, : n // 2], y[:, n // 2 :])
                assert torch.equal(tk.qmatmul(x, q, st, silu=True), want), (bn, nw)
    # 40 rows: no whole 16-row tiles; the one-shot kernel runs instead
    q40 = tk.prepare(w[:40].to(DEV), s[:40].to(DEV), None if b is None else b[:40].to(DEV),
                     mode, bits, group_size)  # fmt: skip
    x = torch.randn(1, k, generator=gen).to(DEV)
    st = tk.KernelConfig("stream", 1, 16, 1, num_warps=1, per_sm=1)
    assert rel_err(tk.qmatmul(x, q40, st).cpu(), x.double().cpu() @ ref[:40].T) < 1e-5


@pytest.mark.parametrize("mode,bits,group_size", [FORMATS[4], FORMATS[8]], ids=["int8", "mxfp8"])
def test_streaming_gemv_small(mode, bits, group_size):
    """The streaming GEMV's default-run check (the long test sweeps its launches): 10 row
    tiles over 4 programs (2 or 3 each; int8: 5 balanced programs), one k-step, bf16 x, against the one-shot GEMV
    (mxfp8: decoded a word at a time) and with the SiLU epilogue."""
    gen = torch.Generator().manual_seed(5)
    n, k = 80, 512
    packed = random_packed(n, k, mode, bits, group_size, gen)
    q = tk.prepare(*(None if t is None else t.to(DEV) for t in packed), mode, bits, group_size)
    st = tk.KernelConfig("stream", 1, 8, 1, per_sm=1, cvt=mode == "mxfp8")
    if mode == "affine":  # 8 programs balanced to 5, two tiles each
        st = tk.KernelConfig("stream", 1, 8, 1, per_sm=2, balance=True)
    x = torch.randn(1, k, generator=gen).bfloat16().to(DEV)
    y = tk.qmatmul(x, q, st)
    want = tk.qmatmul(x, q, tk.KernelConfig("gemv", 1, 8, 1))
    assert rel_err(y.cpu(), want.double().cpu()) < 1e-2
    assert (y.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
    silu = tk.qmatmul(x, q, st, silu=True)
    g, u = (t.float() for t in want.split(n // 2, -1))
    assert rel_err(silu.cpu(), (torch.nn.functional.silu(g) * u).double().cpu()) < 1e-2


def test_streaming_gemv_is_chosen_where_it_was_faster(monkeypatch):
    """choose_config on an H100-sized GPU: the streaming GEMV for the 8-bit formats where
    its programs take several tiles (gate/up, head) or a tile has long rows (down); the
    one-shot GEMV on q/k/v and o, for 4-bit, and everywhere with MLXRUN_GEMV8=old."""
    import types

    from mlxrun.quant import triton_launch

    monkeypatch.setattr(triton_launch, "_num_sms", lambda device: 132)
    gpu = types.SimpleNamespace(type="cuda")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    for mode, bits, g in (("mxfp8", 8, 32), ("affine", 8, 64), ("affine", 4, 64)):
        got = []
        for n, k in shapes:
            w = types.SimpleNamespace(n=n, k=k, bits=bits, group_size=g, mode=mode)
            cfg = tk.choose_config(1, w, gpu)
            got.append((cfg.kernel, cfg.block_n) if cfg.kernel == "stream" else cfg.kernel)
        if bits == 4:
            assert got == ["gemv"] * 5
        else:
            assert got == ["gemv", "gemv", ("stream", 16), ("stream", 8), ("stream", 16)]
    monkeypatch.setattr(triton_launch, "GEMV8", "old")
    w = types.SimpleNamespace(n=28672, k=4096, bits=8, group_size=32, mode="mxfp8")
    assert tk.choose_config(1, w, gpu).kernel == "gemv"


@pytest.mark.parametrize("mode,bits,group_size", [FORMATS[1], FORMATS[6]], ids=["int4", "mxfp4"])
def test_gemv_orders_equal_the_default(mode, bits, group_size):
    """seq (a 16-row tile's first 8 rows through every position, then the second 8) and
    early (one k-step's scales loaded with its words) run the same FFMA chains as the
    default order: bit-identical outputs, plain (on the prefetch loop and without it) and
    with the SiLU epilogue (int4: 16-row tiles; mxfp4: 8); and near the float64 product of
    the dequantized weight."""
    gen = torch.Generator().manual_seed(11)
    # int4: one tile of 16 rows, one one-warp k-step of 128 words a row; mxfp4: 2 tiles of
    # 8 rows, two k-steps (early's loop)
    n, k = 16, 1024 if mode == "affine" else 2048
    packed = random_packed(n, k, mode, bits, group_size, gen)
    w = tk.prepare(*(None if t is None else t.to(DEV) for t in packed), mode, bits, group_size)
    ref = tk.dequantize_torch(w).double().cpu()
    x = torch.randn(1, k, generator=gen).bfloat16().to(DEV)
    bn = 16 if mode == "affine" else 8
    cases = [(True, False, ("seq", "early")), (False, True, ("early",))]
    if mode != "affine":  # seq is the default order at 8 rows
        cases = [(True, True, ("early",))]
    for pf, silu, names in cases:
        old = tk.KernelConfig("gemv", 1, bn, 1, prefetch=pf)
        want = tk.qmatmul(x, w, old, silu=silu)
        if not silu:
            assert rel_err(want.cpu(), x.cpu().double() @ ref.T) < 1e-2
        for name in names:
            new = dataclasses.replace(old, **{name: True})
            assert torch.equal(tk.qmatmul(x, w, new, silu=silu), want), new


def test_leading_dims_and_errors():
    gen = torch.Generator().manual_seed(0)
    w, s, b = random_packed(16, 128, "affine", 4, 64, gen)
    ref = torch.from_numpy(ref_dequant(w.numpy(), s.float().numpy(), b.float().numpy(),
                                       "affine", 4, 64)).to(DEV)  # fmt: skip
    w, s, b = w.to(DEV), s.to(DEV), b.to(DEV)
    q = tk.prepare(w, s, b, "affine", 4, 64)
    x = torch.randn(2, 1, 128, generator=gen).to(DEV)
    y = tk.qmatmul(x, q)
    assert y.shape == (2, 1, 16)
    assert rel_err(y.reshape(2, 16), x.reshape(2, 128).double() @ ref.T) < 1e-5
    with pytest.raises(MlxrunError, match="features"):
        tk.qmatmul(torch.randn(1, 64, device=DEV), q)
    with pytest.raises(MlxrunError, match="bits"):
        tk.prepare(w, s, b, "affine", 3, 64)
    with pytest.raises(MlxrunError, match="scales shape"):
        tk.prepare(w, s[:, :1], b, "affine", 4, 64)
    with pytest.raises(MlxrunError, match="biases"):
        tk.prepare(w, s, None, "affine", 4, 64)
    with pytest.raises(MlxrunError, match="unknown"):
        tk.prepare(w, s, b, "int4", 4, 64)


def test_rows_past_32_bit_offsets_run_in_blocks(monkeypatch):
    """x with more rows than 32-bit offsets allow (lowered here to 128 x 16 elements) runs in
    row blocks and gives the one-launch result."""
    gen = torch.Generator().manual_seed(1)
    w, s, b = random_packed(16, 128, "affine", 4, 64, gen)
    q = tk.prepare(w.to(DEV), s.to(DEV), b.to(DEV), "affine", 4, 64)
    x = torch.randn(3, 20, 128, generator=gen).to(DEV)  # 60 rows: GEMM path
    want = tk.qmatmul(x, q)
    monkeypatch.setattr(tk, "MAX_INDEX", 128 * 16)  # 16 rows a block: 4 blocks, 12 in the last
    blocks = []
    choose = tk.choose_config
    monkeypatch.setattr(tk, "choose_config", lambda m, *a: blocks.append(m) or choose(m, *a))
    assert rel_err(tk.qmatmul(x, q), want.double()) < 1e-6  # block configs round differently
    assert blocks == [16, 16, 16, 12]


# ----------------------------------------------------------------------------- kernels (GPU)

# (M, shapes): GEMV at every shape; skinny tensor-core tiles (M=16); full tiles (M=300)
CUDA_CASES = [
    (1, [(4096, 4096), (1024, 4096), (4096, 14336)]),
    (3, [(1024, 4096)]),
    (16, [(4096, 4096)]),
    (300, [(1024, 4096), (4096, 14336)]),
]


@cuda
@need_cuda
@pytest.mark.parametrize("mode,bits,group_size", FORMATS, ids=FMT_IDS)
def test_cuda_llama8b_shapes(mode, bits, group_size):
    """Llama-3-8B shapes on the GPU against the float64 decoder, bf16 activations; fp32 and
    fp16 too for the two main formats."""
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16]
    if (mode, group_size) in (("affine", 64), ("mxfp4", 32)):
        dtypes += [torch.float32, torch.float16]
    weights = {}
    for m, shapes in CUDA_CASES:
        for n, k in shapes:
            if (n, k) not in weights:
                w, s, b = random_packed(n, k, mode, bits, group_size, gen)
                sn = s.float().numpy() if mode == "affine" else s.numpy()
                bn = None if b is None else b.float().numpy()
                ref = ref_dequant(w.numpy(), sn, bn, mode, bits, group_size)
                ref = torch.from_numpy(ref).cuda()
                b = None if b is None else b.cuda()
                q = tk.prepare(w.cuda(), s.cuda(), b, mode, bits, group_size)
                assert torch.equal(tk.dequantize_torch(q).double(), ref)
                weights[(n, k)] = (q, ref)
            q, ref = weights[(n, k)]
            x = torch.randn(m, k, generator=gen).cuda()
            for dtype in dtypes if m in (1, 300) else dtypes[:1]:
                xd = x.to(dtype)
                y = tk.qmatmul(xd, q)
                tol = 1e-3 if dtype == torch.float32 else 1e-2
                assert rel_err(y, xd.double() @ ref.T) < tol, (n, k, m, dtype)
                assert torch.equal(tk.qmatmul(xd, q), y)  # split-K tickets reset; deterministic


@pytest.mark.parametrize(
    "quant",
    ["none", pytest.param("int4", marks=LONG_ON_CPU), pytest.param("fp4", marks=LONG_ON_CPU)],
)
def test_cuda_code_path_end_to_end(tiny_dir, quant):
    """The PyTorch backend with its Triton kernels on (the CUDA code path: load-time repack,
    GEMM prefill, GEMV decode, embedding rows gathered from the tied quantized matrix) gives
    the logits and greedy tokens of the plain dequantizing path: on the GPU where there is
    one, else on the CPU under the interpreter."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.generate import generate_step
    from mlxrun.loader import open_checkpoint
    from mlxrun.quant.formats import resolve
    from mlxrun.sampling import SamplingParams

    from .conftest import rel_err

    d, _ = tiny_dir("llama_gqa_tied")
    ckpt = open_checkpoint(str(d))
    spec = None if quant == "none" else resolve(quant, group_size=32 if quant == "int4" else None)
    models = []
    for kernels in (False, True):
        be = TorchBackend(DEV, "float32")
        be.triton_kernels = kernels
        be.cuda_graphs = False
        models.append(build_model(ckpt.config, ckpt.tensors, be, spec, progress=False)[0])
    L = models[1].layers[0]
    if spec is not None:
        assert L.q_proj.kernel is not None  # the kernels really ran
    ids = np.random.default_rng(0).integers(3, 96, size=(1, 12))
    logits = [
        m.be.to_numpy(m(m.be.ids(ids), m.make_cache(1, 12))) for m in models
    ]  # (1, 12, vocab): prefill through the GEMM
    # The GPU's float32 dot runs in TF32 (~3e-4); the interpreter computes it in float32.
    assert rel_err(logits[1], logits[0]) < (2e-3 if HAS_CUDA else 1e-4)
    greedy = [
        [int(t[0]) for t in generate_step(m, [ids[0].tolist()], SamplingParams(), 6)]
        for m in models
    ]  # decode through the GEMV
    assert greedy[1] == greedy[0]
    # q, k, v (and gate, up) ran as one joint weight; the parts are views of it
    parts = [w.kernel.weight if spec else w for w in (L.q_proj, L.k_proj, L.v_proj)]
    assert len({t.untyped_storage().data_ptr() for t in parts}) == 1


@pytest.mark.parametrize("mode,bits,group_size", FORMATS, ids=FMT_IDS)
def test_packed_embedding_rows_equal_the_torch_dequantize(mode, bits, group_size):
    """The embedding kernel (a packed table's rows by id, one launch) gives the torch
    dequantize's rows bit for bit in fp32 (and to bf16 rounding in bf16), for every format;
    a row's words end inside a block of the kernel's 256 (a masked tail); ids repeat."""
    from mlxrun.backends import cuda_ops
    from mlxrun.backends.base import QuantizedWeight
    from mlxrun.backends.torch_backend import TorchBackend

    gen = torch.Generator().manual_seed(bits * group_size)
    k = 1280 + 2 * group_size * 32 // bits  # 192-576 words a row, never whole blocks of 256
    k -= k % group_size
    w, s, b = (None if t is None else t.to(DEV) for t in random_packed(37, k, mode, bits,
                                                                        group_size, gen))  # fmt: skip
    table = QuantizedWeight(w, s, b, mode, bits, group_size)
    ids = torch.tensor([[0, 36, 5], [5, 17, 2]], device=DEV)
    for dtype in (torch.float32, torch.bfloat16):
        stock = TorchBackend(DEV, "float32" if dtype == torch.float32 else "bfloat16")
        stock.triton_kernels = False
        want = stock.embedding(ids, table)
        got = cuda_ops.embed_rows(ids, table, dtype)
        assert got.shape == (2, 3, k) and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:  # the interpreter truncates float32 -> bf16 where the GPU rounds to nearest
            assert rel_err(got.float().cpu(), want.float().cpu()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gemv_equals_the_float64_product(dtype):
    """The batch-1 bf16/fp16 GEMV (cuda_ops.dense_gemv) against the float64 product: one and
    three rows of x, whole 4-row blocks and whole k-blocks (no masks), a partial row block
    and a K that ends inside a k-block; with silu (19 gate rows: a program's last pair half
    outside) it gives silu_mul of its own product bit for bit."""
    from mlxrun.backends import cuda_ops

    gen = torch.Generator().manual_seed(5)
    for n, k, kw in ((64, 2048, {}), (38, 300, {}), (48, 1024, dict(warps=2, vec=8))):
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
        for m in (1, 3):
            x = torch.randn(m, k, generator=gen).to(dtype)
            y = cuda_ops.dense_gemv(x.to(DEV), w.to(DEV), **kw)
            assert y.dtype == dtype and y.shape == (m, n)
            assert rel_err(y.cpu(), x.double() @ w.double().T) < 1e-2
            if n % 2 == 0:
                want = cuda_ops.silu_mul(y[:, : n // 2], y[:, n // 2 :])
                got = cuda_ops.dense_gemv(x.to(DEV), w.to(DEV), silu=True, **kw)
                assert torch.equal(got, want)


def test_graph_advance_kernel_equals_the_torch_ops():
    """A graph-mode cache moved on by the one-launch kernel holds what the torch ops give:
    position, rope positions (left padding subtracted) and the mask's new slot; rewind
    restores the state at the host offset."""
    from mlxrun.backends.torch_backend import StaticCache

    caches = [StaticCache(1, 3, 1, 4, 9, torch.float32, DEV, fused=f) for f in (False, True)]
    for c in caches:
        c.offset = 4
        c.enter_graph(np.array([0, 2, 4]))
        for _ in range(3):
            c.advance(1)
    plain, fused = caches
    assert plain.pos.item() == fused.pos.item() == 7
    assert torch.equal(fused.positions(1, None), plain.positions(1, None))
    assert fused.positions(1, None).view(-1).tolist() == [7, 5, 3]
    assert torch.equal(fused.mask(1, None), plain.mask(1, None))
    assert fused.mask(1, None)[:, 0, 0].int().tolist() == [
        [1, 1, 1, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1, 1, 0],
    ]
    fused.rewind()
    assert fused.pos.item() == 4 and fused.mask(1, None)[0, 0, 0].int().sum().item() == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_small_ops_equal_the_stock_ops(dtype):
    """RMSNorm (+ residual add), rotary embedding with the KV-cache store, SiLU-multiply and
    the greedy argmax as one kernel each give what the PyTorch backend's stock ops give,
    rounding steps included."""
    from mlxrun.backends import cuda_attention, cuda_ops
    from mlxrun.backends.torch_backend import TorchBackend

    stock = TorchBackend(DEV, "bfloat16" if dtype == torch.bfloat16 else "float32")
    stock.triton_kernels = False
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    # bf16: the interpreter truncates float32 -> bf16 where the GPU rounds to nearest
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    h, y, w = rnd(2, 5, 96), rnd(2, 5, 96), rnd(96)
    hs, xs = stock.add_rms_norm(h, y, w, 1e-5)
    hf, xf = cuda_ops.add_rms_norm(h, y, w, 1e-5)
    if HAS_CUDA or dtype == torch.float32:
        assert torch.equal(hf, hs)  # one rounded add either way
    assert rel_err(hf.float().cpu(), hs.float().cpu()) < tol
    assert rel_err(xf.float().cpu(), xs.float().cpu()) < tol
    _, x0 = cuda_ops.add_rms_norm(h, None, w, 1e-5)
    assert rel_err(x0.float().cpu(), stock.rms_norm(h, w, 1e-5).float().cpu()) < tol

    # q, k, v as the model passes them: (B, H, T, D) views of the joint q/k/v product;
    # left-padded positions; written into a cache at offset 3 (eager) and at a slot (graph)
    qkv = rnd(2, 7, (4 + 2 + 2) * 32)
    q = qkv[..., :128].reshape(2, 7, 4, 32).swapaxes(1, 2)
    k = qkv[..., 128:192].reshape(2, 7, 2, 32).swapaxes(1, 2)
    v = qkv[..., 192:].reshape(2, 7, 2, 32).swapaxes(1, 2)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [-2, -1, 0, 1, 2, 3, 4]], device=DEV)
    inv = torch.from_numpy(1.0 / 10000 ** (np.arange(0, 32, 2) / 32)).float().to(DEV)
    kc, vc = rnd(2, 2, 12, 32), rnd(2, 2, 12, 32)  # stale values around the written slots
    kw, vw = kc.clone(), vc.clone()
    kw[:, :, 3:10], vw[:, :, 3:10] = stock.rope(k, pos, inv), v
    slot = torch.tensor([3], device=DEV)
    got = cuda_attention.rope_qkv(q, k, v, pos, inv, kc, vc, slot)
    assert got.is_contiguous() and got.shape == q.shape
    assert rel_err(got.float().cpu(), stock.rope(q, pos, inv).float().cpu()) < tol
    assert rel_err(kc.float().cpu(), kw.float().cpu()) < tol
    assert torch.equal(vc, vw)  # v copied bit for bit, nothing else touched
    assert torch.equal(kc[:, :, :3], kw[:, :, :3]) and torch.equal(kc[:, :, 10:], kw[:, :, 10:])
    one = cuda_attention.rope_qkv(q[:1], k[:1], v[:1], pos[1:], inv, kc[:1], vc[:1], slot)
    assert rel_err(one.float().cpu(), stock.rope(q[:1], pos[1:], inv).float().cpu()) < tol
    # a sliding-window layer's ring: the writes wrap past the end of the buffer to its start
    kc2, vc2 = rnd(2, 2, 12, 32), rnd(2, 2, 12, 32)
    kw2, vw2 = kc2.clone(), vc2.clone()
    ring = [9, 10, 11, 0, 1, 2, 3]
    kw2[:, :, ring], vw2[:, :, ring] = stock.rope(k, pos, inv), v
    cuda_attention.rope_qkv(q, k, v, pos, inv, kc2, vc2, torch.tensor([9], device=DEV))
    assert rel_err(kc2.float().cpu(), kw2.float().cpu()) < tol and torch.equal(vc2, vw2)

    # greedy argmax over a vocabulary of 3 blocks and a bit, split across programs: a tie
    # across blocks gives the first index, as torch.argmax
    logits = rnd(3, 9000)
    logits[1, 8500] = logits[1, 123] = logits[1].max() + 1
    logits[2, :] = -1.0
    assert torch.equal(cuda_ops.argmax(logits).cpu(), logits.float().cpu().argmax(-1))
    out = torch.full((3,), 7, dtype=torch.int64, device=DEV)
    assert cuda_ops.argmax(logits, out=out) is out and out.tolist()[1:] == [123, 0]
    logits[0, :] = float("nan")  # still an id in range: the next step embeds it
    assert 0 <= cuda_ops.argmax(logits)[0].item() < 9000

    gu = rnd(2, 3, 3000)  # a joint gate/up product; 1500 is not a multiple of the block
    gate, up = gu[..., :1500], gu[..., 1500:]
    assert (
        rel_err(
            cuda_ops.silu_mul(gate, up).float().cpu(),
            stock.silu_mul(gate, up).float().cpu(),
        )
        < tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa(dtype):
    """One new token per sequence against a GQA cache, split across programs over the keys:
    what SDPA gives, with no mask, with a per-sequence mask (left padding, an unfilled tail
    that whole blocks of keys skip), and with one mask for the batch; in one split, the
    output written by the attention kernel itself."""
    import torch.nn.functional as F

    from mlxrun.backends import cuda_attention

    g = torch.Generator().manual_seed(0)
    B, NH, NKV, S, D = 3, 8, 2, 200, 32  # 200 keys: 4 blocks of 64, the last partial

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    q, k, v = rnd(B, NH, 1, D), rnd(B, NKV, S, D), rnd(B, NKV, S, D)
    slots = torch.arange(S, device=DEV)
    pads = torch.tensor([0, 5, 70], device=DEV)
    filled = 90  # keys past it are stale: in graph decode the mask hides them
    per_seq = ((slots[None] >= pads[:, None]) & (slots[None] < filled))[:, None, None]
    one = (slots < 150)[None, None, None]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for mask in (None, per_seq, one):
        want = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, scale=0.2, enable_gqa=True
        )
        got = cuda_attention.decode_attention(q, k, v, 0.2, mask)
        assert got.shape == q.shape and got.dtype == dtype
        assert rel_err(got.float().cpu(), want.cpu()) < tol
        # one block of 256 keys, so one split: the attention kernel writes the output (no
        # combine), equal to what the combine makes of the one split
        one_split = cuda_attention.AttnLaunch(block=256)
        got = cuda_attention.decode_attention(q, k, v, 0.2, mask, launch=one_split)
        assert rel_err(got.float().cpu(), want.cpu()) < tol
        combined = dataclasses.replace(one_split, direct=False)
        assert torch.equal(
            got, cuda_attention.decode_attention(q, k, v, 0.2, mask, launch=combined)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_rows_are_written_and_read_in_place(dtype):
    """The serving engine's decode step over a slot cache: rope_qkv with `rows` stores each
    sequence's k, v in its own slot at its own position, touching nothing else, and
    decode_attention with `rows` reads each sequence's slot in place, as SDPA over the
    gathered rows does (a dummy row in slot 0 that sees only the last position included)."""
    import torch.nn.functional as F

    from mlxrun.backends import cuda_attention
    from mlxrun.backends.torch_backend import TorchBackend

    stock = TorchBackend(DEV, "bfloat16" if dtype == torch.bfloat16 else "float32")
    stock.triton_kernels = False
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    SLOTS, NH, NKV, S, D = 5, 4, 2, 80, 32
    rows = torch.tensor([3, 1, 4, 0], device=DEV)  # three sequences and a dummy
    pos = torch.tensor([7, 0, 66, S - 1], device=DEV)
    q, k, v = rnd(4, NH, 1, D), rnd(4, NKV, 1, D), rnd(4, NKV, 1, D)
    kc, vc = rnd(SLOTS, NKV, S, D), rnd(SLOTS, NKV, S, D)
    kw, vw = kc.clone(), vc.clone()
    inv = torch.from_numpy(1.0 / 10000 ** (np.arange(0, D, 2) / D)).float().to(DEV)
    for b in range(4):
        kw[rows[b], :, pos[b]] = stock.rope(k[b : b + 1], pos[b].view(1, 1), inv)[0, :, 0]
        vw[rows[b], :, pos[b]] = v[b, :, 0]
    qr = cuda_attention.rope_qkv(q, k, v, pos.view(-1, 1), inv, kc, vc, pos, rows=rows)
    assert rel_err(qr.float().cpu(), stock.rope(q, pos.view(-1, 1), inv).float().cpu()) < tol
    assert rel_err(kc.float().cpu(), kw.float().cpu()) < tol
    assert torch.equal(vc, vw)  # v stored bit for bit, every other position untouched

    keys = torch.arange(S, device=DEV)[None]
    lo = torch.tensor([0, 0, 0, S - 1], device=DEV)[:, None]
    mask = ((keys >= lo) & (keys <= pos[:, None]))[:, None, None]
    got = cuda_attention.decode_attention(qr, kc, vc, 0.2, mask, rows=rows)
    want = F.scaled_dot_product_attention(
        qr.float(), kc[rows].float(), vc[rows].float(), attn_mask=mask, scale=0.2,
        enable_gqa=True,
    )  # fmt: skip
    assert got.shape == q.shape and rel_err(got.float().cpu(), want.cpu()) < tol


def test_decode_attention_with_sinks():
    """A sink logit per head (gpt-oss) joins the combine's denominator: what the plain torch
    path gives, over several splits, with and without a mask, sinks large and small."""
    from mlxrun.backends import cuda_attention
    from mlxrun.backends.torch_backend import _sink_attention

    g = torch.Generator().manual_seed(1)
    B, NH, NKV, S, D = 2, 8, 2, 200, 32
    q, k, v = (torch.randn(*s, generator=g).to(DEV) for s in
               ((B, NH, 1, D), (B, NKV, S, D), (B, NKV, S, D)))  # fmt: skip
    mask = (torch.arange(S, device=DEV) < 150)[None, None, None]
    for sinks in (torch.randn(NH, generator=g), torch.full((NH,), 30.0)):
        sinks = sinks.to(DEV)
        for m in (None, mask):
            want = _sink_attention(q, k, v, 0.2, m, sinks)
            got = cuda_attention.decode_attention(q, k, v, 0.2, m, sinks)
            assert rel_err(got.cpu(), want.cpu()) < 1e-5
    assert rel_err(cuda_attention.decode_attention(q, k, v, 0.2, None).cpu(), want.cpu()) > 1e-2


def test_cuda_code_path_honours_biases_activation_and_window(tmp_path):
    """The CUDA code path (joint q/k/v product with its biases, decode attention kernel under
    a sliding-window mask, the activation outside the SiLU epilogues): the logits and greedy
    tokens of transformers on the same weights, through a prompt and decode that cross the
    window (Qwen3 with attention biases, tanh-GELU, every layer sliding, window 6)."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.generate import generate_step
    from mlxrun.loader import open_checkpoint
    from mlxrun.sampling import SamplingParams

    from .conftest import rel_err
    from .test_conformance import _make

    opts = dict(attention_bias=True, use_sliding_window=True, sliding_window=6,
                max_window_layers=0, head_dim=16, hidden_act="gelu_pytorch_tanh")  # fmt: skip
    d, hf = _make(tmp_path, "m", "qwen3", opts)
    ckpt = open_checkpoint(str(d))
    assert ckpt.config.layer_windows == (6, 6)
    ids = np.random.default_rng(0).integers(3, 64, size=9)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
        out = hf.generate(torch.tensor(ids)[None], max_new_tokens=3, min_new_tokens=3,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    be = TorchBackend(DEV, "float32")
    be.triton_kernels, be.cuda_graphs = True, False
    m = build_model(ckpt.config, ckpt.tensors, be, None, progress=False)[0]
    got = be.to_numpy(m(be.ids(ids[None]), m.make_cache(1, 9)))[0]
    assert rel_err(got, ref) < (2e-3 if HAS_CUDA else 1e-4)
    toks = [int(t[0]) for t in generate_step(m, [ids.tolist()], SamplingParams(), 3)]
    assert toks == out[0, len(ids) :].tolist()


@LONG_ON_CPU
def test_cuda_code_path_window_rings(tmp_path):
    """The CUDA code path with sliding-window rings (rope/cache kernel writing mod the ring,
    decode attention under the ring mask): transformers' greedy tokens through chunks of 3
    and 10 decode steps (rings of 8, wrapped twice); and the graph-mode ring (device slot
    and mask moved with the position, no capture) equal to the unbounded cache over a
    left-padded batch."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.generate import generate_step
    from mlxrun.loader import open_checkpoint
    from mlxrun.sampling import SamplingParams

    from .conftest import rel_err, write_random

    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                rms_norm_eps=1e-5, head_dim=16, use_sliding_window=True, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    d, hf = write_random(tmp_path / "m", "qwen2", base, std=0.2)
    ids = np.random.default_rng(0).integers(3, 64, size=10)
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids)[None], max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    ckpt = open_checkpoint(str(d))
    be = TorchBackend(DEV, "float32")
    be.triton_kernels, be.cuda_graphs = True, False
    t = build_model(ckpt.config, ckpt.tensors, be, None, progress=False)[0]
    assert t.make_cache(1, 20, 3).caps == [8, 20]
    toks = generate_step(t, [ids.tolist()], SamplingParams(), 10, prefill_chunk=3)
    assert [int(x[0]) for x in toks] == out[0, len(ids) :].tolist()

    prompts, pads = np.array([[0, 0, 5, 6], [8, 9, 10, 11]]), np.array([2, 0])
    full, graph = t.make_cache(2, 24), t.make_cache(2, 24, chunk=2)
    for c in (full, graph):
        t(be.ids(prompts[:, :2]), c, pads)
        t(be.ids(prompts[:, 2:]), c, pads)
    graph.enter_graph(pads)
    for i in range(12):  # positions 4..15: the ring of 7 wraps
        tok = be.ids(np.array([[13 + i], [30 + i]]))
        a = be.to_numpy(t(tok, full, pads, last_only=True))
        b = be.to_numpy(t(tok, graph, pads, last_only=True))
        graph.offset += 1
        assert rel_err(b, a) < (2e-3 if HAS_CUDA else 1e-5), i
