"""Quantized GEMV/GEMM kernels of quant/triton_kernels.py (qmatmul) against the MLX oracle.

Shared set-up and the numpy decoder: tests/_kernels.py.
"""

import dataclasses
import types

import numpy as np
import pytest

from mlxrun.errors import MlxrunError

from ._kernels import (
    DEV,
    FMT_IDS,
    FORMATS,
    HAS_CUDA,
    LONG_ON_CPU,
    cuda,
    mx,
    need_cuda,
    need_mlx,
    random_packed,
    ref_dequant,
    rel_err,
    tk,
    torch,
)

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


@pytest.mark.parametrize(
    "group_size,m", [(64, 32), (64, 64), (128, 9)], ids=["g64-m32", "g64-m64", "g128-m9"]
)
def test_small_m_gemm_tma_loads(monkeypatch, group_size, m):
    """The batched-decode GEMM with TMA loads (triton_gemm_tma.py) as choose_config
    launches it on a 132-SM GPU, with 128 and 256 inputs a k-step (and on a GPU the L2
    prefetch before the PDL wait): int4 with bf16 scales, N = 256 and K = 1024 (whole
    tiles and k-steps), split-K, rows of x past M in the tile; against the float64 decoder
    and, under the interpreter, bit for bit the cp.async kernel at the same launch. N = 264
    (a part tile) takes the cp.async kernel."""
    import mlxrun.quant.triton_launch as launch

    monkeypatch.setattr(launch, "_num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1024, generator=gen).to(torch.bfloat16).to(DEV)
    dev = types.SimpleNamespace(type="cuda")
    for n in (256, 264):
        w, s, b = random_packed(n, 1024, "affine", 4, group_size, gen)
        ref = ref_dequant(w.numpy(), s.float().numpy(), b.float().numpy(), "affine", 4, group_size)
        want = x.cpu().double() @ torch.from_numpy(ref).T
        q = tk.prepare(w.to(DEV), s.to(DEV), b.to(DEV), "affine", 4, group_size)
        ys = {}
        for spec in ("128,4,4,2,1,0,1", "128,4,3,4,1,2,1", "128,4,4,2,1,0"):
            monkeypatch.setattr(launch, "SMALL_M_GEMM", launch._small_m_gemm(spec))
            monkeypatch.setattr(launch, "SMALL_M_GEMM_64", launch._small_m_gemm(spec))
            cfg = launch.choose_config(m, q, dev, torch.bfloat16)
            assert cfg.split_k > 1 and cfg.tma == spec.count(",") // 6
            assert tk.tma_fits(x, q, cfg) == (n == 256 and cfg.tma == 1)
            ys[spec] = tk.qmatmul(x, q, cfg)
            assert rel_err(ys[spec].cpu(), want) < 1e-2
        if not HAS_CUDA:  # the same decode and dot order (a GPU's may round differently)
            assert torch.equal(ys["128,4,4,2,1,0,1"], ys["128,4,4,2,1,0"])


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


@pytest.mark.parametrize(
    "mode,bits,group_size", [FORMATS[1], FORMATS[6], FORMATS[7]], ids=["int4", "mxfp4", "nvfp4"]
)
def test_gemv_orders_equal_the_default(mode, bits, group_size):
    """seq (a 16-row tile's first 8 rows through every position, then the second 8), early
    (one k-step's scales loaded with its words), xvec (fp4: a k-step's x loaded at once,
    4 16-byte vectors a lane) and quads (fp4: a SiLU 8-row tile's scales as two 4-row runs)
    run the same FFMA chains as the
    default order: bit-identical outputs, plain (on the prefetch loop and without it) and
    with the SiLU epilogue (int4: 16-row tiles; mxfp4, nvfp4: 8; nvfp4's lanes take two
    scale groups); and near the float64 product of the dequantized weight."""
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
    if mode != "affine":  # seq is the default order at 8 rows; xvec: x a k-step at a time
        cases = [(True, True, ("early", "xvec")), (False, False, ("xvec",))]
    for pf, silu, names in cases:
        old = tk.KernelConfig("gemv", 1, bn, 1, prefetch=pf)
        want = tk.qmatmul(x, w, old, silu=silu)
        if not silu:
            assert rel_err(want.cpu(), x.cpu().double() @ ref.T) < 1e-2
        for name in names:
            new = dataclasses.replace(old, **{name: True})
            assert torch.equal(tk.qmatmul(x, w, new, silu=silu), want), new
        if "xvec" in names and "early" in names:
            new = dataclasses.replace(old, early=True, xvec=True)
            assert torch.equal(tk.qmatmul(x, w, new, silu=silu), want), new
        if silu and mode != "affine":  # quads: the SiLU tile's scales as two 4-row runs
            for new in (dataclasses.replace(old, quads=True),
                        dataclasses.replace(old, quads=True, xvec=True)):  # fmt: skip
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
