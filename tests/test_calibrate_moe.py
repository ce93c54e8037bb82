"""Calibrated quantization of mixture-of-experts models (quant/calibrate_moe.py): each
expert calibrated on the tokens routed to it, the starved ones rounded to nearest, and a
calibrated tiny Qwen3-MoE no further from the dense model than rounding to nearest."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlxrun
from mlxrun.convert import convert
from mlxrun.moe import MoEOptions
from mlxrun.quant.calib_search import make_grid, search_clip, search_scales
from mlxrun.quant.calibrate import CalibOptions
from mlxrun.quant.calibrate_moe import experts, routed
from mlxrun.quant.formats import resolve

from .conftest import rel_err, write_random

SPEC = resolve("int4", group_size=32)
VOCAB = 96


def test_experts_see_their_tokens_and_starved_ones_round_to_nearest():
    """Expert 3 is picked by 10 tokens (< 2 groups of 32): its stored bytes are the
    round-to-nearest ones; the others are calibrated, and their output error on their own
    tokens is lower than rounding's."""
    rng = np.random.default_rng(0)
    E, k, I, H, N = 4, 2, 64, 64, 600  # noqa: E741
    o = MoEOptions(E, k, I)
    w = {
        "gate_proj": 0.1 * rng.standard_normal((E, I, H)),
        "up_proj": 0.1 * rng.standard_normal((E, I, H)),
        "down_proj": 0.1 * rng.standard_normal((E, H, I)),
    }
    w = {n: a.astype(np.float32) for n, a in w.items()}
    loud = np.where(rng.random(H) < 0.1, 8.0, 1.0)  # a few loud channels, as real layers have
    x = (rng.standard_normal((N, H)) * loud).astype(np.float32)
    logits = rng.standard_normal((N, E)).astype(np.float32)
    logits[:, 3] -= 10
    logits[:10, 3] += 20  # expert 3: the first 10 tokens only
    assert (routed(logits, k) == 3).any(-1).sum() == 10

    def codes(m, h, proj):
        grid = make_grid(
            m, SPEC, "float32", None if h is None else search_clip(m, h, SPEC, "float32")
        )
        return grid, grid.codes(m)

    def search(m, rows, mean):
        return search_scales([m], rows, mean, SPEC, "float32", 10)

    parts, few = experts(w, x, logits, o, codes, search, 2 * SPEC.group_size)
    assert few == 1
    rtn = make_grid(w["down_proj"][3], SPEC, "float32")
    assert np.array_equal(
        parts["down_proj"]["weight"][3], rtn.tensors(rtn.codes(w["down_proj"][3]))["weight"]
    )
    assert parts["gate_proj"]["weight"].shape == (E, I, H * 4 // 32)

    def deq(proj, e):
        p = parts[proj]
        from mlxrun.quant.reference import dequantize

        return dequantize(p["weight"][e], p["scales"][e], p["biases"][e], SPEC)

    def silu(a):
        return a / (1 + np.exp(-a))

    for e in range(3):  # calibrated: the expert's output on its tokens is closer
        xe = x[(routed(logits, k) == e).any(-1)]
        want = silu(xe @ w["gate_proj"][e].T) * (xe @ w["up_proj"][e].T) @ w["down_proj"][e].T
        got = silu(xe @ deq("gate_proj", e).T) * (xe @ deq("up_proj", e).T) @ deq("down_proj", e).T
        r = {n: make_grid(w[n][e], SPEC, "float32") for n in w}
        r = {n: g.values(g.codes(w[n][e])) for n, g in r.items()}
        near = silu(xe @ r["gate_proj"].T) * (xe @ r["up_proj"].T) @ r["down_proj"].T
        assert ((got - want) ** 2).sum() < 0.9 * ((near - want) ** 2).sum(), e


def _loud_and_saved(hf, d):
    """Make 4 of hf's 64 hidden channels 8x louder in every layernorm (the few loud channels
    real layers have, which AWQ's scales are for), save it over d's weights, return d."""
    import torch

    loud = torch.from_numpy(np.random.default_rng(5).choice(64, 4, replace=False))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "layernorm" in n:
                p[loud] *= 8.0
    hf.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE whose norms make 4 of the 64 hidden channels 8x louder, as
    real layers have a few (what AWQ's scales are for; without them a random model's
    activations leave calibration nothing to find: measured KL 0.28 rounding, 0.27 GPTQ)."""
    kw = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
    )  # fmt: skip
    d, hf = write_random(tmp_path_factory.mktemp("calib_moe") / "q", "qwen3_moe", kw, 0, std=0.2)
    return _loud_and_saved(hf, d)


def _kl(dense: np.ndarray, q: np.ndarray) -> float:
    """Mean KL(dense || q) over positions, logits (T, V)."""

    def logp(a):
        a = a - a.max(-1, keepdims=True)
        return a - np.log(np.exp(a).sum(-1, keepdims=True))

    p, lq = logp(dense.astype(np.float64)), logp(q.astype(np.float64))
    return float((np.exp(p) * (p - lq)).sum(-1).mean())


def _three_ways(d, tmp_path, grid):
    """Convert d to int4 g32 by rounding, AWQ and GPTQ on the same random calibration text:
    yields (method, out dir, convert's notes, loaded model, KL to d's dense logits on
    held-out tokens) for method None, "awq", "gptq"."""
    rng = np.random.default_rng(0)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{i}" for i in rng.integers(3, VOCAB, 2000)))
    held = [int(i) for i in np.random.default_rng(1).integers(3, VOCAB, 128)]
    dense = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    ref = dense.logits(held)
    for method in (None, "awq", "gptq"):
        out = tmp_path / str(method)
        opts = None
        if method:
            opts = CalibOptions(method, str(calib), samples=4, seq_len=64, grid=grid)
        notes = convert(str(d), str(out), quant="int4", group_size=32, progress=False,
                        calibrate=opts)  # fmt: skip
        m = mlxrun.load(str(out), backend="cpu", dtype="float32", progress=False)
        yield method, out, notes, m, _kl(ref, m.logits(held))


def test_calibrated_moe_is_closer_to_dense_than_rounding(moe_dir, tmp_path):
    """AWQ and GPTQ on a tiny Qwen3-MoE (experts in layer 0, a dense MLP in layer 1):
    KL to the dense model on held-out text below round-to-nearest int4 g32's, the
    experts stored stacked in the packed format the loader reads, and the file generates."""
    kl = {}
    for method, out, notes, m, kl_method in _three_ways(moe_dir, tmp_path, grid=10):
        kl[method] = kl_method
        if method:
            assert any("0 of 4 saw fewer than 64 calibration tokens" in n for n in notes), notes
            e = m.transformer.layers[0].moe
            assert (e.gate.mode, e.gate.bits, e.gate.group_size) == ("affine", 4, 32)
            assert m.transformer.layers[0].moe.router.dtype.is_floating_point  # as stored
            names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] \
                if (out / "model.safetensors.index.json").exists() else None  # fmt: skip
            assert names is None or "model.layers.0.mlp.switch_mlp.down_proj.scales" in names
            assert len(m.generate("w5 w9 w14", max_tokens=6, chat=False).split()) == 6
    # measured: rounding 0.344, AWQ 0.262, GPTQ 0.194
    assert kl["awq"] < 0.9 * kl[None] and kl["gptq"] < 0.9 * kl[None], kl


def test_target_bpw_gives_each_stacked_expert_projection_a_width(moe_dir, tmp_path):
    """--target-bpw on a Qwen3-MoE: each stacked expert projection is one tensor of the
    allocation (bytes over all its experts); the file meets the target within the dense
    test's 0.25 bits (2 x 32 calibration tokens; the target here is uniform int4 g32's 6.0 bits a weight with float32
    scales and biases), its per-layer widths are mlx-lm's overrides, and it loads with
    each projection at its width and generates."""
    from .test_mixed_bits import file_bpw

    rng = np.random.default_rng(0)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{i}" for i in rng.integers(3, VOCAB, 2000)))
    out = tmp_path / "mixed"
    opts = CalibOptions("awq", str(calib), samples=2, seq_len=32, grid=3, target_bpw=6.0)
    notes = convert(str(moe_dir), str(out), quant="int4", group_size=32, progress=False,
                    calibrate=opts)  # fmt: skip
    assert 6.0 - 0.25 < file_bpw(out) <= 6.0, notes
    q = json.loads((out / "config.json").read_text())["quantization"]
    widths = {k: v["bits"] for k, v in q.items() if isinstance(v, dict)}
    p = "model.layers.0.mlp.switch_mlp"
    assert len({*widths.values(), 4}) >= 2, widths  # some linears off 4 bits
    m = mlxrun.load(str(out), backend="cpu", dtype="float32", progress=False)
    e = m.transformer.layers[0].moe
    for proj in ("gate_proj", "up_proj", "down_proj"):
        got = getattr(e, proj.replace("_proj", ""))
        assert got.bits == widths.get(f"{p}.{proj}", 4), proj
    # measured (2 x 64 tokens): layer 0's experts' gate_proj at 3 bits, attention at 5, 6
    assert any(k.startswith(p) for k in widths), widths
    assert len(m.generate("w5 w9 w14", max_tokens=6, chat=False).split()) == 6


def test_calibration_runs_each_layer_as_the_model_does(tiny_moe_dirs):
    """The layer-by-layer forward calibration records its inputs from (quant/calib_layers.py's
    _run), on gpt-oss's layers (a window of 8 on layer 0 over 32-token windows, sinks,
    q/k/v/o biases, the clamped SwiGLU with biases), gives the model's own logits; run
    with the full layer's attention in place of the sliding one, it does not."""
    from mlxrun.quant.calib_layers import _run

    m = mlxrun.load(tiny_moe_dirs["gpt_oss"], backend="cpu", dtype="float32", progress=False)
    tr, be = m.transformer, m.transformer.be
    c = tr.config
    assert c.window(0) == 8 and c.window(1) is None and c.attention_sinks
    ids = np.random.default_rng(3).integers(3, VOCAB, size=(2, 32))
    want = np.stack([m.logits(row) for row in ids])

    def logits(windows):
        hs = be.to_numpy(be.embedding(be.ids(ids), tr.embed))
        for i, L in enumerate(tr.layers):
            hs, _ = _run(tr, L, hs, 2, None, windows[i])
        x = be.rms_norm(be.array(hs), tr.norm, c.rms_norm_eps)
        return be.to_numpy(be.linear(x, tr.head))

    assert rel_err(logits([0, 1]), want) < 1e-5
    assert rel_err(logits([1, 1]), want) > 1e-3  # layer 0 without its window


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """A tiny random gpt-oss (TINY_MOE's: a window of 8 on layer 0, sinks, biases, the
    clamped SwiGLU) with 4 of its 64 hidden channels 8x louder, as moe_dir."""

    from .conftest import _MOE_BASE, TINY_MOE

    kw = {**_MOE_BASE, **TINY_MOE["gpt_oss"], "max_position_embeddings": 256}
    d, hf = write_random(tmp_path_factory.mktemp("calib_oss") / "g", "gpt_oss", kw, 0, std=0.2)
    return _loud_and_saved(hf, d)


def test_calibrated_gpt_oss_is_closer_to_dense_than_rounding(gpt_oss_dir, tmp_path):
    """AWQ and GPTQ on a tiny gpt-oss (sliding and full layers, sinks, biases, the clamped
    SwiGLU; transformers' fused expert layout): KL to the dense model on held-out text
    below round-to-nearest int4 g32's; the experts are written stacked with their biases,
    and the file loads and generates."""
    kl = {}
    for method, _, _, m, kl_method in _three_ways(gpt_oss_dir, tmp_path, grid=5):
        kl[method] = kl_method
        if method:
            e = m.transformer.layers[0].moe
            assert (e.gate.mode, e.gate.bits, e.down.group_size) == ("affine", 4, 32)
            assert e.down_bias is not None and e.router_bias is not None
            assert len(m.generate("w5 w9 w14", max_tokens=6, chat=False).split()) == 6
    # measured: rounding 0.490, AWQ 0.406, GPTQ 0.405
    assert kl["awq"] < 0.9 * kl[None] and kl["gptq"] < 0.9 * kl[None], kl


def test_gpt_oss_stored_mxfp4_calibrates_from_either_layout(tiny_moe_dirs, tmp_path):
    """gpt-oss stored in MXFP4, as OpenAI ships it (*_blocks, *_scales) and as mlx-lm does
    (stacked mxfp4 with .bias beside): both are expanded to the same dense experts (biases
    kept), so --calibrate writes the same bytes from either, and the file loads."""
    from mlxrun.weights import load_safetensors

    rng = np.random.default_rng(0)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{i}" for i in rng.integers(3, VOCAB, 500)))
    opts = CalibOptions("gptq", str(calib), samples=2, seq_len=32, grid=3)
    got = {}
    for name in ("gpt_oss_openai", "gpt_oss_mlx_lm"):
        out = tmp_path / name
        convert(tiny_moe_dirs[name], str(out), quant="int4", group_size=32, progress=False,
                calibrate=opts)  # fmt: skip
        got[name], _ = load_safetensors(out / "model.safetensors")
    a, b = got.values()
    assert sorted(a) == sorted(b) and "model.layers.0.mlp.experts.down_proj.bias" in a
    assert all(np.array_equal(np.asarray(a[k].data), np.asarray(b[k].data)) for k in a)
    m = mlxrun.load(str(tmp_path / "gpt_oss_openai"), backend="cpu", dtype="float32",
                    progress=False)  # fmt: skip
    assert m.transformer.layers[0].moe.gate.bits == 4
    assert len(m.generate("w5 w9 w14", max_tokens=6, chat=False).split()) == 6
