"""Mixture-of-experts models against transformers: tiny random Qwen3-MoE and Mixtral
checkpoints built with transformers' own classes, in its per-expert layout and in mlx-lm's
stacked `switch_mlp` one. Logits within 1e-4 on torch-cpu and MLX (prompts long enough for
the grouped expert paths, decode through the gathered ones), greedy tokens equal, and the
same after int4 / fp4 quantization against transformers running the dequantized bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.backends.base import QuantizedWeight
from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError
from mlxrun.generate import generate_step
from mlxrun.moe import MoEOptions
from mlxrun.sampling import SamplingParams
from mlxrun.weights import Tensor, load_safetensors, save_safetensors

from .conftest import hf_greedy, random_models, rel_err

VOCAB = 64
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
VARIANTS = {
    # renormalised top-k; layer 1 keeps a dense MLP (mlp_only_layers)
    "qwen3_moe_norm_dense1": (
        "qwen3_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=64,
            head_dim=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),  # fmt: skip
    "qwen3_moe_raw_topk": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            intermediate_size=64,
            head_dim=16,
            norm_topk_prob=False,
        ),
    ),  # fmt: skip
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    # biases everywhere, sinks, clamped SwiGLU, top-k-then-softmax routing, YaRN, a window
    # of 8 on layer 0 (the 32-token prompt crosses it)
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            head_dim=16,
            sliding_window=8,
            swiglu_limit=0.5,
        ),
    ),  # fmt: skip
}
PROMPT = np.random.default_rng(1).integers(3, VOCAB, size=32)  # 64+ slots: sorted/grouped


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    return random_models(tmp_path_factory.mktemp("moe"), VARIANTS, BASE, std=0.2)


def _hf(hf, ids, new=6):
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    return ref, hf_greedy(hf, ids, new)


def _check(m, ids, ref, want, tol, what):
    assert rel_err(m.logits(ids), ref) < tol, what
    steps = generate_step(m.transformer, [list(ids)], SamplingParams(), max_tokens=len(want),
                          prefill_chunk=7)  # fmt: skip
    assert [int(t[0]) for t in steps] == want, what


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_matches_transformers(variant, name):
    d, hf = variant(name)
    ref, want = _hf(hf, PROMPT)
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
        o = m.transformer.config.moe
        assert isinstance(o, MoEOptions) and o.num_experts == hf.config.num_local_experts
        _check(m, PROMPT, ref, want, 1e-4, backend)


def test_dense_layers_and_routing_options_are_read(variant):
    d, _ = variant("qwen3_moe_norm_dense1")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    o = m.transformer.config.moe
    assert (o.top_k, o.norm_topk, o.layers) == (2, True, (True, False))
    L0, L1 = m.transformer.layers
    assert L0.moe is not None and L0.gate_proj is None
    assert L1.moe is None and L1.gate_proj is not None
    assert tuple(L0.moe.gate.shape) == (8, 32, 64) and tuple(L0.moe.down.shape) == (8, 64, 32)
    # the renormalisation matters: the same weights without it give other logits
    m.transformer.config = m.transformer.config.replace(moe=MoEOptions(8, 2, 32, norm_topk=False,
                                                                       layers=(True, False)))  # fmt: skip
    _, hf = variant("qwen3_moe_norm_dense1")
    ref, _ = _hf(hf, PROMPT[:8], 1)
    assert rel_err(m.logits(PROMPT[:8]), ref) > 1e-3


def _to_switch_layout(src, dst, mt, experts):
    """Rewrite a transformers checkpoint in mlx-lm's stacked layout, as mlx-lm's sanitize
    does (per-expert tensors stacked under switch_mlp, gate/up/down names)."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    t, _ = load_safetensors(src / "model.safetensors")
    block, names = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}[mt]  # fmt: skip
    out = {}
    for n, x in t.items():
        if ".experts." not in n:
            out[n] = x
    for i in range(BASE["num_hidden_layers"]):
        p = f"model.layers.{i}.{block}"
        if f"{p}.experts.0.{names[0]}.weight" not in t:
            continue
        for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), names):
            stack = np.stack([t[f"{p}.experts.{e}.{theirs}.weight"].data for e in range(experts)])
            out[f"{p}.switch_mlp.{ours}.weight"] = Tensor.from_numpy(stack)
    save_safetensors(dst / "model.safetensors", out)


@pytest.mark.parametrize("name", ["qwen3_moe_norm_dense1", "mixtral"])
def test_switch_mlp_layout_loads(variant, tmp_path, name):
    d, hf = variant(name)
    mt = VARIANTS[name][0]
    _to_switch_layout(d, tmp_path / "sw", mt, hf.config.num_local_experts)
    ref, _ = _hf(hf, PROMPT[:12], 1)
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(tmp_path / "sw"), backend=backend, dtype="float32", progress=False)
        assert rel_err(m.logits(PROMPT[:12]), ref) < 1e-4, backend


def _dequantized_reference(hf, m):
    """A copy of the transformers model whose weights are mlxrun's dequantized ones."""
    import copy

    be = m.transformer.be
    ref = copy.deepcopy(hf)
    sd = ref.state_dict()

    def put(name, w):
        a = be.to_numpy(be.dequantize(w)) if isinstance(w, QuantizedWeight) else be.to_numpy(w)
        sd[name].copy_(torch.from_numpy(a).reshape(sd[name].shape))

    t = m.transformer
    put("model.embed_tokens.weight", t.embed)
    put("lm_head.weight", t.head)
    for i, L in enumerate(t.layers):
        p = f"model.layers.{i}"
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(f"{p}.self_attn.{k}.weight", getattr(L, k))
        e = L.moe
        if e is None:
            for k in ("gate_proj", "up_proj", "down_proj"):
                put(f"{p}.mlp.{k}.weight", getattr(L, k))
            continue
        block = "mlp" if f"{p}.mlp.experts.gate_up_proj" in sd else "block_sparse_moe"
        g, u = (be.to_numpy(be.dequantize(w)) for w in (e.gate, e.up))
        sd[f"{p}.{block}.experts.gate_up_proj"].copy_(torch.from_numpy(np.concatenate([g, u], 1)))
        put(f"{p}.{block}.experts.down_proj", e.down)
    ref.load_state_dict(sd)
    return ref


@pytest.mark.parametrize("name,quant", [("qwen3_moe_norm_dense1", "int4"), ("mixtral", "fp4")])
def test_quantized_experts_match_transformers_on_their_bytes(variant, name, quant):
    """Quantized on load (group 32: every matrix of the tiny model): experts are packed
    stacks, and the logits are transformers' on the dequantized bytes, on both backends."""
    d, hf = variant(name)
    got = {}
    for backend in ("mlx", "cpu"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False, quant=quant,
                        group_size=32)  # fmt: skip
        e = m.transformer.layers[0].moe
        assert isinstance(e.gate, QuantizedWeight) and not isinstance(e.router, QuantizedWeight)
        ref, want = _hf(_dequantized_reference(hf, m), PROMPT[:20], 4)
        assert rel_err(ref, _hf(hf, PROMPT[:20], 1)[0]) > 1e-3  # quantized for real
        _check(m, PROMPT[:20], ref, want, 1e-4, backend)
        got[backend] = m.logits(PROMPT[:20])
    assert rel_err(got["cpu"], got["mlx"]) < 1e-4


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(MlxrunError) as e:
        ModelConfig.from_dict({"model_type": "deepseek_v3", **BASE, "intermediate_size": 64})
    msg = str(e.value)
    assert "\n" not in msg and "deepseek_v3" in msg
    for mt in ("llama", "qwen3_moe", "mixtral"):
        assert mt in msg


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(num_experts_per_tok=9), ["num_experts_per_tok", "9", "8"]),
        (dict(num_experts=0), ["num_experts", "0"]),
        (dict(moe_intermediate_size=None), ["moe_intermediate_size"]),
        (dict(shared_expert_intermediate_size=128), ["shared_expert_intermediate_size"]),
    ],
)
def test_bad_moe_configs_are_refused(kw, words):
    d = {"model_type": "qwen3_moe", **BASE, "intermediate_size": 64, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # fmt: skip
    d.update(kw)
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(MlxrunError) as e:
        ModelConfig.from_dict(d)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_quantized_expert_bytes_are_counted(variant):
    from mlxrun.evaluate import matrix_bytes_per_weight

    d, _ = variant("mixtral")
    m = mlxrun.load(str(d), backend="mlx", dtype="float32", progress=False, quant="fp4")
    # mxfp4 g32: half a byte a weight plus a 1-byte scale a group, experts included
    assert matrix_bytes_per_weight(m.transformer) == pytest.approx(0.5 + 1 / 32, rel=1e-12)


@pytest.mark.parametrize("layout", ["per_expert", "switch_mlp"])
def test_planner_counts_every_expert_as_loaded(variant, tmp_path, layout):
    """The planner's weight bytes from the headers alone equal what the loaded model holds
    (every expert, quantized on load; the router as stored), in either stored layout."""
    d, hf = variant("mixtral")
    if layout == "switch_mlp":
        _to_switch_layout(d, tmp_path / "sw", "mixtral", hf.config.num_local_experts)
        d = tmp_path / "sw"
    _check_plan(d, hf)


def _check_plan(d, hf):
    """The planner's bytes from d's headers equal the loaded model's (MLX, as stored and
    int4 g32 on load), and its parameter count transformers' model hf's."""
    from mlxrun.memory import footprint, header_shapes
    from mlxrun.quant.formats import resolve

    for quant in (None, "int4"):
        m = mlxrun.load(str(d), backend="mlx", dtype="float32", progress=False, quant=quant,
                        group_size=32)  # fmt: skip
        spec = None if quant is None else resolve(quant, group_size=32)
        fp = footprint(m.transformer.config, header_shapes(d), "float32", spec, backend="mlx")
        assert fp.weight_bytes == m.transformer.weight_bytes(), quant
        assert fp.n_params == sum(p.numel() for p in hf.parameters())


def test_moe_shapes_plan_by_total_and_bench_by_active_bytes():
    from mlxrun.backends import get_backend
    from mlxrun.bench import build_random, shape_config, weight_bytes
    from mlxrun.memory import config_shapes, footprint
    from mlxrun.moe import experts_read

    big = shape_config("shape:qwen3-30b-a3b")
    assert big.moe.num_experts == 128 and big.moe.top_k == 8
    fp = footprint(big, config_shapes(big), "bfloat16")
    assert fp.n_params == pytest.approx(30.53e9, rel=2e-3)  # Qwen3-30B-A3B: 30.5B
    oss = shape_config("shape:gpt-oss-20b")
    assert (oss.moe.routing, oss.attention_sinks, oss.layer_windows[:2]) == (
        "topk_softmax", True, (128, None))  # fmt: skip
    assert footprint(oss, config_shapes(oss), "bfloat16").n_params == pytest.approx(
        20.91e9, rel=2e-3
    )
    c = shape_config("shape:tiny-moe")
    m = build_random(c, get_backend("mlx", "float32"), seed=1)
    E, k = c.moe.num_experts, c.moe.top_k
    experts = sum(
        int(w.nbytes) for L in m.layers for w in (L.moe.gate, L.moe.up, L.moe.down)
    )  # fmt: skip
    held, read1 = weight_bytes(m, 1)
    assert held == m.weight_bytes()
    rows = int(m.embed.nbytes) * (1 - 1 / c.vocab_size)  # the embedding: one row read
    assert held - read1 == pytest.approx(experts * (E - k) / E + rows, abs=len(m.layers))
    assert experts_read(c.moe, 1) == pytest.approx(k)
    _, read32 = weight_bytes(m, 32)
    assert read1 < read32 < held - rows + int(m.embed.nbytes) * 31 / c.vocab_size


def _gpt_oss_mxfp4(src, root):
    """The tiny gpt-oss checkpoint with its experts in MXFP4, written twice: as OpenAI
    ships it (transformers' *_blocks / *_scales, quant_method mxfp4) and in mlx-lm's
    layout (mlp.experts.gate_proj.weight uint32 ...). Returns (openai dir, mlx-lm dir,
    {param: dequantized (E, ...) float32 in transformers' in-memory layout})."""
    import json
    import shutil

    from mlxrun.quant.formats import QuantSpec
    from mlxrun.quant.reference import dequantize, quantize

    spec = QuantSpec("mxfp4", 4, 32)
    t, _ = load_safetensors(src / "model.safetensors")
    oa, ml, deq = {}, {}, {}
    for n, x in t.items():
        if ".mlp.experts." not in n or n.endswith("_bias"):
            oa[n] = x
            if ".mlp.experts." not in n:
                ml[n] = x
            continue
        w = np.swapaxes(x.float32(), 1, 2)  # (E, out, in): gate and up rows interleaved
        q = quantize(w, spec)
        E, out, _ = w.shape
        oa[n + "_blocks"] = Tensor.from_numpy(q["weight"].view(np.uint8).reshape(E, out, -1, 16))
        oa[n + "_scales"] = Tensor.from_numpy(q["scales"])
        back = dequantize(q["weight"], q["scales"], None, spec, dtype="float32")
        deq[n] = np.swapaxes(back, 1, 2)
        p = n.rsplit(".", 1)[0]
        bias = t[n + "_bias"].data
        parts = (
            [("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))]
            if n.endswith("gate_up_proj")
            else [("down_proj", slice(None))]
        )
        for k, rows in parts:
            ml[f"{p}.{k}.weight"] = Tensor.from_numpy(np.ascontiguousarray(q["weight"][:, rows]))
            ml[f"{p}.{k}.scales"] = Tensor.from_numpy(np.ascontiguousarray(q["scales"][:, rows]))
            ml[f"{p}.{k}.bias"] = Tensor.from_numpy(np.ascontiguousarray(bias[:, rows]))
    cfg = json.loads((src / "config.json").read_text())
    out = []
    for name, tensors, quant in (
        ("openai", oa, {"quantization_config": {"quant_method": "mxfp4",
                                                "modules_to_not_convert": ["router"]}}),
        ("mlx_lm", ml, {"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}),
    ):  # fmt: skip
        d = root / name
        shutil.copytree(src, d)
        save_safetensors(d / "model.safetensors", tensors)
        (d / "config.json").write_text(json.dumps({**cfg, **quant}))
        out.append(d)
    return *out, deq


def test_gpt_oss_mxfp4_experts_load_as_stored(variant, tmp_path):
    import copy

    d, hf = variant("gpt_oss")
    openai, mlx_lm_dir, deq = _gpt_oss_mxfp4(d, tmp_path)
    ref_model = copy.deepcopy(hf)
    sd = ref_model.state_dict()
    for n, a in deq.items():
        sd[n].copy_(torch.from_numpy(a))
    ref_model.load_state_dict(sd)
    ref, want = _hf(ref_model, PROMPT[:20], 4)
    assert rel_err(ref, _hf(hf, PROMPT[:20], 1)[0]) > 1e-3  # the experts are fp4 for real
    blocks, _ = load_safetensors(openai / "model.safetensors")
    stored = blocks["model.layers.0.mlp.experts.down_proj_blocks"].data
    for path in (openai, mlx_lm_dir):
        for backend in ("cpu", "mlx"):
            m = mlxrun.load(str(path), backend=backend, dtype="float32", progress=False)
            e = m.transformer.layers[0].moe
            assert (e.down.mode, e.down.group_size) == ("mxfp4", 32)
            # the stored bytes themselves, no re-quantization
            w = e.down.weight
            words = w.view(torch.int32).numpy() if isinstance(w, torch.Tensor) else np.array(w)
            assert np.array_equal(words.view(np.uint8).reshape(stored.shape), stored)
            assert isinstance(m.transformer.layers[0].q_proj, type(e.router))  # dense
            _check(m, PROMPT[:20], ref, want, 1e-4, f"{path.name} {backend}")


def _legacy_keys(d):
    """config.json as the published checkpoints spell it (num_experts, rope_theta), which
    mlx-lm's model classes require; transformers 5 writes other names."""
    import json

    cfg = json.loads((d / "config.json").read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", ["qwen3_moe_norm_dense1", "mixtral"])
def test_mlx_lm_interop_both_ways(variant, tmp_path, name):
    """mlxrun convert writes mlx-lm's switch_mlp layout (experts stacked, then quantized):
    mlx-lm loads it with the same logits; mlx_lm.convert's output loads in mlxrun."""
    import shutil

    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlxrun.convert import convert

    src, _ = variant(name)
    d = tmp_path / "src"
    shutil.copytree(src, d)
    _legacy_keys(d)
    ids = PROMPT[:12].tolist()
    ours_dir = tmp_path / "ours"
    assert convert(str(d), str(ours_dir), quant="int4", group_size=32, progress=False) == []
    t, _ = load_safetensors(ours_dir / "model.safetensors")
    assert not any(".experts." in n for n in t) and any(".switch_mlp." in n for n in t)
    theirs_dir = tmp_path / "theirs"
    mlx_lm.convert(hf_path=str(d), mlx_path=str(theirs_dir), quantize=True, q_group_size=32,
                   q_bits=4)  # fmt: skip
    for path in (ours_dir, theirs_dir):
        model, _ = mlx_lm.load(str(path))
        want = np.array(model(mx.array([ids])).astype(mx.float32))[0]
        m = mlxrun.load(str(path), backend="mlx", dtype="float32", progress=False)
        assert rel_err(m.logits(ids), want) < 1e-4, path.name


def test_gpt_oss_int4_loads_in_mlx_lm(variant, tmp_path):
    """gpt-oss converted to int4 gives mlx-lm's model the logits mlxrun computes. mlx-lm's
    gpt-oss fixes swiglu_limit at 7.0 and always truncates YaRN's correction range, so the
    config here is one it represents (the tiny model's own limit of 0.5 and truncate=False
    differ from it by 0.85 relative). It reads YaRN only from `rope_scaling`, which this
    transformers 5 config lacks: convert writes it."""
    import json
    import shutil

    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlxrun.convert import convert

    src, _ = variant("gpt_oss")
    d = tmp_path / "src"
    shutil.copytree(src, d)
    _legacy_keys(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["swiglu_limit"] = 7.0
    cfg["rope_parameters"]["truncate"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    assert "rope_scaling" not in cfg
    out = tmp_path / "int4"
    assert convert(str(d), str(out), quant="int4", group_size=32, progress=False) == []
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "yarn"
    ids = PROMPT[:12].tolist()
    model, _ = mlx_lm.load(str(out))
    want = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    m = mlxrun.load(str(out), backend="mlx", dtype="float32", progress=False)
    assert rel_err(m.logits(ids), want) < 1e-4


def test_gpt_oss_mxfp4_plans_and_converts_as_stored(variant, tmp_path):
    """Both MXFP4 layouts plan at the bytes the loaded model holds; convert rewrites
    OpenAI's layout as mlx-lm's (config quantization block included) with the same bytes."""
    import json

    from mlxrun.convert import convert
    from mlxrun.memory import footprint, header_shapes

    d, _ = variant("gpt_oss")
    openai, mlx_lm_dir, _ = _gpt_oss_mxfp4(d, tmp_path)
    for path in (openai, mlx_lm_dir):
        m = mlxrun.load(str(path), backend="mlx", dtype="float32", progress=False)
        fp = footprint(m.transformer.config, header_shapes(path), "float32", backend="mlx")
        assert fp.weight_bytes == m.transformer.weight_bytes(), path.name
    out = tmp_path / "converted"
    assert convert(str(openai), str(out), progress=False) == []
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    a, _ = load_safetensors(out / "model.safetensors")
    b, _ = load_safetensors(mlx_lm_dir / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[n].data, b[n].data) for n in a)
