"""The 8-bit streaming GEMV of quant/triton_kernels.py against the one-shot GEMV and MLX.

Shared set-up and the numpy decoder: tests/_kernels.py.
"""

import pytest

from ._kernels import (
    DEV,
    FORMATS,
    LONG_ON_CPU,
    random_packed,
    ref_dequant,
    rel_err,
    tk,
    torch,
)

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
