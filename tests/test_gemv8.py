"""The 8-bit batch-1 GEMVs (int8 = affine 8-bit, fp8 = mxfp8): the streaming kernel's
launch options against its default and the one-shot GEMV, and choose_config's rule.
Under TRITON_INTERPRET=1 without a GPU (small shapes: seconds), on the GPU as they are."""

from __future__ import annotations

import types

import pytest

from ._kernels import DEV, tk, torch  # the interpreter set up without a GPU

FORMATS8 = [("affine", 8, 64), ("mxfp8", 8, 32)]


def _weight(n: int, k: int, mode: str, g: int, seed: int):
    """A random 8-bit QLinear [n, k] (no E4M3 NaN codes) and its dequantized float64 rows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**31), 2**31, (n, k // 4), generator=gen, dtype=torch.int64)
    if mode == "mxfp8":  # 0x7F / 0xFF in any byte is NaN: no quantizer writes it
        u = w.to(torch.int32).view(torch.uint8)
        u[(u & 0x7F) == 0x7F] -= 1
        w = u.view(torch.int32).to(torch.int64)
    w = w.to(torch.int32)
    if mode == "affine":
        s = (torch.rand(n, k // g, generator=gen) * 0.01 + 1e-3).bfloat16()
        b = (-128 * s.float()).bfloat16()
    else:
        s, b = torch.randint(118, 125, (n, k // g), generator=gen).to(torch.uint8), None
    q = tk.prepare(w.to(DEV), s.to(DEV), None if b is None else b.to(DEV), mode, 8, g)
    return q, tk.dequantize_torch(q).double().cpu()


def _stream(per_sm: int, block_n: int = 8, ahead: bool = False, mode: str = "affine"):
    return tk.KernelConfig("stream", 1, block_n, 1, num_warps=1, per_sm=per_sm,
                           cvt=mode == "mxfp8", ahead=ahead)  # fmt: skip


@pytest.mark.parametrize("mode,bits,g", FORMATS8, ids=["int8", "mxfp8"])
def test_stream_ahead_equals_the_stream(mode, bits, g):
    """KernelConfig.ahead only moves the next tile's loads (into a branch, skipped past a
    program's last tile): bit-identical to the default stream, with and without the SiLU
    epilogue, where programs take 2, 2, 1, 1 tiles of two k-steps (the interpreter has 4
    SMs), and close to the float64 product."""
    n, k = 48, 1024  # 6 tiles of 8 rows, two k-steps of 128 words at 1 warp
    q, dense = _weight(n, k, mode, g, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEV)
    ref = x.double().cpu() @ dense.T
    base = tk.qmatmul(x, q, _stream(1, mode=mode))
    ahead = tk.qmatmul(x, q, _stream(1, ahead=True, mode=mode))
    assert torch.equal(ahead, base)
    assert ((ahead.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2
    silu = tk.qmatmul(x, q, _stream(1, ahead=True, mode=mode), silu=True)
    assert torch.equal(silu, tk.qmatmul(x, q, _stream(1, mode=mode), silu=True))
    gate, up = base.double().cpu().split(n // 2, -1)  # rounded to bf16 as the kernels round
    want = torch.nn.functional.silu(gate) * up
    assert ((silu.double().cpu() - want).norm() / want.norm()).item() < 1e-2


def test_stream_ahead_one_tile_a_program_and_16_rows():
    """The branch's other sides: every program's only tile is its last (nothing loaded
    ahead), and 16-row tiles (two halves loaded ahead); int8, equal to the default stream."""
    n, k = 64, 512  # one k-step: the look-ahead is the loop's only load
    q, dense = _weight(n, k, "affine", 64, seed=7)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(8)).bfloat16().to(DEV)
    for per_sm, bn in ((4, 8), (1, 16)):  # 8 tiles on 16 programs; 4 tiles of 16 on 4
        got = tk.qmatmul(x, q, _stream(per_sm, bn, ahead=True))
        assert torch.equal(got, tk.qmatmul(x, q, _stream(per_sm, bn)))
    ref = x.double().cpu() @ dense.T
    assert ((got.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2


def test_stream_ahead_is_chosen_only_when_asked(monkeypatch):
    """choose_config on an H100-sized GPU: MLXRUN_STREAM_AHEAD puts every 8-bit stream
    shape of the 8B model (gate/up, down, head) in 8-row tiles with ahead; q/k/v and o keep
    the one-shot GEMV; 4-bit never streams. Without it, 16-row tiles but 8 on the down
    projection's long rows (7 k-steps), int8 as mxfp8."""
    from mlxrun.quant import triton_launch

    monkeypatch.setattr(triton_launch, "_num_sms", lambda device: 132)
    gpu = types.SimpleNamespace(type="cuda")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]

    def picks(mode, bits, g):
        out = []
        for n, k in shapes:
            w = types.SimpleNamespace(n=n, k=k, bits=bits, group_size=g, mode=mode)
            c = tk.choose_config(1, w, gpu)
            out.append((c.kernel, c.block_n, c.ahead) if c.kernel == "stream" else c.kernel)
        return out

    monkeypatch.setattr(triton_launch, "STREAM_AHEAD", False)
    default = [("stream", 16, False), ("stream", 8, False), ("stream", 16, False)]
    assert picks("affine", 8, 64)[2:] == picks("mxfp8", 8, 32)[2:] == default
    monkeypatch.setattr(triton_launch, "STREAM_AHEAD", True)
    for mode, g in (("affine", 64), ("mxfp8", 32)):
        assert picks(mode, 8, g) == ["gemv", "gemv"] + [("stream", 8, True)] * 3
    assert picks("affine", 4, 64) == ["gemv"] * 5


@pytest.mark.parametrize("mode,bits,g", FORMATS8, ids=["int8", "mxfp8"])
def test_eight_warps_one_k_step(mode, bits, g):
    """8 warps a program at K = 4096 (one k-step of 1024 words a row, the lanes of 8 warps
    summed through shared memory): the one-shot GEMV in 16- and 8-row tiles and the stream
    (a tile a program) against the float64 product, and with the SiLU epilogue against
    silu(gate) * up of the plain product."""
    n, k = 32, 4096
    q, dense = _weight(n, k, mode, g, seed=11)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(12)).bfloat16().to(DEV)
    ref = x.double().cpu() @ dense.T
    gate, up = ref.split(n // 2, -1)
    want = torch.nn.functional.silu(gate) * up
    cfgs = [tk.KernelConfig("gemv", 1, 16, 1, num_warps=8),
            tk.KernelConfig("gemv", 1, 8, 1, num_warps=8),
            tk.KernelConfig("stream", 1, 16, 1, num_warps=8, per_sm=1, cvt=True)]  # fmt: skip
    for cfg in cfgs:
        got = tk.qmatmul(x, q, cfg).double().cpu()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, cfg
        got = tk.qmatmul(x, q, cfg, silu=True).double().cpu()
        assert ((got - want).norm() / want.norm()).item() < 2e-2, cfg


def test_launch_names_and_the_per_linear_table(monkeypatch):
    """launch_from_name reads gemv8_sweep.py's names; MLXRUN_GEMV8_LAUNCH's table replaces
    choose_config's pick for the 8-bit linear of that role at batch 1 only, where the shape
    takes the launch (whole stream tiles and k-steps), and not with MLXRUN_GEMV8=old; a
    bad entry is one MlxrunError naming it."""
    from mlxrun.errors import MlxrunError
    from mlxrun.quant import triton_launch as tl8

    c = tl8.launch_from_name("g8w4s2")
    assert (c.kernel, c.block_n, c.num_warps, c.split_k, c.prefetch) == ("gemv", 8, 4, 2, True)
    c = tl8.launch_from_name("c16w8p3b")
    assert (c.kernel, c.block_n, c.num_warps, c.per_sm, c.cvt, c.balance, c.ahead) == (
        "stream", 16, 8, 3, True, True, False)  # fmt: skip
    assert not tl8.launch_from_name("g16w4s1nopf").prefetch
    assert tl8.launch_from_name("s8w4p4").cvt is False
    for bad in ("g12w4s1", "c16w4", "x16w4p1", "g16w3s1"):
        with pytest.raises(ValueError):
            tl8.launch_from_name(bad)
    with pytest.raises(MlxrunError, match="'qkv=g99w4s1'"):
        tl8._gemv8_launches("o=g8w4s2,qkv=g99w4s1")
    for bad in ("up=g8w4s1", "o:int4=g8w4s1", "o"):
        with pytest.raises(MlxrunError, match=f"'{bad}'"):
            tl8._gemv8_launches(bad)
    assert tl8._gemv8_launches("none") == {} == tl8._gemv8_launches("")

    monkeypatch.setattr(tl8, "_num_sms", lambda device: 132)
    gpu = types.SimpleNamespace(type="cuda")
    table = tl8._gemv8_launches("qkv=g8w4s2,o=c16w4p1,gu=c8w4p6,gu:fp8=g16w8s1")
    monkeypatch.setattr(tl8, "GEMV8_LAUNCH", table)

    def pick(n, k, bits=8, mode="affine", g=64, m=1):
        return tk.choose_config(m, types.SimpleNamespace(n=n, k=k, bits=bits, group_size=g,
                                                          mode=mode), gpu)  # fmt: skip

    assert pick(6144, 4096) == table["qkv"] == pick(6144, 4096, mode="mxfp8", g=32)
    assert pick(4096, 4096) == table["o"] and pick(28672, 4096) == table["gu"]
    assert pick(28672, 4096, mode="mxfp8", g=32) == table["gu:fp8"]
    assert [tl8.role8(types.SimpleNamespace(n=n, k=k)) for n, k in
            ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))] == [
        "qkv", "o", "gu", "down", "head"]  # fmt: skip
    assert pick(4104, 4104) != table["o"]  # 16-row stream tiles do not divide 4104 rows
    assert pick(6144, 4096, m=2) != table["qkv"]
    assert pick(6144, 4096, bits=4) != table["qkv"]
    monkeypatch.setattr(tl8, "GEMV8", "old")
    assert pick(4096, 4096) != table["o"]
    monkeypatch.setattr(tl8, "GEMV8", "stream")
    monkeypatch.setattr(tl8, "GEMV8_LAUNCH", None)  # read from the environment at first use
    monkeypatch.setenv("MLXRUN_GEMV8_LAUNCH", "o:fp8=c8w4p2")
    assert pick(4096, 4096, mode="mxfp8", g=32) == tl8.launch_from_name("c8w4p2")
    assert pick(4096, 4096) != tl8.launch_from_name("c8w4p2")
    monkeypatch.setattr(tl8, "GEMV8_LAUNCH", None)
    monkeypatch.setenv("MLXRUN_GEMV8_LAUNCH", "o=c8w4")
    with pytest.raises(MlxrunError, match="'o=c8w4'"):
        pick(4096, 4096)


@pytest.mark.parametrize("mode,bits,g", FORMATS8, ids=["int8", "mxfp8"])
def test_named_launches_at_k_4096(mode, bits, g):
    """The launches the per-linear table may name, at K = 4096 (two k-steps of 512 words a
    row on 4 warps): split K in 2 across programs, and the stream in 16-row tiles, against
    the float64 product."""
    from mlxrun.quant import triton_launch as tl8

    n, k = 16, 4096
    q, dense = _weight(n, k, mode, g, seed=13)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(14)).bfloat16().to(DEV)
    ref = x.double().cpu() @ dense.T
    for name in ("g8w4s2", "c16w4p1"):
        got = tk.qmatmul(x, q, tl8.launch_from_name(name)).double().cpu()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, name
