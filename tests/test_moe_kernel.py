"""The Triton MoE kernels (backends/cuda_moe.py, cuda_moe_kernels.py) against the plain
torch expert path (backends/torch_moe.py), for dense experts and every packed format, with
and without biases, SiLU and gpt-oss's clamped SwiGLU. Under TRITON_INTERPRET=1 at tiny sizes without a
GPU."""

import importlib
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
pytest.importorskip("triton", reason="triton is not installed")

import mlxrun.backends.cuda_moe as cm  # noqa: E402
import mlxrun.backends.cuda_moe_kernels as ck  # noqa: E402
import mlxrun.backends.cuda_moe_pack as cmp  # noqa: E402
import mlxrun.quant.triton_gemm as tgm  # noqa: E402
import mlxrun.quant.triton_gemv as tk  # noqa: E402
from mlxrun.backends import torch_moe  # noqa: E402
from mlxrun.backends.base import QuantizedWeight  # noqa: E402
from mlxrun.moe import Experts, MoEOptions  # noqa: E402
from mlxrun.quant.formats import QuantSpec  # noqa: E402
from mlxrun.quant.reference import quantize  # noqa: E402

# imported earlier without the interpreter: decorate again, callees first (the packed
# kernels call the dense GEMV's k-step; cuda_moe takes the kernels by name)
if not HAS_CUDA and type(tk._gemv_step).__name__ != "InterpretedFunction":
    importlib.reload(importlib.import_module("mlxrun.quant.triton_decode"))
    importlib.reload(importlib.import_module("mlxrun.quant.triton_gemv_step"))
    tk = importlib.reload(tk)
    tgm = importlib.reload(tgm)
    ck = importlib.reload(ck)
    importlib.reload(importlib.import_module("mlxrun.backends.cuda_moe_down"))
    cm = importlib.reload(cm)
elif not HAS_CUDA and type(ck._moe_qgemv).__name__ != "InterpretedFunction":
    ck = importlib.reload(ck)
    importlib.reload(importlib.import_module("mlxrun.backends.cuda_moe_down"))
    cm = importlib.reload(cm)

DEV = "cuda" if HAS_CUDA else "cpu"
# The interpreter runs each program in turn (~0.3 s each on 2 cores): few slots and rows.
# Dense fp32 H = 64: two k-steps of 32 of the per-slot kernel.
E, H, I, T, K = 4, 64, 32, 2, 2
FORMATS = [None, ("affine", 4, 32), ("affine", 8, 32), ("mxfp4", 4, 32), ("nvfp4", 4, 16),
           ("mxfp8", 8, 32)]  # fmt: skip


def _stack(w: np.ndarray, fmt):
    if fmt is None:
        return torch.from_numpy(w).to(DEV)
    parts = quantize(w, QuantSpec(*fmt))
    t = {k: torch.from_numpy(v).to(DEV) for k, v in parts.items()}
    return QuantizedWeight(t["weight"], t["scales"], t.get("biases"), *fmt)


def _experts(rng, fmt, shape=(E, I, H), biased: bool = True) -> Experts:
    """Random experts (`shape`: experts, rows, inputs) stored in `fmt`, with gpt-oss's gate,
    up and down biases where `biased`."""
    n_exp, rows, cols = shape
    w = {n: (0.2 * rng.standard_normal(s)).astype(np.float32)
         for n, s in (("gate", (n_exp, rows, cols)), ("up", (n_exp, rows, cols)),
                      ("down", (n_exp, cols, rows)))}  # fmt: skip
    e = Experts(None, *(_stack(w[n], fmt) for n in ("gate", "up", "down")))
    if biased:
        for n, width in (("gate_bias", rows), ("up_bias", rows), ("down_bias", cols)):
            bias = 0.3 * rng.standard_normal((n_exp, width))
            setattr(e, n, torch.from_numpy(bias).float().to(DEV))
    return e


# ~5-20 s each under the interpreter on 2 cores: one by default (packed codes, E8M0 scales,
# biases, the clamped gate), the other 11 with -m long there (all 12 passed on the CPU)
LONG_ON_CPU = pytest.mark.long if not HAS_CUDA else pytest.mark.cuda
FAST = {(("mxfp4", 4, 32), True)}
CASES = [
    pytest.param(f, g, marks=() if (f, g) in FAST else LONG_ON_CPU,
                 id=("dense" if f is None else "".join(map(str, f))) + ("-oss" if g else "-silu"))
    for f in FORMATS
    for g in (False, True)
]  # fmt: skip


def _parts(w):
    if isinstance(w, QuantizedWeight):
        return [a for a in (w.weight, w.scales, w.biases) if a is not None]
    return [w]


@pytest.mark.parametrize("fmt,gpt_oss", CASES)
def test_kernel_matches_torch_experts(fmt, gpt_oss):
    rng = np.random.default_rng(0)
    o = MoEOptions(E, K, I, "topk_softmax" if gpt_oss else "softmax_topk", norm_topk=True,
                   act="swiglu_clamped" if gpt_oss else "silu", bias=gpt_oss,
                   swiglu_limit=0.6)  # fmt: skip
    e = _experts(rng, fmt, biased=gpt_oss)
    x = torch.from_numpy(rng.standard_normal((T, H))).float().to(DEV)
    logits = torch.from_numpy(rng.standard_normal((T, E))).float().to(DEV)
    weights, ids = torch_moe.route(logits, o)
    want = (torch_moe._gathered(x, ids, e, o) * weights.unsqueeze(-1)).sum(1)
    stored = sum(int(a.nbytes) for w in (e.gate, e.up, e.down) for a in _parts(w))
    got = cm.moe_experts(x, ids, weights, e, o)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, err
    if fmt is not None:  # the repack replaced the stored experts: same bytes, same values
        assert e.gate.weight is None and isinstance(e.up.kernel, cmp.ExpertPart)
        assert sum(w.kernel.nbytes for w in (e.gate, e.up, e.down)) == stored
        again = (torch_moe._gathered(x, ids, e, o) * weights.unsqueeze(-1)).sum(1)
        assert float((again - want).norm() / want.norm()) < 1e-6
    if gpt_oss:  # the clamp is hit: without it the result differs
        o2 = MoEOptions(E, K, I, o.routing, act="swiglu_clamped", bias=True, swiglu_limit=50.0)
        assert float((cm.moe_experts(x, ids, weights, e, o2) - want).norm() / want.norm()) > 1e-3


# The packed kernel's loop at several k-steps: 3 one-warp steps of 128 words (the
# prefetched pair, then the odd last one; 4-bit K = 3072 leaves the last step part-masked)
# or whole steps (K = 2048: no masks), one projection at a time, with and without prefetch.
KCASES = [
    pytest.param(f, k, pf, marks=() if (f, k, pf) == (("mxfp4", 4, 32), 3072, True)
                 else LONG_ON_CPU, id=f"{''.join(map(str, f))}-k{k}-{'pf' if pf else 'nopf'}")
    for f in FORMATS[1:]
    for k in (2048, 3072)
    for pf in (True, False)
]  # fmt: skip


@pytest.mark.parametrize("fmt,k,prefetch", KCASES)
def test_packed_kernel_ksteps(fmt, k, prefetch):
    rng = np.random.default_rng(1)
    E2, n, slots = 3, 8, 2
    w = [(0.1 * rng.standard_normal((E2, n, k))).astype(np.float32) for _ in range(2)]
    gate, up = (_stack(a, fmt) for a in w)
    o = MoEOptions(E2, 1, n, act="silu")
    x = torch.from_numpy(rng.standard_normal((slots, k))).float().to(DEV)
    ids = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    rw = torch.tensor([0.25, -2.0], device=DEV)
    dense = [torch_moe._take(q, ids.long(), torch.float32) for q in (gate, up)]  # (S, n, k)
    g, u = (torch.einsum("snk,sk->sn", d, x) for d in dense)
    cfg = cm.QConfig(warps=1, block_n=8, prefetch=prefetch)
    packed = cmp._prepare(Experts(None, gate, up, gate))
    assert packed is not None
    got = torch.empty((slots, n), device=DEV)
    cm._qlaunch(x, ids, got, rw, packed[0], None, None, 1, o, False, cfg)
    want = torch.nn.functional.silu(g) * u
    assert float((got - want).norm() / want.norm()) < 1e-5
    # one projection, 16 rows (two halves) and the routing weight applied
    one = cmp.PackedExperts(packed[0].w, 2 * n, k, False)
    got = torch.empty((slots, 2 * n), device=DEV)
    cm._qlaunch(x, ids, got, rw, one, None, None, 1, o, True, cm.QConfig(1, 16, prefetch))
    want = torch.cat([g, u], dim=1) * rw[:, None]
    assert float((got - want).norm() / want.norm()) < 1e-5


# Launches MLXRUN_MOE_QCFG can ask for (cuda_moe.parse_qcfg): 2 and 4 warps a program (a
# k-step of 256 / 512 words: K = 2048 4-bit is one step, or half of one, masked), 8 or 16
# rows a program, with and without prefetch, for gate/up (gated) and down (routing weight).
QCFGS = [
    pytest.param(f, q, marks=() if (f, q) == (("affine", 4, 32), "gu:w2n8,dn:w4n16p0")
                 else LONG_ON_CPU, id=f"{''.join(map(str, f))}-{q.replace(':', '').replace(',', '-')}")
    for f in (("affine", 4, 32), ("mxfp4", 4, 32), ("mxfp8", 8, 32))
    for q in ("gu:w2n8,dn:w4n16p0", "gu:w4n16p0,dn:w2n8", "gu:w1n16p1,dn:w1n8")
]  # fmt: skip


@pytest.mark.parametrize("fmt,qcfg", QCFGS)
def test_packed_kernel_launch_overrides(fmt, qcfg, monkeypatch):
    rng = np.random.default_rng(3)
    E2, n, k, slots = 3, 8, 2048, 2
    w = [(0.1 * rng.standard_normal((E2, n, k))).astype(np.float32) for _ in range(2)]
    gate, up = (_stack(a, fmt) for a in w)
    o = MoEOptions(E2, 1, n, act="silu")
    x = torch.from_numpy(rng.standard_normal((slots, k))).float().to(DEV)
    ids = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    rw = torch.tensor([0.5, -1.5], device=DEV)
    dense = [torch_moe._take(q, ids.long(), torch.float32) for q in (gate, up)]
    g, u = (torch.einsum("snk,sk->sn", d, x) for d in dense)
    packed = cmp._prepare(Experts(None, gate, up, gate))
    one = cmp.PackedExperts(packed[0].w, 2 * n, k, False)  # down-like: 16 rows, no gate
    monkeypatch.setattr(cm, "QCFG", cm.parse_qcfg(qcfg))
    want_cfg = {p: dict(re.findall(r"([wnp])(\d+)", q)) for p, q in
                (part.split(":") for part in qcfg.split(","))}  # fmt: skip
    for p, gated in ((packed[0], "gu"), (one, "dn")):
        cfg = cm.choose_qconfig(p)
        assert (str(cfg.warps), str(cfg.block_n)) == (want_cfg[gated]["w"], want_cfg[gated]["n"])
        if "p" in want_cfg[gated]:
            assert cfg.prefetch == (want_cfg[gated]["p"] == "1")
    got = torch.empty((slots, n), device=DEV)
    cm._qlaunch(x, ids, got, rw, packed[0], None, None, 1, o, False)
    want = torch.nn.functional.silu(g) * u
    assert float((got - want).norm() / want.norm()) < 1e-5
    got = torch.empty((slots, 2 * n), device=DEV)
    cm._qlaunch(x, ids, got, rw, one, None, None, 1, o, True)
    want = torch.cat([g, u], dim=1) * rw[:, None]
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_qcfg_refuses_what_it_cannot_read():
    assert cm.parse_qcfg("") == {}
    assert cm.parse_qcfg("dn:p0") == {"dn": {"prefetch": False}}
    for bad in ("gu:w3", "up:w2", "gu:n32", "gu w2"):
        with pytest.raises(cm.MlxrunError, match="MLXRUN_MOE_QCFG"):
            cm.parse_qcfg(bad)


@pytest.mark.parametrize("routing,norm,E2,k", [("softmax_topk", True, 128, 8),
                                               ("softmax_topk", False, 8, 2),
                                               ("topk_softmax", False, 32, 4),
                                               ("topk_softmax", False, 12, 3)])  # fmt: skip
@pytest.mark.parametrize("packed", [False, True], ids=["rounds", "packed"])
def test_route_kernel_matches_torch(routing, norm, E2, k, packed, monkeypatch):
    """Both top-k forms (_topk_store's PACKED): ties, negative logits and probabilities."""
    monkeypatch.setattr(cm, "TOPK_PACKED", packed)
    rng = np.random.default_rng(2)
    o = MoEOptions(E2, k, 8, routing, norm_topk=norm)
    logits = torch.from_numpy(rng.standard_normal((5, E2))).float().to(DEV)
    logits[0, 1] = logits[0, 3] = logits[0].max() + 1  # a tie on top: the lower index first
    logits[1] = -logits[1].abs() - 1  # every logit negative
    w_want, ids_want = torch_moe.route(logits, o)
    ids_want[0, :2] = torch.tensor([1, 3])  # torch.topk orders ties as it likes
    w, ids = cm.route(logits, o)
    assert ids.dtype == torch.int32 and ids.tolist() == ids_want.tolist()
    assert torch.allclose(w, w_want, rtol=1e-6, atol=1e-7)
    if norm:
        assert torch.allclose(w.sum(-1), torch.ones(5, device=DEV))


# The router's linear and the routing in one launch (cuda_moe.route_linear) against the
# linear as the model runs it (cuda_ops.dense_gemv, then + bias) and route: the same ids and
# weights, bit for bit. Floats without a bias (qwen3's router: 128 experts, K 2048; a
# partial last row block and K past one block), integers with one (gpt-oss's: every sum
# exact, so the interpreter's rounding cannot differ from torch's bias add; ties everywhere,
# to the lower index).
ROUTER = [
    pytest.param("softmax_topk", True, 128, 8, 2048, False, marks=LONG_ON_CPU, id="qwen3"),
    pytest.param("softmax_topk", False, 12, 3, 2304, False, id="e12-k2304"),
    pytest.param("topk_softmax", False, 32, 4, 640, True, id="oss-bias-int"),
]


def _cuda_ops():
    from mlxrun.backends import cuda_ops  # noqa: PLC0415

    if not HAS_CUDA and type(cuda_ops._dense_gemv_kernel).__name__ != "InterpretedFunction":
        cuda_ops = importlib.reload(cuda_ops)
    return cuda_ops


@pytest.mark.parametrize("routing,norm,E2,k,K2,bias", ROUTER)
def test_router_kernel_matches_linear_and_route(routing, norm, E2, k, K2, bias, monkeypatch):
    cuda_ops = _cuda_ops()
    rng = np.random.default_rng(7)
    o = MoEOptions(E2, k, 8, routing, norm_topk=norm)
    T2 = 2
    if bias:  # small integers: every product, sum and the bias add exact in bf16
        x = torch.from_numpy(rng.integers(-1, 2, (T2, K2))).to(torch.bfloat16)
        w = torch.from_numpy(rng.integers(-1, 2, (E2, K2)) * (rng.random((E2, 1)) < 0.05))
        w, b = w.to(torch.bfloat16), torch.from_numpy(rng.integers(-4, 5, E2)).to(torch.bfloat16)
    else:
        x = torch.from_numpy(rng.standard_normal((T2, K2))).to(torch.bfloat16)
        w = torch.from_numpy(0.05 * rng.standard_normal((E2, K2))).to(torch.bfloat16)
        b = None
    x, w = x.to(DEV), w.to(DEV)
    b = None if b is None else b.to(DEV)
    logits = cuda_ops.dense_gemv(x, w)
    if b is not None:
        logits = logits + b
    w_want, ids_want = cm.route(logits, o)
    for packed in (False, True):  # the second launch finds the tickets reset by the first
        monkeypatch.setattr(cm, "TOPK_PACKED", packed)
        w_got, ids_got = cm.route_linear(x, w, b, o)
        assert ids_got.tolist() == ids_want.tolist()
        assert torch.equal(w_got, w_want)
    if bias:  # exact sums: any tile gives the same (MLXRUN_MOE_ROUTER_TILE), one warp too
        for tile in ((1, 1, 64), (2, 1, 16)):
            monkeypatch.setattr(cm, "ROUTER_TILE", tile)
            w_got, ids_got = cm.route_linear(x, w, b, o)
            assert ids_got.tolist() == ids_want.tolist() and torch.equal(w_got, w_want)


def test_moe_without_logits_routes_in_one_launch(monkeypatch):
    """torch_moe.moe given no logits (as the model calls it): with cuda_moe.ROUTER the
    router kernel's routing, else the backend's linear then route; the same output, and
    the linear not called in the first case."""
    cuda_ops = _cuda_ops()
    rng = np.random.default_rng(8)
    E2, k2, H2, I2 = 6, 2, 64, 32
    o = MoEOptions(E2, k2, I2, "topk_softmax", act="swiglu_clamped", bias=True)
    bf = torch.bfloat16
    # the router's logits small integers (exact however the interpreter rounds; ties to the
    # lower index), the experts random
    router = rng.integers(-1, 2, (E2, H2)) * (rng.random((E2, H2)) < 0.2)
    e = Experts(torch.from_numpy(router).to(bf).to(DEV),
                *(torch.from_numpy(0.2 * rng.standard_normal(s)).to(bf).to(DEV)
                  for s in ((E2, I2, H2), (E2, I2, H2), (E2, H2, I2))),
                router_bias=torch.from_numpy(rng.integers(-2, 3, E2)).to(bf).to(DEV))  # fmt: skip
    for n, width in (("gate_bias", I2), ("up_bias", I2), ("down_bias", H2)):
        setattr(e, n, torch.from_numpy(0.3 * rng.standard_normal((E2, width))).to(bf).to(DEV))
    x = torch.from_numpy(rng.integers(-2, 3, (1, 1, H2))).to(bf).to(DEV)
    calls = []

    def linear(a, w, b):
        calls.append(w)
        return cuda_ops.dense_gemv(a, w) + b

    monkeypatch.setattr(cm, "ROUTER", "0")
    want = torch_moe.moe(x, None, e, o, kernel=True, linear=linear)
    assert len(calls) == 1 and not cm.routes_linear(x.view(1, H2), e, o)
    monkeypatch.setattr(cm, "ROUTER", "bias")  # the default: this router has a bias
    assert cm.routes_linear(x.view(1, H2), e, o)
    got = torch_moe.moe(x, None, e, o, kernel=True, linear=linear)
    assert len(calls) == 1 and got.shape == want.shape
    assert torch.equal(got, want)
    e.router_bias = None  # without a bias: apart by default, in one launch with "1"
    assert not cm.routes_linear(x.view(1, H2), e, o)
    monkeypatch.setattr(cm, "ROUTER", "1")
    assert cm.routes_linear(x.view(1, H2), e, o)


GROUPED = [pytest.param(f, marks=() if f == ("mxfp4", 4, 32) else LONG_ON_CPU,
                        id="".join(map(str, f))) for f in FORMATS[1:]]  # fmt: skip


@pytest.mark.parametrize("fmt", GROUPED)
def test_grouped_matches_torch_experts(fmt):
    """Prefill's path (cuda_moe.moe_grouped): expert 0 gets all 8 tokens (qmatmul's GEMM),
    the others a few each (its GEMV); gpt-oss's biases and clamped gate."""
    rng = np.random.default_rng(3)
    o = MoEOptions(E, K, I, "topk_softmax", act="swiglu_clamped", bias=True, swiglu_limit=0.6)
    e = _experts(rng, fmt)
    x = torch.from_numpy(rng.standard_normal((8, H))).float().to(DEV)
    logits = torch.from_numpy(rng.standard_normal((8, E))).float().to(DEV)
    logits[:, 0] += 10.0
    weights, ids = torch_moe.route(logits, o)
    assert int((ids == 0).sum()) == 8 and int((ids != 0).sum()) == 8
    want = (torch_moe._gathered(x, ids, e, o) * weights.unsqueeze(-1)).sum(1)
    got = cm.moe_grouped(x, ids, weights, e, o)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, err


@pytest.mark.parametrize("fmt", GROUPED)
def test_grouped_decode_kernel(fmt):
    """The capturable grouped kernel (_moe_grouped: slots sorted and padded by expert on the
    device, tensor-core tiles) against the torch expert path; an unused expert, one with a
    single slot and one with more slots than a tile's 16."""
    rng = np.random.default_rng(4)
    o = MoEOptions(E, K, I, "topk_softmax", act="swiglu_clamped", bias=True, swiglu_limit=0.6)
    e = _experts(rng, fmt)
    T2 = 18
    x = torch.from_numpy(rng.standard_normal((T2, H))).float().to(DEV)
    ids = torch.tensor([[0, 1]] * 17 + [[2, 0]], device=DEV)  # 0: 18 slots, 1: 17, 2: 1, 3: 0
    weights = torch.softmax(torch.from_numpy(rng.standard_normal((T2, K))).float(), -1).to(DEV)
    want = (torch_moe._gathered(x, ids, e, o) * weights.unsqueeze(-1)).sum(1)
    tiles = cm._slot_tiles(ids.reshape(-1).to(torch.int32), E, cm.GROUPED_BM)
    assert tiles.numel() == 96 and sorted(t for t in tiles.tolist() if t >= 0) == list(range(36))
    got = cm.moe_experts(x, ids, weights, e, o, grouped=True)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, err


def _routed_biased_experts(seed: int, fmt, k2: int, i2: int):
    """Two bf16 tokens routed to k2 of 5 experts of i2 rows and 32 inputs in `fmt`, with
    gpt-oss's clamped SwiGLU and biases, and the torch expert path's float32 sum of their
    slots: (options, experts, x, weights, ids, that sum)."""
    rng = np.random.default_rng(seed)
    E2, H2, T2 = 5, 32, 2
    o = MoEOptions(E2, k2, i2, "topk_softmax", act="swiglu_clamped", bias=True)
    e = _experts(rng, fmt, (E2, i2, H2))
    x = torch.from_numpy(rng.standard_normal((T2, H2))).to(torch.bfloat16).to(DEV)
    logits = torch.from_numpy(rng.standard_normal((T2, E2))).float().to(DEV)
    weights, ids = cm.route(logits, o)
    want = (torch_moe._gathered(x.float(), ids.long(), e, o) * weights.unsqueeze(-1)).sum(1)
    return o, e, x, weights, ids, want


FUSED = [pytest.param(f, marks=() if f is None else LONG_ON_CPU,
                      id="dense" if f is None else "".join(map(str, f))) for f in FORMATS]  # fmt: skip


@pytest.mark.parametrize("fmt", FUSED)
def test_fused_slot_sum(fmt):
    """The down kernels summing a token's k slots themselves (_slot_sum: partials and a
    ticket a row tile, the last slot's program writes the sum): k = 3 of 5 experts (not a
    power of two), gpt-oss's biases, bf16 x with float32 (tensor-parallel) and bf16 output,
    against the torch sum of the same kernels' per-slot outputs and the torch expert path.
    The second fused launch finds the tickets reset by the first."""
    o, e, x, weights, ids, want = _routed_biased_experts(5, fmt, 3, 32)
    old = cm.moe_experts(x, ids, weights, e, o, out_dtype=torch.float32, fused=False)
    # bf16 x rounds h, down's input: the unfused kernels are the exact reference
    assert float((old - want).norm() / want.norm()) < 2e-2
    got = cm.moe_experts(x, ids, weights, e, o, out_dtype=torch.float32, fused=True)
    assert got.dtype == torch.float32 and got.shape == (2, 32)
    assert float((got - old).norm() / old.norm()) < 1e-6
    got = cm.moe_experts(x, ids, weights, e, o, fused=True)
    assert got.dtype == torch.bfloat16
    # within one bf16 step of the float32 sum (the interpreter rounds toward zero)
    assert bool(((got.float() - old).abs() <= old.abs() * 2**-7 + 1e-6).all())


# The joined down kernel (cuda_moe_down._moe_down: a token's k slots as one GEMV over their
# rows joined): 4-bit rows of 32 inputs (4 words: the joined row of 3 slots part-masked in
# one step), 512 (64 words, 3 slots: 192 words, a pair of 1-warp steps, the second masked;
# 4 slots: 256, two whole steps or one 2-warp step, no masks) and 1024 (3 one-warp steps: the
# pair, then the odd last one); 8 and 16 rows; gpt-oss's biases; each format with a k-step.
JOINED = [
    pytest.param(f, i2, k2, cfg, marks=() if (f, i2, cfg) == (("affine", 4, 32), 512, (1, 16, False))
                 else LONG_ON_CPU, id=f"{''.join(map(str, f))}-i{i2}-k{k2}-w{cfg[0]}n{cfg[1]}{'e' if cfg[2] else ''}")
    for f, i2, k2, cfg in [
        (("affine", 4, 32), 512, 3, (1, 16, False)),
        (("affine", 4, 32), 512, 4, (1, 8, False)),
        (("affine", 4, 32), 512, 4, (2, 16, True)),
        (("affine", 4, 32), 1024, 3, (1, 8, False)),
        (("affine", 4, 32), 32, 3, (2, 8, False)),
        (("affine", 8, 32), 256, 3, (1, 16, False)),
        (("mxfp4", 4, 32), 512, 3, (1, 8, False)),
        (("nvfp4", 4, 16), 512, 3, (1, 8, False)),
    ]
]  # fmt: skip


@pytest.mark.parametrize("fmt,i2,k2,cfg", JOINED)
def test_joined_down(fmt, i2, k2, cfg, monkeypatch):
    """The joined down kernel against the per-slot one (both summing the token's slots) and
    the torch expert path: 2 tokens, k2 of 5 experts, bf16 x, float32 and bf16 outputs."""
    o, e, x, weights, ids, want = _routed_biased_experts(6, fmt, k2, i2)
    monkeypatch.setattr(cm, "DOWN", False)
    old = cm.moe_experts(x, ids, weights, e, o, out_dtype=torch.float32, fused=True)
    assert float((old - want).norm() / want.norm()) < 2e-2  # bf16 h
    assert cm.joined_fits(cm.prepared(e)[1], k2)
    monkeypatch.setattr(cm, "DOWN", cfg)
    got = cm.moe_experts(x, ids, weights, e, o, out_dtype=torch.float32, fused=True)
    assert float((got - old).norm() / old.norm()) < 1e-6
    got = cm.moe_experts(x, ids, weights, e, o, fused=True)
    assert got.dtype == torch.bfloat16
    assert bool(((got.float() - old).abs() <= old.abs() * 2**-7 + 1e-6).all())


def test_down_spec():
    assert cm.parse_down("0") is False and cm.parse_down("1") is True
    assert cm.parse_down("w2n16") == (2, 16, False)
    assert cm.parse_down("w1n8e") == (1, 8, True)
    for bad in ("2", "w3n8", "w2n32", "n8", "w2n8x"):
        with pytest.raises(cm.MlxrunError, match="MLXRUN_MOE_DOWN"):
            cm.parse_down(bad)
