"""A quantized linear's bias added in the GEMV's epilogue (qmatmul's bias; the backend's
q/k/v and o biases of gpt-oss and Qwen2): values against the float64 product of the
dequantized weight, the split-K and GEMM paths, the model's logits with the kernels on."""

import numpy as np
import pytest

from ._kernels import DEV, FORMATS, LONG_ON_CPU, random_packed, rel_err, tk, torch


def _weight(n, k, fmt, seed):
    mode, bits, g = fmt
    gen = torch.Generator().manual_seed(seed)
    packed = random_packed(n, k, mode, bits, g, gen)
    w = tk.prepare(*(None if t is None else t.to(DEV) for t in packed), mode, bits, g)
    return w, tk.dequantize_torch(w).double().cpu(), gen


@pytest.mark.parametrize(
    "fmt", [FORMATS[1], pytest.param(FORMATS[6], marks=LONG_ON_CPU)], ids=["int4", "mxfp4"]
)
def test_bias_in_the_gemv_epilogue(fmt):
    """y = x @ W^T + b: float32 x near the float64 product (GEMV in one split, split-K
    across programs and across warps, 16-row tiles, and the GEMM, whose bias is added
    after); bf16 y rounded once from the float32 sum plus b, so within one bf16 step of it
    (the interpreter truncates where the GPU rounds; the GEMM's: y + b); the split-K tickets reset for a
    second call; a bias of the wrong length refused."""
    n, k = 24, 2048  # 3 tiles of 8 rows (2 of 16, the second masked); 2 one-warp k-steps
    w, ref, gen = _weight(n, k, fmt, 5)
    b = torch.randn(n, generator=gen)
    cases = [  # (launch, rows of x)
        (tk.KernelConfig("gemv", 1, 8, 1), 1),
        (tk.KernelConfig("gemv", 1, 8, 2), 1),
        (tk.KernelConfig("gemv", 1, 16, 1, num_warps=2), 1),
        (tk.KernelConfig("gemm", 16, 16, 2, ng=2, num_warps=4), 3),
    ]
    if DEV == "cuda":
        cases += [(tk.KernelConfig("gemv", 1, 8, 2, num_warps=2), 1)]
        cases += [(c, 1 if m == 3 else 3) for c, m in cases]
    for cfg, m in cases:
        x = torch.randn(m, k, generator=gen)
        want = x.double() @ ref.T + b.double()
        xb = x.bfloat16()
        for _ in range(2 if cfg.split_k > 1 else 1):  # the split-K tickets reset
            got = tk.qmatmul(x.to(DEV), w, cfg, bias=b.to(DEV)).cpu()
            assert rel_err(got, want) < 1e-5, cfg
        bb = b.bfloat16()
        s = tk.qmatmul(xb.to(DEV), w, cfg, out_dtype=torch.float32).cpu() + bb.float()
        got = tk.qmatmul(xb.to(DEV), w, cfg, bias=bb.to(DEV)).cpu()
        assert got.dtype == torch.bfloat16
        if cfg.kernel == "gemm":  # y rounded, then + b
            assert torch.equal(got, tk.qmatmul(xb.to(DEV), w, cfg).cpu() + bb)
            continue
        step = s.abs() * 2**-7 + 1e-6
        assert bool(((got.float() - s).abs() <= step).all()), cfg
    with pytest.raises(ValueError, match="bias"):
        tk.qmatmul(x.to(DEV), w, cases[0][0], bias=b[:-1].to(DEV))


def _spy(monkeypatch):
    """Record the output width of every qmatmul launched with a bias."""
    biased = []
    real = tk.qmatmul

    def spy(x, w, config=None, silu=False, out_dtype=None, bias=None):
        if bias is not None:
            biased.append(w.n)
        return real(x, w, config, silu, out_dtype, bias)

    monkeypatch.setattr(tk, "qmatmul", spy)
    return biased


def test_backend_linears_add_their_biases_in_the_gemv(monkeypatch):
    """The backend's joint q/k/v product (one GEMV over the joined weight) with biases on
    some of the three, and a single linear with one: x @ W^T + b of each, the GEMV launched
    with the joint bias (zeros where a linear has none); MLXRUN_BIAS_IN_GEMV=0 the same
    values with the adds after."""
    from mlxrun.backends import torch_weights
    from mlxrun.backends.torch_backend import TorchBackend

    biased = _spy(monkeypatch)
    be = TorchBackend(DEV, "float32")
    be.triton_kernels, be.cuda_graphs = True, False
    gen = torch.Generator().manual_seed(2)
    k, sizes = 256, (16, 8, 8)
    ws = [be.quantize(torch.randn(n, k, generator=gen), "affine", 4, 32) for n in sizes]
    bs = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
    bs[1] = None
    x = torch.randn(1, 1, k, generator=gen).to(DEV)
    dense = [tk.dequantize_torch(w.kernel).double().cpu() for w in ws]
    want = [
        x.cpu().double() @ d.T + (0 if b is None else b.cpu().double()) for d, b in zip(dense, bs)
    ]
    for in_gemv in (True, False):
        monkeypatch.setattr(torch_weights, "_BIAS_IN_GEMV", in_gemv)
        got = be.linears(x, ws, bs)
        assert [tuple(g.shape) for g in got] == [(1, 1, n) for n in sizes]
        for g, wnt in zip(got, want):
            assert rel_err(g.cpu(), wnt) < 1e-5
        assert rel_err(be.linear(x, ws[0], bs[0]).cpu(), want[0]) < 1e-5
    assert biased == [32, 16]  # the joint weight and the single one, in the GEMV


@LONG_ON_CPU
def test_joint_bias_takes_the_gemv_epilogue(tiny_dir, monkeypatch):
    """Qwen2's q/k/v biases on the CUDA code path (int4; on the CPU the kernels
    interpreted): decode logits equal to the dequantizing path's (the biases added by the
    joint q/k/v GEMV's epilogue, not after), with MLXRUN_BIAS_IN_GEMV=0 (a torch add after)
    equal too, and the GEMV launched with the joint bias."""
    from mlxrun.backends import torch_weights
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.loader import open_checkpoint
    from mlxrun.quant.formats import resolve

    from .conftest import rel_err

    d, _ = tiny_dir("qwen2_bias")
    ckpt = open_checkpoint(str(d))
    spec = resolve("int4", group_size=32)
    ids = np.random.default_rng(1).integers(3, 96, size=(1, 5))
    biased = _spy(monkeypatch)
    out = []
    for kernels, in_gemv in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(torch_weights, "_BIAS_IN_GEMV", in_gemv)
        be = TorchBackend(DEV, "float32")
        be.triton_kernels, be.cuda_graphs = kernels, False
        model = build_model(ckpt.config, ckpt.tensors, be, spec, progress=False)[0]
        cache = model.make_cache(1, 8)
        model(be.ids(ids[:, :4]), cache)  # prefill: the GEMM, bias added after
        out.append(be.to_numpy(model(be.ids(ids[:, 4:]), cache)))  # decode: the GEMV
    c = ckpt.config
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    assert qkv in biased  # the joint q/k/v weight took its joint bias
    # the GPU's float32 dot runs in TF32 (~3e-4); the interpreter computes it in float32
    assert rel_err(out[1], out[0]) < (2e-3 if DEV == "cuda" else 1e-4)
    assert rel_err(out[2], out[1]) < 1e-5


def test_joint_bias_fills_a_missing_bias_with_zeros():
    """Linears run as one where only some have a bias: zeros for the others, made once."""
    from mlxrun.backends.torch_backend import TorchBackend

    be = TorchBackend("cpu", "float32")
    b = torch.arange(3.0)
    jb = be._joint_bias((None, b), (2, 3), torch.float32)
    assert torch.equal(jb, torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0]))
    assert be._joint_bias((None, b), (2, 3), torch.float32) is jb
    assert torch.equal(
        be._joint_bias((b, None), (3, 1), torch.float32), torch.tensor([0.0, 1, 2, 0])
    )
    assert be._joint_bias((None, None), (2, 3), torch.float32) is None
