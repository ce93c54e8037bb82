"""The batched-decode GEMM's launch with the words loaded into registers a k-step ahead
(KernelConfig.reg_prefetch, MLXRUN_SMALL_M_GEMM's seventh number) against the float64
decoder and against the pipelined launch of the same tiles.

Shared set-up and the numpy decoder: tests/_kernels.py.
"""

import types

import pytest

from ._kernels import DEV, FORMATS, random_packed, ref_dequant, rel_err, tk, torch

# affine 4-bit (the packed decode), mxfp4 (E2M1 codes), affine 8-bit (the per-element decode)
CASES = [FORMATS[i] for i in (1, 6, 4)]


@pytest.mark.parametrize(
    "mode,bits,group_size,m",
    [(*f, m) for f, m in zip(CASES, (32, 17, 24))],
    ids=[f"{md}{b}g{g}-m{m}" for (md, b, g), m in zip(CASES, (32, 17, 24))],
)
def test_register_prefetch_equals_the_pipelined_launch(mode, bits, group_size, m):
    """N = 136 (a partial row tile), K = 704 (five and a half 128-input k-steps, three a
    split, the last one masked): each split's last step loads itself again; M = 17, 24
    leave masked rows. The arithmetic is the pipelined launch's, so the outputs are equal bit for
    bit, and both match x @ the dequantized weight."""
    gen = torch.Generator().manual_seed(group_size + m)
    n, k = 136, 704
    w, s, b = random_packed(n, k, mode, bits, group_size, gen)
    sn = s.float().numpy() if mode == "affine" else s.numpy()
    bn = None if b is None else b.float().numpy()
    ref = ref_dequant(w.numpy(), sn, bn, mode, bits, group_size)
    q = tk.prepare(w.to(DEV), s.to(DEV), None if b is None else b.to(DEV), mode, bits, group_size)
    ng = max(1, 128 // group_size)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = x.double() @ torch.from_numpy(ref).T
    base = tk.KernelConfig("gemm", 32, 64, 2, ng, num_warps=4, num_stages=3, swap=True)
    rpf = tk.KernelConfig("gemm", 32, 64, 2, ng, num_warps=4, num_stages=1, swap=True,
                          reg_prefetch=True)  # fmt: skip
    y0 = tk.qmatmul(x.to(DEV), q, base).cpu()
    y1 = tk.qmatmul(x.to(DEV), q, rpf).cpu()
    assert y1.shape == (m, n) and rel_err(y1, want) < 1e-2
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    if DEV == "cuda":  # L2 requests ahead (no inline assembly in the interpreter)
        ahead = tk.KernelConfig("gemm", 32, 64, 2, ng, num_warps=4, num_stages=3, swap=True,
                                l2_ahead=2)  # fmt: skip
        torch.testing.assert_close(tk.qmatmul(x.to(DEV), q, ahead).cpu(), y0, rtol=0, atol=0)


def test_seventh_number_selects_it(monkeypatch):
    """ "BLOCK_N,warps,stages,groups,waves,l2,1" gives choose_config's batched-decode launch
    the register prefetch with one stage; six numbers keep the pipeline."""
    import mlxrun.quant.triton_launch as launch

    monkeypatch.setattr(launch, "_num_sms", lambda device: 132)
    q = types.SimpleNamespace(n=4096, k=4096, bits=4, group_size=64, mode="affine")
    dev = types.SimpleNamespace(type="cuda")
    for spec, want in (
        ("128,4,4,2,1,0,1", (True, 1, 0)),
        ("128,4,4,2,1,0", (False, 4, 0)),
        ("128,4,4,2,1,0,0,6", (False, 4, 6)),
    ):
        monkeypatch.setattr(launch, "SMALL_M_GEMM", launch._small_m_gemm(spec))
        cfg = launch.choose_config(32, q, dev, torch.bfloat16)
        assert (cfg.kernel, cfg.block_n, cfg.swap) == ("gemm", 128, True)
        assert (cfg.reg_prefetch, cfg.num_stages, cfg.l2_ahead) == want
