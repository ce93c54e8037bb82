"""Quantized KV caches (--kv-quant int8|fp8, mlxrun/kvquant.py): the quantize / dequantize
round trip against its error bound, the CUDA kernels' quantized cache write and decode
attention under TRITON_INTERPRET against the torch reference, logits with a quantized cache
against the full cache (torch-cpu, MLX, the CUDA code path), the bytes the planner counts
against the bytes the caches allocate, and the CLI's refusals.

Bounds: a head vector of D values with max |x| = a is stored with an error of at most a/254
an element (int8: half a step of a/127) or 2^-4 of the value (E4M3, 3 mantissa bits; below
E4M3's smallest normal, half its subnormal step x the scale). Through the two layers of the
tiny random models those errors move the logits by about three times their relative size:
int8 ~0.5% -> < 5% allowed, fp8 ~3% -> < 20% allowed; a cache that ignored the format would
give 0 and fail the lower bound.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels

import mlxrun  # noqa: E402
from mlxrun.kvquant import (  # noqa: E402
    kv_bytes_per_value,
    torch_dequantize,
    torch_quantize,
)

from .conftest import rel_err, write_random  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
KINDS = ["int8", "fp8"]
BOUND = {"int8": 0.05, "fp8": 0.2}  # relative logit error vs the full cache (see above)
# head_dim 64: MLX quantizes in groups of 32 or 64 along the head
CFG = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, vocab_size=64, max_position_embeddings=256,
           rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip


def _ops():
    """cuda_attention (rope_qkv, decode_attention) decorated under the interpreter, and
    cuda_ops, which the CUDA code path also runs (another test module may have imported
    them first without)."""
    import triton  # noqa: F401

    from mlxrun.backends import cuda_attention, cuda_ops, cuda_rope

    if not HAS_CUDA and type(cuda_ops._add_rms_norm_kernel).__name__ != "InterpretedFunction":
        importlib.reload(cuda_ops)
    if not HAS_CUDA and type(cuda_attention._rope_qkv_kernel).__name__ != "InterpretedFunction":
        importlib.reload(cuda_rope)  # first: the attention kernel calls its rope pieces
        cuda_attention = importlib.reload(cuda_attention)
    return cuda_attention


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d, _ = write_random(tmp_path_factory.mktemp("kvq") / "m", "llama", CFG)
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip_within_bound(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 17, 64, generator=g) * torch.rand(3, 2, 17, 1, generator=g) * 5
    x[0, 0, 0] = 0  # an all-zero vector: scale 0, codes 0, no NaN
    codes, s = torch_quantize(x, kind)
    assert codes.dtype == (torch.int8 if kind == "int8" else torch.uint8)
    assert s.shape == x.shape[:-1] and s.dtype == torch.float32
    y = torch_dequantize(codes, s, kind, torch.float32)
    err = (y - x).abs()
    a = x.abs().amax(-1, keepdim=True)
    if kind == "int8":
        assert (err <= a / 254 * (1 + 1e-5)).all()
        assert codes.abs().max() == 127  # the largest value uses the whole range
    else:
        sub = s[..., None] * 2.0**-10  # half E4M3's subnormal step, scaled
        assert (err <= x.abs() * 2.0**-4 + sub + 1e-7).all()
    assert torch.equal(y[0, 0, 0], torch.zeros(64)) and s[0, 0, 0] == 0
    assert err.max() > 0  # it did round


def _rope_ref(x, pos, inv):
    from mlxrun.backends.torch_backend import TorchBackend

    return TorchBackend("cpu", "float32").rope(x, pos, inv)


@pytest.mark.parametrize("kind", KINDS)
def test_rope_qkv_writes_quantized_cache(kind):
    """The fused rope + cache write stores what kvquant.torch_quantize gives for the rotated
    k and the v, at the pass's slots (a ring's wrap too), and nothing else."""
    from mlxrun.backends.torch_kv import QuantKV
    from mlxrun.kvquant import torch_code_dtype

    ops = _ops()
    g = torch.Generator().manual_seed(1)
    B, NH, NKV, T, D, S = 2, 4, 2, 5, 32, 12
    q, k, v = (torch.randn(B, h, T, D, generator=g).to(DEV) for h in (NH, NKV, NKV))
    pos = torch.tensor([[0, 1, 2, 3, 4], [-2, -1, 0, 1, 2]], device=DEV)
    inv = torch.from_numpy(1.0 / 10000 ** (np.arange(0, D, 2) / D)).float().to(DEV)
    dt = torch_code_dtype(kind)
    codes = [torch.full((B, NKV, S, D), 7, dtype=dt, device=DEV) for _ in range(2)]
    scales = [torch.full((B, NKV, S), -1.0, device=DEV) for _ in range(2)]
    kq, vq = (QuantKV(c, s, kind) for c, s in zip(codes, scales))
    ring = [9, 10, 11, 0, 1]  # written from slot 9, wrapping (a sliding-window ring)
    got = ops.rope_qkv(q, k, v, pos, inv, kq, vq, torch.tensor([9], device=DEV))
    assert rel_err(got.cpu(), _rope_ref(q.cpu(), pos.cpu(), inv.cpu())) < 1e-6
    for c, s, x in zip(codes, scales, (_rope_ref(k.cpu(), pos.cpu(), inv.cpu()), v.cpu())):
        wc, ws = torch_quantize(x, kind)
        assert torch.allclose(s[:, :, ring].cpu(), ws, rtol=1e-6)
        have = torch_dequantize(c[:, :, ring].cpu(), s[:, :, ring].cpu(), kind, torch.float32)
        want = torch_dequantize(wc, ws, kind, torch.float32)
        if kind == "int8":
            assert torch.equal(c[:, :, ring].cpu(), wc)
        elif HAS_CUDA:  # cvt.rn to E4M3, as torch converts
            assert torch.equal(c[:, :, ring].cpu(), wc)
        else:
            # The interpreter's float32 -> E4M3 conversion truncates ties and subnormals, and
            # drops the carry of a value that rounds up into the next binade (127.9 -> 64,
            # not 128): allow one step, or half of a power of two that torch rounded up to.
            step = want.abs() * 2.0**-3 + ws[..., None] * 2.0**-9
            carry = (wc & 7 == 0) & ((have - want / 2).abs() <= 1e-6 * want.abs())
            assert (((have - want).abs() <= step) | carry).all()
            assert (c[:, :, ring].cpu() == wc).float().mean() > 0.9
        untouched = [i for i in range(S) if i not in ring]
        assert (c[:, :, untouched] == 7).all() and (s[:, :, untouched] == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_decode_attention_reads_quantized_cache(kind):
    """decode_attention over codes and scales = SDPA over the dequantized cache, with a
    per-sequence mask, several splits, and slot-cache rows."""
    import torch.nn.functional as F

    from mlxrun.backends.torch_kv import QuantKV

    ops = _ops()
    g = torch.Generator().manual_seed(2)
    B, NH, NKV, S, D = 2, 8, 2, 200, 32
    q = torch.randn(B, NH, 1, D, generator=g).to(DEV)
    k, v = (torch.randn(3, NKV, S, D, generator=g) for _ in range(2))
    (kc, ks), (vc, vs) = torch_quantize(k, kind), torch_quantize(v, kind)
    kd = torch_dequantize(kc, ks, kind, torch.float32)
    vd = torch_dequantize(vc, vs, kind, torch.float32)
    kq, vq = QuantKV(kc.to(DEV), ks.to(DEV), kind), QuantKV(vc.to(DEV), vs.to(DEV), kind)
    slots = torch.arange(S)
    mask = ((slots[None] >= torch.tensor([0, 9])[:, None]) & (slots[None] < 150))[:, None, None]
    rows = torch.tensor([2, 0])
    want = F.scaled_dot_product_attention(
        q.cpu(), kd[rows], vd[rows], attn_mask=mask, scale=0.2, enable_gqa=True
    )
    got = ops.decode_attention(q, kq, vq, 0.2, mask.to(DEV), rows=rows.to(DEV))
    assert rel_err(got.cpu(), want) < 1e-5
    # blocks of 16 keys, the combine over the splits two at a time
    launch = ops.AttnLaunch(block_quant=16, combine_chunk=2)
    got = ops.decode_attention(q, kq, vq, 0.2, mask.to(DEV), rows=rows.to(DEV), launch=launch)
    assert rel_err(got.cpu(), want) < 1e-5
    plain = F.scaled_dot_product_attention(
        q.cpu(), k[rows], v[rows], attn_mask=mask, scale=0.2, enable_gqa=True
    )
    assert rel_err(got.cpu(), plain) > 1e-4  # the codes were read, not some full copy


@pytest.mark.parametrize("kind,f16", [("int8", None), ("fp8", True), ("fp8", False)])
def test_decode_attention_quantized_blocks_of_one_split(kind, f16, monkeypatch):
    """One split over five blocks of keys (the pipelined loop carries its softmax across
    them), a mask that hides a whole block inside the visible range, starts mid-block and
    ends before the last block: SDPA over the dequantized cache. fp8 with float16 dots (q
    scaled into float16's range, the weights by the block's largest scale) and without."""
    import torch.nn.functional as F

    from mlxrun.backends.torch_kv import QuantKV

    ops = _ops()
    monkeypatch.setattr(ops, "_num_sms", lambda device: 1)  # one split on any device
    g = torch.Generator().manual_seed(3)
    B, NH, NKV, S, D = 2, 8, 2, 300, 32
    # q as a bf16 model holds it (float16 dots take those values exactly)
    q = torch.randn(B, NH, 1, D, generator=g).bfloat16().float().to(DEV)
    k, v = (torch.randn(B, NKV, S, D, generator=g) * 3 for _ in range(2))
    (kc, ks), (vc, vs) = torch_quantize(k, kind), torch_quantize(v, kind)
    kd = torch_dequantize(kc, ks, kind, torch.float32)
    vd = torch_dequantize(vc, vs, kind, torch.float32)
    kq, vq = QuantKV(kc.to(DEV), ks.to(DEV), kind), QuantKV(vc.to(DEV), vs.to(DEV), kind)
    slots = torch.arange(S)
    vis0 = (slots < 250) & ((slots < 64) | (slots >= 128))
    vis1 = (slots >= 70) & (slots < 200)
    mask = torch.stack([vis0, vis1])[:, None, None]
    want = F.scaled_dot_product_attention(q.cpu(), kd, vd, attn_mask=mask, scale=0.2,
                                          enable_gqa=True)  # fmt: skip
    launch = ops.AttnLaunch(per_sm_quant=1, fp8_f16=f16, block_quant=64)
    got = ops.decode_attention(q, kq, vq, 0.2, mask.to(DEV), launch=launch)
    assert rel_err(got.cpu(), want) < 1e-5
    hole = F.scaled_dot_product_attention(q.cpu(), kd, vd, attn_mask=mask | (slots < 250),
                                          scale=0.2, enable_gqa=True)  # fmt: skip
    assert rel_err(got.cpu(), hole) > 1e-3  # the hidden block was left out


def _logits(m, ids, kind):
    m.kv_quant = kind
    try:
        return m.logits(ids)
    finally:
        m.kv_quant = None


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_logits_with_quantized_cache_near_full_cache(tiny, backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    m = mlxrun.load(str(tiny), backend=backend, dtype="float32", progress=False)
    ids = np.random.default_rng(0).integers(3, 64, size=40)
    full = m.logits(ids)
    for kind in KINDS:
        err = rel_err(_logits(m, ids, kind), full)
        assert 1e-4 < err < BOUND[kind], (kind, err)
    # generation through the quantized cache (prefill, then decode steps writing one token
    # each) picks what one pass over the whole sequence through a fresh cache picks
    from mlxrun.generate import generate_step
    from mlxrun.sampling import SamplingParams

    m2 = mlxrun.load(str(tiny), backend=backend, dtype="float32", progress=False, kv_quant="int8")
    assert m2.transformer.kv_quant == "int8"
    toks = [int(t[0]) for t in generate_step(m2.transformer, [ids.tolist()], SamplingParams(), 3)]
    ext = list(ids)
    for _ in range(3):
        ext.append(int(_logits(m, np.array(ext), "int8")[-1].argmax()))
    assert toks == ext[len(ids) :]


@pytest.mark.parametrize(
    "kind", ["int8", pytest.param("fp8", marks=[] if HAS_CUDA else [pytest.mark.long])]
)
def test_cuda_code_path_with_quantized_cache(tiny, kind):
    """The CUDA code path (rope_qkv writing codes, decode_attention reading them) gives the
    torch path's logits through a prompt and decode steps. fp8 under the interpreter: its
    E4M3 conversion halves values that round up into the next binade (see above), so only
    the full-cache bound holds there (-m long)."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.loader import open_checkpoint

    _ops()
    ckpt = open_checkpoint(str(tiny))
    be = TorchBackend(DEV, "float32")
    be.triton_kernels, be.cuda_graphs = True, False
    fast = build_model(ckpt.config, ckpt.tensors, be, None, progress=False)[0]
    plain = build_model(ckpt.config, ckpt.tensors, TorchBackend("cpu", "float32"), None,
                        progress=False)[0]  # fmt: skip
    ids = np.random.default_rng(1).integers(3, 64, size=(1, 8))
    outs = []
    for m in (fast, plain):
        m.kv_quant = kind
        cache = m.make_cache(1, 12)
        steps = [m.be.to_numpy(m(m.be.ids(ids), cache))[0, -1]]
        for t in (5, 9):  # two decode steps of one token
            steps.append(m.be.to_numpy(m(m.be.ids(np.array([[t]])), cache))[0, -1])
        outs.append(np.stack(steps))
    tol = 1e-4 if kind == "int8" else (1e-2 if HAS_CUDA else BOUND[kind])
    assert rel_err(outs[0], outs[1]) < tol


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_kv_bytes_count_what_the_cache_allocates(tiny, backend):
    from mlxrun import bench_models as bench

    if backend == "mlx":
        mx = pytest.importorskip("mlx.core")
    m = mlxrun.load(str(tiny), backend=backend, dtype="float32", progress=False)
    t = m.transformer
    full = t.kv_bytes(2, 16)
    for kind in KINDS:
        t.kv_quant = kind
        cache = t.make_cache(2, 16)
        if backend == "cpu":
            held = sum(b.nbytes for b in cache.kv.buffers())
        else:  # MLX allocates on the first write
            t(m.backend.ids(np.zeros((2, 3), np.int64)), cache)
            mx.eval(cache.keys, cache.values)
            held = sum(a.nbytes for kv in cache.keys + cache.values for a in kv)
        assert t.kv_bytes(2, 16) == held
        assert bench.kv_ratio(t) * full == pytest.approx(held)  # bench's KV bytes a step
        assert t.kv_bytes(2, 16) < full / 3.4  # float32 -> ~1.06 bytes a value
    t.kv_quant = None
    # bf16 on CUDA: half the bytes, scales included (llama3.1-8b shape: 128 values a head)
    assert kv_bytes_per_value("int8", 128, 2, "torch") == 1 + 4 / 128
    assert kv_bytes_per_value("int8", 128, 2, "mlx") == 1 + 4 / 64  # bf16 scale and bias / 64


def test_plan_counts_quantized_kv():
    from mlxrun.planning import plan

    base = plan("shape:llama3.1-8b", context=8192, backend="cpu", dtype="bfloat16")
    q = plan("shape:llama3.1-8b", context=8192, backend="cpu", dtype="bfloat16", kv_quant="int8")
    assert base.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert q.kv_bytes_per_token == 32 * 2 * 8 * (128 + 4)
    assert q.kv_bytes == q.kv_bytes_per_token * 8192


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "--kv-quant", "int4", "-p", "hi"], "--kv-quant 'int4' is not a KV-cache"),
        (["plan", "--kv-quant", "fp16"], "use int8, fp8 or none"),
        (["eval", "--kv-quant", "int8,q4"], "--kv-quant 'q4'"),
    ],
)
def test_cli_refuses_bad_kv_quant(argv, words, capsys):
    from mlxrun.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.cuda if HAS_CUDA else pytest.mark.long  # ~20 s interpreted on 2 cores
def test_engine_fixed_steps_read_quantized_slots(tiny):
    """The serving engine's fixed-shape steps (rope_qkv and decode_attention over slot rows,
    interpreted here) on an int8 slot cache: two requests of different lengths in 3 slots
    get the greedy tokens generate_step gives each alone through an int8 StaticCache."""
    from mlxrun.engine import Engine, Request
    from mlxrun.generate import generate_step
    from mlxrun.sampling import SamplingParams

    from .test_engine import load_fixed, run_all

    fixed = load_fixed(tiny)
    plain = mlxrun.load(str(tiny), backend="cpu", progress=False, kv_quant="int8")
    fixed.transformer.kv_quant = "int8"
    rng = np.random.default_rng(3)
    ps = [[int(t) for t in rng.integers(3, 64, n)] for n in (7, 4)]
    eng = Engine(fixed.transformer, fixed.tokenizer, max_batch=3, context=16)
    try:
        assert eng.cache.kv_quant == "int8" and eng.graphs is not None
        outs = run_all(eng, [Request(p, max_tokens=3) for p in ps])
    finally:
        eng.close()
    for p, out in zip(ps, outs):
        want = [int(t[0]) for t in generate_step(plain.transformer, [p], SamplingParams(), 3)]
        assert [e.token for e in out] == want


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_engine_slot_cache_quantized(tiny, backend):
    """The serving engine's eager steps on a quantized slot cache (rows of their own
    lengths, a prompt prefix reused from a running row): each request gets the greedy
    tokens generate_step gives it alone through the same format's cache."""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    from mlxrun.engine import Engine, Request
    from mlxrun.generate import generate_step
    from mlxrun.sampling import SamplingParams

    from .test_engine import run_all

    m = mlxrun.load(str(tiny), backend=backend, progress=False, kv_quant="int8")
    rng = np.random.default_rng(4)
    base = [int(t) for t in rng.integers(3, 64, 6)]
    ps = [base + [5, 9], [int(t) for t in rng.integers(3, 64, 3)], base + [7]]
    eng = Engine(m.transformer, m.tokenizer, max_batch=2, context=16, prefill_chunk=4)
    try:
        assert eng.cache.kv_quant == "int8"
        outs = run_all(eng, [Request(p, max_tokens=3) for p in ps])
    finally:
        eng.close()
    for p, out in zip(ps, outs):
        want = [int(t[0]) for t in generate_step(m.transformer, [p], SamplingParams(), 3)]
        assert [e.token for e in out] == want


@pytest.mark.long  # ~12 s on 2 loaded cores; bench.kv_ratio is checked above in CI
def test_bench_rows_count_quantized_kv_bytes(monkeypatch):
    """bench --kv-quant: a row per format, the KV bytes a step reads at the stored size
    (shape:tiny, float32, head_dim 16: 1 + 4/16 bytes a value against 4)."""
    from mlxrun import bench, bench_timing

    monkeypatch.setitem(bench_timing.COPY_BYTES, "cpu", 32 << 20)  # a smaller copy: fast
    r = bench.run_bench("shape:tiny", ["cpu"], ["none"], prompt_tokens=16, gen_tokens=3,
                        reps=1, progress=False, kv_quants=[None, "int8"])  # fmt: skip
    plain, q = r.rows
    assert (plain.kv_quant, q.kv_quant) == ("none", "int8")
    assert q.kv_bytes_per_step == round(plain.kv_bytes_per_step * 1.25 / 4)
    assert q.bytes_per_token == q.weight_bytes_per_step + q.kv_bytes_per_step
    assert "none kv-int8" in bench.format_report(r)
