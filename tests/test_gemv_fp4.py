"""The batch-1 fp4 GEMVs (mxfp4: E2M1 codes, groups of 32, E8M0 scales; nvfp4: E2M1, groups
of 16, E4M3 scales): the streaming GEMV (quant/triton_gemv_stream.py) on the 4-bit formats,
and the launches choose_config picks for them.

Without a GPU the kernels run under TRITON_INTERPRET=1 at small sizes; the oracle is an
independent float64 decoder of the canonical (MLX) words, and the one-shot GEMV, whose
FFMA chains the streaming kernel repeats (so their outputs must be equal bit for bit).
"""

import dataclasses
import importlib
import types

import numpy as np
import pytest

from ._kernels import _E2M1, DEV, _e4m3, tk, torch  # the interpreter set up without a GPU

FP4 = [("mxfp4", 32), ("nvfp4", 16)]


def packed_fp4(n: int, k: int, mode: str, group_size: int, seed: int):
    """Random canonical words int32 [n, k/8] (code i at bits 4i..4i+3) and scales uint8
    [n, k/G] (E8M0 around 2^-6, or E4M3 of 2^-9 .. 2^-4 without sign or NaN)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**31), 2**31, (n, k // 8), generator=gen, dtype=torch.int64)
    lo, hi = (0x10, 0x3F) if mode == "nvfp4" else (118, 125)
    s = torch.randint(lo, hi, (n, k // group_size), generator=gen).to(torch.uint8)
    return w.to(torch.int32), s, gen


def ref_fp4(w: torch.Tensor, s: torch.Tensor, mode: str, group_size: int) -> torch.Tensor:
    """float64 [n, k]: the canonical words decoded with numpy, independently of quant/."""
    u = w.numpy().astype(np.uint32).astype(np.int64)
    codes = ((u[..., None] >> (np.arange(8) * 4)) & 15).reshape(u.shape[0], -1)
    v = np.where(codes >= 8, -1.0, 1.0) * _E2M1[codes & 7]
    sn = s.numpy()
    sf = _e4m3(sn) if mode == "nvfp4" else np.exp2(sn.astype(np.float64) - 127)
    return torch.from_numpy(v * np.repeat(sf, group_size, 1))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output"
    return ((y.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("mode,group_size", FP4, ids=[m for m, _ in FP4])
def test_fp4_streaming_gemv_equals_the_one_shot_gemv(mode, group_size):
    """The streaming GEMV on mxfp4 / nvfp4 words (prepare's E2M1 bit layout) gives the
    one-shot GEMV's output bit for bit: 8 or 16 rows, 1 or 2 warps, plain and with the SiLU
    epilogue, fewer programs than tiles (each streams several; the last ones clamp
    their look-ahead); and the float64 decoder's product within bf16 rounding."""
    # 10 tiles of 8 rows (5 of 16) over 4 programs (the interpreter's 4 SMs, per_sm 1), so
    # each streams 1 to 3; 2 one-warp k-steps a row, 1 two-warp one
    n, k = 80, 2048
    w, s, gen = packed_fp4(n, k, mode, group_size, seed=group_size)
    q = tk.prepare(w.to(DEV), s.to(DEV), None, mode, 4, group_size)
    x = torch.randn(1, k, generator=gen).bfloat16()
    want = x.double() @ ref_fp4(w, s, mode, group_size).T
    x = x.to(DEV)
    # (the interpreter's time allows one launch a format: mxfp4 8 rows on 1 warp, nvfp4 16
    # rows on 2; each plain and with the SiLU epilogue)
    bn, warps = (8, 1) if mode == "mxfp4" else (16, 2)
    st = tk.KernelConfig("stream", 1, bn, 1, num_warps=warps, per_sm=1)
    one = tk.KernelConfig("gemv", 1, bn, 1, num_warps=warps)
    y = tk.qmatmul(x, q, st)
    assert torch.equal(y, tk.qmatmul(x, q, one))
    assert rel_err(y, want) < 1e-2
    ys = tk.qmatmul(x, q, st, silu=True)
    assert torch.equal(ys, tk.qmatmul(x, q, one, silu=True))
    # silu of the rounded gate and up outputs (rounded in the epilogue as y is)
    g, u = y.double().cpu().split(n // 2, -1)
    assert rel_err(ys, torch.nn.functional.silu(g) * u) < 1e-2


@pytest.mark.parametrize("mode,group_size", FP4, ids=[m for m, _ in FP4])
def test_fp4_launches_on_an_h100(monkeypatch, mode, group_size):
    """choose_config at batch 1 on an H100-sized GPU: the one-shot GEMV on every 8B shape (the
    default, MLXRUN_GEMV4=old); with "new" the streaming GEMV (8 rows, 2 warps) for fp4's
    long rows (the down projection, K > N) and the same launches elsewhere."""
    from mlxrun.quant import triton_launch

    monkeypatch.setattr(triton_launch, "_num_sms", lambda device: 132)
    gpu = types.SimpleNamespace(type="cuda")
    shapes = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (128256, 4096)]

    def picks():
        out = []
        for n, k in shapes:
            w = types.SimpleNamespace(n=n, k=k, bits=4, group_size=group_size, mode=mode)
            c = tk.choose_config(1, w, gpu)
            out.append((c.kernel, c.block_n, c.num_warps))
        return out

    monkeypatch.setattr(triton_launch, "GEMV4", "new")
    new = picks()
    assert new[1] == ("stream", 8, 2)
    assert [c[0] for c in new[:1] + new[2:]] == ["gemv"] * 4
    monkeypatch.setattr(triton_launch, "GEMV4", "old")
    old = picks()
    assert [c[0] for c in old] == ["gemv"] * 5
    assert old[:1] + old[2:] == new[:1] + new[2:]


@pytest.mark.parametrize("mode,group_size", FP4, ids=[m for m, _ in FP4])
def test_fp4_decode_equals_the_old_decode(mode, group_size):
    """The fp4 decodes give the old decode's outputs (MLXRUN_GEMV4=old, MLXRUN_GEMV4_LOADS=0)
    bit for bit: "new" (nvfp4's E4M3 scales by the hardware conversion where compiled), with
    MLXRUN_E2M1_PAIR=1 (E2M1 positions 3 and 7 from one mask) and the default (both for
    nvfp4 only), the kernels reloaded for each; over every E2M1 code and every finite E4M3
    scale code (subnormals included); and the float64 decoder's product."""
    from mlxrun.quant import triton_decode, triton_gemv, triton_gemv_step, triton_launch

    n, k = 16, 512
    w, s, gen = packed_fp4(n, k, mode, group_size, seed=3)
    if mode == "nvfp4":  # all 254 finite codes (not 0x7F, 0xFF), then random ones
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        s.view(-1)[: codes.numel()] = codes
    q = tk.prepare(w.to(DEV), s.to(DEV), None, mode, 4, group_size)
    x = torch.randn(1, k, generator=gen).bfloat16()
    want = x.double() @ ref_fp4(w, s, mode, group_size).T
    x = x.to(DEV)
    cfg = tk.KernelConfig("gemv", 1, 8, 1)
    saved = (triton_launch.GEMV4, triton_launch.E2M1_PAIR_ON, triton_launch.GEMV4_LOADS,
             tk._gemv_kernel)  # fmt: skip
    outs = []
    try:  # the old decodes; E4M3 by cvt where compiled; with the shared E2M1 mask; nvfp4's
        # default (GEMV4_LOADS: cvt and the shared mask for nvfp4 only)
        for gemv4, pair, loads in (("old", False, False), ("new", False, False),
                                   ("new", True, False), ("old", False, True)):  # fmt: skip
            triton_launch.GEMV4, triton_launch.E2M1_PAIR_ON = gemv4, pair
            triton_launch.GEMV4_LOADS = loads
            importlib.reload(triton_decode)  # its decode reads the switches
            importlib.reload(triton_gemv_step)
            tk._gemv_kernel = importlib.reload(triton_gemv)._gemv_kernel
            outs.append(tk.qmatmul(x, q, cfg))
    finally:
        triton_launch.GEMV4, triton_launch.E2M1_PAIR_ON = saved[:2]
        triton_launch.GEMV4_LOADS = saved[2]
        importlib.reload(triton_decode)
        importlib.reload(triton_gemv_step)
        importlib.reload(triton_gemv)
        tk._gemv_kernel = saved[3]
    assert rel_err(outs[0], want) < 1e-2
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("mode,group_size", FP4, ids=[m for m, _ in FP4])
def test_fp4_loads_on_an_h100(monkeypatch, mode, group_size):
    """choose_config at batch 1 on an H100-sized GPU: the fp4 GEMV loads x a k-step at a
    time (xvec) on every 8B shape and the scales with the words (early) where a split has
    one k-step (q/k/v, o), nvfp4 its SiLU tiles' scales as two 4-row runs (quads);
    MLXRUN_GEMV4_LOADS=0 (GEMV4_LOADS False) none of them, the same launches otherwise."""
    from mlxrun.quant import triton_launch

    monkeypatch.setattr(triton_launch, "_num_sms", lambda device: 132)
    gpu = types.SimpleNamespace(type="cuda")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]

    def picks():
        ws = [types.SimpleNamespace(n=n, k=k, bits=4, group_size=group_size, mode=mode)
              for n, k in shapes]  # fmt: skip
        return [tk.choose_config(1, w, gpu) for w in ws]

    new = picks()
    assert [(c.xvec, c.early) for c in new] == [(True, True)] * 2 + [(True, False)] * 3
    assert [c.quads for c in new] == [mode == "nvfp4"] * 5  # (it acts on gate/up only)
    monkeypatch.setattr(triton_launch, "GEMV4_LOADS", False)
    old = picks()
    assert all(not c.xvec and not c.early and not c.quads for c in old)
    strip = [dataclasses.replace(c, xvec=False, early=False, quads=False) for c in new]
    assert strip == old
