"""The batched-decode GEMM's launch options (triton_launch.SMALL_M_GEMM, MLXRUN_SMALL_M_GEMM):
the L2 request ahead (KernelConfig.l2_ahead) against the float64 decoder and against the
same tiles without it, and the launch string's numbers as choose_config applies them.

Shared set-up and the numpy decoder: tests/_kernels.py.
"""

import types

import pytest

from ._kernels import DEV, FORMATS, need_cuda, random_packed, ref_dequant, rel_err, tk, torch

# affine 4-bit (the packed decode), mxfp4 (E2M1 codes), affine 8-bit (the per-element decode)
CASES = [FORMATS[i] for i in (1, 6, 4)]


@need_cuda  # inline assembly: the interpreter runs the loop without the L2 requests
@pytest.mark.parametrize(
    "mode,bits,group_size,m",
    [(*f, m) for f, m in zip(CASES, (32, 17, 24))],
    ids=[f"{md}{b}g{g}-m{m}" for (md, b, g), m in zip(CASES, (32, 17, 24))],
)
def test_l2_ahead_equals_the_launch_without_it(mode, bits, group_size, m):
    """N = 136 (a partial row tile), K = 704 (five and a half 128-input k-steps, three a
    split, the last one masked: the requests past a split's end stay at its last step);
    M = 17, 24 leave masked rows. The requests change no arithmetic: outputs equal bit for
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
    y0 = tk.qmatmul(x.to(DEV), q, base).cpu()
    assert y0.shape == (m, n) and rel_err(y0, want) < 1e-2
    for ahead in (1, 4):
        cfg = tk.KernelConfig("gemm", 32, 64, 2, ng, num_warps=4, num_stages=3, swap=True,
                              l2_ahead=ahead)  # fmt: skip
        torch.testing.assert_close(tk.qmatmul(x.to(DEV), q, cfg).cpu(), y0, rtol=0, atol=0)


def test_launch_numbers_reach_choose_config(monkeypatch):
    """ "BLOCK_N,warps,stages,groups,waves,l2,ahead" gives choose_config's batched-decode
    launch those numbers (the groups at least 128 inputs); five or six leave the rest off."""
    import mlxrun.quant.triton_launch as launch

    monkeypatch.setattr(launch, "_num_sms", lambda device: 132)
    q = types.SimpleNamespace(n=4096, k=4096, bits=4, group_size=64, mode="affine")
    dev = types.SimpleNamespace(type="cuda")
    for spec, want in (
        ("128,4,4,2,1", (128, 4, 4, 2, 0, 0)),
        ("128,4,3,4,1,2", (128, 4, 3, 4, 2, 0)),
        ("64,4,4,2,1,0,6", (64, 4, 4, 2, 0, 6)),
    ):
        monkeypatch.setattr(launch, "SMALL_M_GEMM", launch._small_m_gemm(spec))
        c = launch.choose_config(32, q, dev, torch.bfloat16)
        assert (c.kernel, c.swap, c.block_m) == ("gemm", True, 32)
        assert (c.block_n, c.num_warps, c.num_stages, c.ng, c.l2_prefetch, c.l2_ahead) == want
