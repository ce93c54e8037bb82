"""K-quant Triton kernels (quant/triton_kquant.py) against gguf's own dequantize.

The layout's torch decode equals `gguf.quants.dequantize` bit for bit (edge scales
included); the GEMV and GEMM (under TRITON_INTERPRET=1 here, at small sizes; on the GPU
where there is one) equal the float64 product with the dequantized weights within the
output dtype's rounding.
"""

import numpy as np
import pytest

from mlxrun.quant import gguf_blocks as gb
from tests.test_gguf_blocks import random_rows

from ._kquant import DEV, HAS_CUDA, LONG_ON_CPU, gguf, kk, kq, tg, tgm, tk, torch  # noqa: F401

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


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_q6k_spread_layout():
    """Q6_K's high words laid out spread (hi_shifts): every 2-bit field at its own even
    offset; the low words as without; decoded, bit for bit gguf's fp32 values."""
    sh = kq.hi_shifts("Q6_K", True)
    assert sorted(sh.tolist()) == list(range(0, 32, 2))
    assert sh[1] == 4 and sh[0] == 6 and sh[9] == 0 and sh[8] == 2  # word 0 high, word 1 low
    raw = random_rows("Q6_K", rows=9, nblocks=3, seed=12, edges=True)
    a = kq.prepare_kquant(raw, "Q6_K", spread=False)
    b = kq.prepare_kquant(raw, "Q6_K", spread=True)
    assert b.hi_spread and not a.hi_spread
    kw = a.k // 8
    assert torch.equal(a.weight[:, :kw], b.weight[:, :kw])
    assert not torch.equal(a.weight[:, kw:], b.weight[:, kw:])
    got = kq.dequantize_kquant(b).numpy()
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    ids = torch.tensor([3, 0])
    assert kq.rows(b, ids).hi_spread and kq.concat([a, b]) is None
    assert kq.concat([b, b]).hi_spread
    for spread in (False, True):  # the torch form (dequantize_kquant's) gives the same offsets
        got_t = kq.hi_shifts("Q6_K", spread, torch.arange(16))
        assert got_t.tolist() == kq.hi_shifts("Q6_K", spread).tolist()


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graph capture")
def test_q6k_dequantize_in_graph_capture():
    """Q6_K rows dequantized inside CUDA graph capture (the embedding of a captured decode
    step): no host copies, the replay's values equal the eager ones, both layouts."""
    for spread in (False, True):
        raw = random_rows("Q6_K", rows=8, nblocks=2, seed=5, edges=False)
        w = kq.prepare_kquant(raw, "Q6_K", "cuda", spread=spread)
        ids = torch.tensor([5, 1], device="cuda")
        want = kq.dequantize_kquant(kq.rows(w, ids), torch.float32)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = kq.dequantize_kquant(kq.rows(w, ids), torch.float32)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "cfg",
    [None, kq.KQConfig("gemv", 1, 16, 1, 1, 4), kq.KQConfig("gemm", 16, 32, 1, 1, 4)],
    ids=["tile-gemm", "old-tile-gemv", "old-gemm"],
)
def test_q6k_spread_tile_kernels(cfg, monkeypatch):
    """The tile GEMM (and the GEMV and GEMM it replaced, kept for A/B timing) read Q6_K's
    spread high words: the dequantized product."""
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "6")
    w, ref = _case("Q6_K", 24, 2, seed=41)
    assert w.hi_spread
    m = 1 if cfg is not None and cfg.kernel == "gemv" else 20
    x = torch.randn(m, w.k, generator=torch.Generator().manual_seed(2)).to(torch.float32)
    _check(kq.kqmatmul(x.to(DEV), w, cfg), x, ref)


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
    [(1, torch.bfloat16), (2, torch.float32), (20, torch.bfloat16)],
    ids=["gemv-bf16", "gemv2-fp32", "gemm-bf16"],
)
def test_kqmatmul_equals_dequantized_product(kind, m, dtype):
    """24 rows (a masked row block); 3 super-blocks (one a GEMV k-step: an odd count) at
    1 row of x and in the GEMM (20 rows), 4 (two a k-step) at 2 rows."""
    nblocks = 4 if m == 2 else 3
    w, ref = _case(kind, 24, nblocks, seed=5 + nblocks)
    x = torch.randn(m, w.k, generator=torch.Generator().manual_seed(m)).to(dtype)
    _check(kq.kqmatmul(x.to(DEV), w), x, ref)


@pytest.mark.parametrize(
    "cfg",
    [
        kq.KQConfig("gemv", 1, 16, 1, 3, 4),
        kq.KQConfig("gemm", 16, 32, 1, 2, 4),
        tk.KernelConfig("gemm", 16, 32, 2, ng=4, num_warps=4, swap=True),
    ],
    ids=["tile-gemv-split3", "gemm-split2", "tile-gemm-swap-split2"],
)
def test_split_k(cfg):
    """Split-K partials summed by the last program; the second call reuses the tickets.
    The tile GEMV and the per-super-block GEMM (KQConfig: kept for A/B timing) and the
    tile GEMM with W as the first dot operand (swap)."""
    w, ref = _case("Q5_K", 16, 5, seed=3)
    x = torch.randn(1 if cfg.kernel == "gemv" else 17, w.k).to(torch.float32)
    for _ in range(2):
        _check(kq.kqmatmul(x.to(DEV), w, cfg), x, ref)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_lane_gemv_configs_and_silu(kind):
    """The GEMV (the int4 GEMV's lanes and FFMA chains, with the high bits and K-quant
    scales) in whole k-steps (no masks), split across programs (Q4_K also across the warps
    of one, at 3 rows of x), equals the dequantized product; with silu, on the joint
    [gate; up], it gives the GEMV then cuda_ops.silu_mul bit for bit (the tickets reset for
    a second call)."""
    from mlxrun.backends import cuda_ops

    n, nb = 16, 8  # 8 gate rows (2 tiles of 4 gate + 4 up); K = 2048: 256 words a row
    w, ref = _case(kind, n, nb, seed=21)
    gen = torch.Generator().manual_seed(4)
    # with and without the next step's words in flight (Q6_K's default is without)
    runs = ((2, 1, 1, True), (1, 2, 3, False)) if kind == "Q4_K" else ((2, 1, 1, True),)
    for sk, nw, m, pf in runs:
        cfg = tk.KernelConfig("gemv", 1, 8, sk, num_warps=nw, prefetch=pf)
        x = torch.randn(m, w.k, generator=gen).bfloat16()
        y = kq.kqmatmul(x.to(DEV), w, cfg)
        _check(y, x, ref)
        want = cuda_ops.silu_mul(y[:, : n // 2], y[:, n // 2 :])
        for _ in range(2):
            assert torch.equal(kq.kqmatmul(x.to(DEV), w, cfg, silu=True), want)
    x = torch.randn(20, w.k).bfloat16().to(DEV)
    assert not kq.silu_fusable(x, w)  # the GEMM has no SiLU epilogue
    with pytest.raises(ValueError, match="silu"):
        kq.kqmatmul(x, w, silu=True)


@pytest.mark.parametrize("v", ["0", "3"])
def test_q4k_lane_gemv_scale_loads(v, monkeypatch):
    """Q4_K's (sc, m) and (d, dmin) loaded lanes-first (MLXRUN_KQ_VARIANT=3 and later, the default,
    at N <= 4096) and as before (0, kept for A/B timing), on 2 warps with row and K masks
    (20 rows, 3 super-blocks), split in 2: the dequantized product."""
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", v)
    w, ref = _case("Q4_K", 20, 3, seed=17)
    assert kq._loads(w) == (v == "3")
    x = torch.randn(1, w.k, generator=torch.Generator().manual_seed(7)).bfloat16()
    cfg = tk.KernelConfig("gemv", 1, 8, 2, num_warps=2, prefetch=False)
    _check(kq.kqmatmul(x.to(DEV), w, cfg), x, ref)


@pytest.mark.parametrize(
    "n,nb,sk,nw,dtype,silu,v",
    [
        (16, 8, 2, 1, torch.bfloat16, False, "1"),
        (20, 3, 2, 2, torch.float32, False, "1"),
        (16, 8, 1, 2, torch.bfloat16, True, "1"),
        (20, 6, 2, 4, torch.bfloat16, False, "2"),
        (20, 3, 2, 2, torch.float32, False, "0"),
        (20, 6, 2, 2, torch.bfloat16, False, "4"),
        (16, 8, 1, 1, torch.float32, False, "4"),
        (20, 6, 2, 2, torch.bfloat16, False, "6"),
        (16, 8, 1, 1, torch.float32, True, "6"),
        (16, 8, 1, 2, torch.bfloat16, True, "9"),
    ],
    ids=[
        "1warp-split2",
        "2warps-masked-split2-fp32",
        "2warps-silu",
        "4warps-masked-split2",
        "old-loads-2warps-masked",
        "byte-fields-2warps-masked-split2",
        "byte-fields-1warp-fp32",
        "spread-2warps-masked-split2",
        "spread-1warp-fp32-silu",
        "spread-unmasked-scales-2warps-silu",
    ],  # fmt: skip
)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_q6k_lane_gemv(n, nb, sk, nw, dtype, silu, v, monkeypatch):
    """Q6_K's lane GEMV (_lane_x4's 1-D x loads, the uint16 scale pair, the high words and
    scales loaded in the lanes' layout) on one and several warps, x in bf16 pairs and fp32,
    with row and K masks (20 rows, 3 or 6 super-blocks), split-K and the SiLU epilogue:
    the dequantized product, and silu_mul of it bit for bit; also the previous loads
    (MLXRUN_KQ_VARIANT=0, kept for A/B timing), the codes decoded as byte fields (4) and
    from the high words laid out spread (6), its scales loaded without masks (9, whole
    tiles and k-steps)."""
    from mlxrun.backends import cuda_ops

    monkeypatch.setenv("MLXRUN_KQ_VARIANT", v)
    w, ref = _case("Q6_K", n, nb, seed=31)
    spread = v in ("6", "9")
    assert w.hi_spread == spread and kq._loads(w) == {"0": 0, "4": 2, "6": 3, "9": 3}.get(v, 1)
    x = torch.randn(1, w.k, generator=torch.Generator().manual_seed(6)).to(dtype)
    cfg = tk.KernelConfig("gemv", 1, 8, sk, num_warps=nw, prefetch=False)
    y = kq.kqmatmul(x.to(DEV), w, cfg)
    _check(y, x, ref)
    if silu:
        want = cuda_ops.silu_mul(y[:, : n // 2], y[:, n // 2 :])
        assert torch.equal(kq.kqmatmul(x.to(DEV), w, cfg, silu=True), want)


@pytest.mark.parametrize(
    "kind,n,nb,sk,nw,dtype",
    [
        ("Q4_K", 32, 8, 1, 2, torch.bfloat16),
        ("Q5_K", 48, 3, 2, 2, torch.float32),
        ("Q6_K", 32, 6, 2, 2, torch.bfloat16),
    ],
    ids=["q4k-2warps-silu", "q5k-masked-split2-fp32", "q6k-spread-masked-split2"],
)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_lane_gemv_16_rows(kind, n, nb, sk, nw, dtype, monkeypatch):
    """16 rows a program (two halves of 8 sharing x, MLXRUN_KQ_VARIANT=7's Q4_K gate/up,
    q/k/v and o; any kind through a config): the dequantized product, and the 8-row GEMV's output bit for bit
    (each half computes as an 8-row tile), with K masks (3 or 6 super-blocks) and split-K;
    with SiLU on the joint [gate; up], silu_mul of it bit for bit, twice (the tickets).
    The first k-step's scales loaded before the PDL wait (early, variant 8), and the scales
    loaded without masks where the tiles and k-steps are whole (9): the same bits."""
    import dataclasses

    from mlxrun.backends import cuda_ops

    w, ref = _case(kind, n, nb, seed=41)
    x = torch.randn(1, w.k, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEV)
    c8 = tk.KernelConfig("gemv", 1, 8, sk, num_warps=nw, prefetch=False)
    c16 = tk.KernelConfig("gemv", 1, 16, sk, num_warps=nw, prefetch=False)
    y = kq.kqmatmul(x, w, c16)
    _check(y, x.cpu(), ref)
    assert torch.equal(y, kq.kqmatmul(x, w, c8))
    for c in (c8, c16):
        assert torch.equal(y, kq.kqmatmul(x, w, dataclasses.replace(c, early=True)))
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "9")
    assert torch.equal(y, kq.kqmatmul(x, w, c16))
    if sk == 1:
        want = cuda_ops.silu_mul(y[:, : n // 2], y[:, n // 2 :])
        for _ in range(2):
            assert torch.equal(kq.kqmatmul(x, w, c16, silu=True), want)


@pytest.mark.parametrize(
    "kind,nw,silu,dtype",
    [("Q4_K", 2, True, torch.bfloat16), ("Q5_K", 1, False, torch.float32)],
    ids=["q4k-2warps-silu", "q5k-1warp-fp32"],
)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_kq_stream_gemv(kind, nw, silu, dtype, monkeypatch):
    """The streaming K-quant GEMV (quant/kquant_stream.py): 2 programs over 3 tiles of 8
    rows (program 0 takes tiles 0 and 2, its last look-ahead clamped), 2 k-steps a tile:
    the dequantized product; with SiLU, silu_mul of the lane GEMV's product bit for bit,
    and the lane GEMV's output bit for bit without (the same steps in the same order)."""
    from mlxrun.backends import cuda_ops

    monkeypatch.setattr(kq.tk, "_num_sms", lambda device: 1)
    w, ref = _case(kind, 24, 8 * nw, seed=23)  # 256 * nw words a row: 2 k-steps
    x = torch.randn(1, w.k, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEV)
    cfg = tk.KernelConfig("stream", 1, 8, 1, num_warps=nw, per_sm=2)
    assert kq._stream_ok(w, nw) and (w.k // 8) // (128 * nw) == 2
    lane = tk.KernelConfig("gemv", 1, 8, 1, num_warps=nw, prefetch=False)
    y = kq.kqmatmul(x, w, cfg)
    _check(y, x.cpu(), ref)
    assert torch.equal(y, kq.kqmatmul(x, w, lane))
    if silu:
        want = cuda_ops.silu_mul(y[:, :12], y[:, 12:])
        assert torch.equal(kq.kqmatmul(x, w, cfg, silu=True), want)


def test_kq_stream_launch(monkeypatch):
    """MLXRUN_KQ_STREAM=P: the stream (P programs a SM) for Q4_K/Q5_K shapes of 8+ tiles a
    SM whose k-steps are whole, the lane GEMV elsewhere and for Q6_K; off by default; a
    bad value is one clear error."""
    monkeypatch.setattr(kq.tk, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    gu = kq.random_kquant("Q4_K", 28672, 4096, "cpu")
    o = kq.random_kquant("Q4_K", 4096, 4096, "cpu")
    head6 = kq.random_kquant("Q6_K", 8 * 132 * 8, 4096, "cpu")
    assert kq.lane_config(1, gu, cuda).kernel == "gemv"
    monkeypatch.setenv("MLXRUN_KQ_STREAM", "3")
    c = kq.lane_config(1, gu, cuda)
    assert (c.kernel, c.per_sm, c.split_k) == ("stream", 3, 1)
    assert kq.lane_config(1, o, cuda).kernel == "gemv"
    assert kq.lane_config(1, head6, cuda).kernel == "gemv"
    monkeypatch.setenv("MLXRUN_KQ_STREAM", "x")
    with pytest.raises(kq.MlxrunError, match="MLXRUN_KQ_STREAM"):
        kq.lane_config(1, gu, cuda)


def test_q6k_launch_settings(monkeypatch):
    """Q6_K's lane GEMV: 2 warps where N <= 4096, 4 above, one for the head-sized (64+ row
    blocks a SM) with its register cap; one warp with the previous loads
    (MLXRUN_KQ_VARIANT=0), as many as Q4_K with 2; Q4_K's K <= 4096 on the previous loads
    but where N <= 4096 (3 and later; variant 1: every N; 2: none), Q6_K's codes as
    byte fields (4); 5 as 4 with Q6_K's two-warp K > 4096 capped; 6 as 5 with
    Q6_K laid out spread; 7 Q4_K on 16 rows; 8, 9 the scales early; 10 (the default) early
    where one k-step; a bad variant is one clear error."""
    import dataclasses

    monkeypatch.delenv("MLXRUN_KQ_VARIANT", raising=False)
    assert kq.kq_variant() == 10 and kq.random_kquant("Q6_K", 8, 256, "cpu").hi_spread  # default
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "4")  # the previous default: layout as stored
    w = kq.random_kquant("Q6_K", 64, 4096, "cpu")
    q4 = kq.random_kquant("Q4_K", 64, 4096, "cpu")
    assert not w.hi_spread and not kq.q6_spread()
    cuda = torch.device("cuda")
    monkeypatch.setattr(kq.tk, "_num_sms", lambda device: 132)
    assert kq.lane_config(1, w, cuda).num_warps == 2
    assert kq.lane_config(1, dataclasses.replace(w, n=6144), cuda).num_warps == 4
    assert kq.lane_config(1, dataclasses.replace(w, n=128256), cuda).num_warps == 1
    assert kq.lane_config(1, q4, cuda).num_warps == 4
    assert kq._loads(w) == 2 and kq._loads(q4) == 1  # Q6_K byte fields; Q4_K new loads
    assert kq._loads(dataclasses.replace(q4, n=6144)) == 0
    assert kq._maxnreg(w, 1) == {"maxnreg": kq.Q6K_MAXNREG}
    assert kq._maxnreg(w, 2) == {} and kq._maxnreg(q4, 1) == {}
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "0")
    assert kq.lane_config(1, w, cuda).num_warps == 1 and kq._loads(w) == 0
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "1")  # the previous default
    assert kq.lane_config(1, w, cuda).num_warps == 2 and kq._loads(q4) == 0
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "2")
    assert kq.lane_config(1, w, cuda).num_warps == 4
    assert kq._loads(dataclasses.replace(q4, n=6144)) == 1
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "3")  # as 4 but Q6_K's codes nibble + high bits
    assert kq._loads(w) == 1 and kq._loads(q4) == 1
    assert kq.lane_config(1, w, cuda).num_warps == 2
    down = dataclasses.replace(w, k=14336)  # 2 warps
    assert kq._maxnreg(down, 2) == {}
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "5")  # as 4, the down projection capped too
    assert kq._maxnreg(down, 2) == {"maxnreg": kq.Q6K_MAXNREG} and kq._maxnreg(w, 2) == {}
    assert kq._loads(w) == 2 and kq._maxnreg(dataclasses.replace(q4, k=14336), 2) == {}
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "6")  # as 5, Q6_K laid out spread
    assert kq.q6_spread() and kq._loads(dataclasses.replace(w, hi_spread=True)) == 3
    assert kq._loads(w) == 2  # a weight's decode follows its layout
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "0")
    assert kq._loads(dataclasses.replace(w, hi_spread=True)) == 3
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "7")  # Q4_K on 16 rows where <= 2 k-steps
    assert kq.lane_config(1, dataclasses.replace(q4, n=28672), cuda).block_n == 16
    assert kq.lane_config(1, dataclasses.replace(q4, n=28672, k=14336), cuda).block_n == 8
    assert kq.lane_config(1, dataclasses.replace(w, n=28672), cuda).block_n == 8  # Q6_K
    assert not kq.lane_config(1, q4, cuda).early
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "8")  # as 7, the first step's scales early
    c = kq.lane_config(1, dataclasses.replace(q4, n=28672), cuda)
    assert c.early and c.block_n == 16 and kq.lane_config(1, w, cuda).early
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "10")  # early: one k-step a program (Q6_K: many)
    c = kq.lane_config(1, dataclasses.replace(q4, n=28672), cuda)
    assert c.early and c.block_n == 16
    assert not kq.lane_config(1, dataclasses.replace(q4, n=4096, k=14336), cuda).early  # down
    assert kq.lane_config(1, dataclasses.replace(w, n=28672), cuda).early
    assert not kq.lane_config(1, dataclasses.replace(w, n=6144), cuda).early
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "6")
    assert kq.lane_config(1, dataclasses.replace(q4, n=28672), cuda).block_n == 8
    # kq_ab.py's fN: N warps on any shape
    head = dataclasses.replace(w, n=128256)
    assert [kq.lane_config(1, head, cuda, f).num_warps for f in (0, 2, 4)] == [1, 2, 4]
    assert kq.lane_config(1, dataclasses.replace(w, n=6144), cuda, 1).num_warps == 1
    assert kq.lane_config(1, dataclasses.replace(w, k=512), cuda, 4).num_warps == 1  # 1 k-step
    monkeypatch.setenv("MLXRUN_KQ_VARIANT", "x")
    with pytest.raises(kq.MlxrunError, match="MLXRUN_KQ_VARIANT"):
        kq.lane_config(1, w, cuda)


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
