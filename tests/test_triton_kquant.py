"""K-quant Triton kernels (quant/triton_kquant.py) against gguf's own dequantize.

The layout's torch decode equals `gguf.quants.dequantize` bit for bit (edge scales
included); the GEMV and GEMM (under TRITON_INTERPRET=1 here, at small sizes; on the GPU
where there is one) equal the float64 product with the dequantized weights within the
output dtype's rounding.
"""

import importlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
pytest.importorskip("triton", reason="triton is not installed")

import mlxrun.quant.triton_kernels as tk  # noqa: E402
import mlxrun.quant.triton_kquant as kq  # noqa: E402
from mlxrun.quant import gguf_blocks as gb  # noqa: E402
from tests.test_gguf_blocks import random_rows  # noqa: E402

if not HAS_CUDA and type(kq._kq_gemv_kernel).__name__ != "InterpretedFunction":
    tk = importlib.reload(tk)  # imported earlier without the interpreter: decorate again
    kq = importlib.reload(kq)

DEV = "cuda" if HAS_CUDA else "cpu"
KINDS = list(kq.KINDS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_layout_decodes_as_gguf(kind, edges):
    """prepare_kquant's planes hold every field: decoded, bit for bit gguf's fp32 values
    (zero, extreme, subnormal and infinite d/dmin; every code and sub-scale bit)."""
    raw = random_rows(kind, rows=9, nblocks=3, seed=11 + edges, edges=edges)
    w = kq.prepare_kquant(raw, kind)
    got = kq.dequantize_kquant(w).numpy()
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # bytes per weight held: the file's, plus one byte a sub-block pair for Q4_K/Q5_K
    file_bits = gb.BLOCKS[kind][0] * 8 / gb.QK
    held = w.nbytes * 8 / want.size
    assert held == {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}[kind]
    assert held <= file_bits * 1.05


def _case(kind, n, nblocks, seed):
    raw = random_rows(kind, rows=n, nblocks=nblocks, seed=seed, edges=False)
    ref = torch.from_numpy(gb.dequantize(raw, kind)).double()
    return kq.prepare_kquant(raw, kind, DEV), ref


def _check(y, x, ref):
    """y within one rounding of its dtype of the float64 product x @ ref^T, plus what
    rounding the weight tile to x's 16-bit dtype adds (the GEMM) and fp32's sum order."""
    assert torch.isfinite(y).all()
    y, xd = y.double().cpu(), x.double().cpu()
    want = xd @ ref.T
    mag = xd.abs() @ ref.abs().T  # sum of |w x|: the bound of per-weight rounding
    u = 2.0**-8 if x.dtype != torch.float32 else 0.0
    tol = 2 * u * want.abs() + u * mag + 1e-6 * mag
    assert ((y - want).abs() <= tol).all(), ((y - want).abs() - tol).max()
    assert (y - want).abs().max() < 0.02 * want.abs().max()  # and not trivially loose


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "m,dtype",
    [(1, torch.bfloat16), (3, torch.float32), (20, torch.bfloat16)],
    ids=["gemv-bf16", "gemv3-fp32", "gemm-bf16"],
)
def test_kqmatmul_equals_dequantized_product(kind, m, dtype):
    """24 rows (a masked row block), 3 super-blocks (one k-step each, odd), and 4 (two a
    step): GEMV at 1 and 3 rows of x, GEMM at 20."""
    for nblocks in (3, 4):
        w, ref = _case(kind, 24, nblocks, seed=5 + nblocks)
        x = torch.randn(m, w.k, generator=torch.Generator().manual_seed(m)).to(dtype)
        _check(kq.kqmatmul(x.to(DEV), w), x, ref)


@pytest.mark.parametrize(
    "cfg",
    [kq.KQConfig("gemv", 1, 16, 1, 3, 4), kq.KQConfig("gemm", 16, 32, 1, 2, 4)],
    ids=["gemv-split3", "gemm-split2"],
)
def test_split_k(cfg):
    """Split-K partials summed by the last program; the second call reuses the tickets."""
    w, ref = _case("Q5_K", 16, 5, seed=3)
    x = torch.randn(2 if cfg.kernel == "gemv" else 17, w.k).to(torch.float32)
    for _ in range(2):
        _check(kq.kqmatmul(x.to(DEV), w, cfg), x, ref)


def test_concat_and_shapes():
    """gate/up of one kind join into one weight whose product is both; kinds that differ
    do not join; a wrong input width is refused."""
    a, ra = _case("Q4_K", 8, 2, seed=1)
    b, rb = _case("Q4_K", 16, 2, seed=2)
    j = kq.concat([a, b])
    assert j.n == 24 and torch.equal(kq.dequantize_kquant(a), kq.dequantize_kquant(j)[:8])
    x = torch.randn(1, 512)
    _check(kq.kqmatmul(x.to(DEV), j), x, torch.cat([ra, rb]))
    c, _ = _case("Q6_K", 8, 2, seed=3)
    assert kq.concat([c, kq.prepare_kquant(random_rows("Q4_K", 8, 2, 4, False), "Q4_K")]) is None
    from mlxrun.errors import MlxrunError

    with pytest.raises(MlxrunError, match="512"):
        kq.kqmatmul(torch.randn(1, 256).to(DEV), j)
