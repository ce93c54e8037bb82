"""mlx-lm's mixed-bit recipes (`mlx_lm convert -q --quant-predicate mixed_X_Y`, the recipe
behind mlx-community's mixed quants) on a tiny random model: per-layer entries with
`"group_size": null` load on torch-cpu and MLX and give mlx-lm's own logits, and the
memory planner counts the bytes the loader holds."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlxrun
from mlxrun.backends.base import QuantizedWeight
from mlxrun.loader import open_checkpoint
from mlxrun.memory import footprint, header_shapes
from mlxrun.quant.formats import QuantSpec, from_config, layer_spec

from .conftest import rel_err
from .test_conformance import VOCAB, _make

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}


def _match_mlx_lm(out) -> list:
    """mlx-lm's files at `out` loaded by mlxrun on torch-cpu and on MLX: each gives mlx-lm's
    own logits (rel err < 1e-4). Returns the two mlxrun models."""
    ids = np.random.default_rng(2).integers(3, VOCAB, size=12)
    theirs, _ = mlx_lm.load(str(out))
    want = np.array(theirs(mx.array(ids[None])).astype(mx.float32))[0]
    models = []
    for backend in ("cpu", "mlx"):
        ours = mlxrun.load(str(out), backend=backend, dtype="float32", progress=False)
        assert rel_err(ours.logits(ids), want) < 1e-4, backend
        models.append(ours)
    return models


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_mixed_recipe_matches_mlx_lm(tmp_path, recipe):
    # every input width a multiple of 64 (mlx-lm's group); untied: lm_head takes high bits
    dims = dict(hidden_size=64, intermediate_size=128, head_dim=16)
    src, _ = _make(tmp_path, "src", "llama", dims)
    out = tmp_path / recipe
    mlx_lm.convert(hf_path=str(src), mlx_path=str(out), quantize=True, quant_predicate=recipe)
    q = json.loads((out / "config.json").read_text())["quantization"]
    low, high = RECIPES[recipe]
    # what mlx-lm 0.32 writes: per-layer entries whose group size is null (the default)
    # (of 2 layers, the recipe gives layer 1's down_proj and v_proj the high bits)
    entry = q["model.layers.1.mlp.down_proj"]
    assert entry["group_size"] is None and entry["bits"] == high
    assert layer_spec(q, "model.layers.1.mlp.down_proj") == QuantSpec("affine", high, 64)
    assert layer_spec(q, "model.layers.0.mlp.down_proj") == QuantSpec("affine", low, 64)
    assert from_config({"bits": None, "group_size": None, "mode": None}) == QuantSpec(
        "affine", 4, 64
    )

    ids = np.random.default_rng(2).integers(3, VOCAB, size=12)
    model, _ = mlx_lm.load(str(out))
    want = np.array(model(mx.array(ids[None])).astype(mx.float32))[0]
    for backend in ("cpu", "mlx"):
        ours = mlxrun.load(str(out), backend=backend, dtype="float32", progress=False)
        L0, L1 = ours.transformer.layers
        assert isinstance(L1.down_proj, QuantizedWeight) and L1.down_proj.bits == high
        assert (L0.down_proj.bits, L1.up_proj.bits, ours.transformer.head.bits) == (low, low, high)
        assert rel_err(ours.logits(ids), want) < 1e-4, backend

    # the planner counts the stored bytes of each layer at its own width
    ck = open_checkpoint(str(out))
    fp = footprint(ck.config, header_shapes(out), "float32", backend="torch")
    held = sum(t.data.nbytes for n, t in ck.tensors.items() if n.endswith((".weight", ".scales", ".biases")) and f"{n.rpartition('.')[0]}.scales" in ck.tensors)  # fmt: skip
    dense_rest = sum(
        t.data.size * 4
        for n, t in ck.tensors.items()
        if f"{n.rpartition('.')[0]}.scales" not in ck.tensors
    )
    assert fp.weight_bytes == held + dense_rest


def test_layer_missing_from_the_map_takes_its_stored_format(tmp_path):
    """A stored layer the per-layer map does not name, packed at another width than the
    global block says: its format comes from its shapes, as mlx-lm 0.32's
    infer_quant_config does (the global 4 bits would misread a 6-bit layer)."""
    dims = dict(hidden_size=64, intermediate_size=128, head_dim=16)
    src, _ = _make(tmp_path, "src", "llama", dims)
    out = tmp_path / "q"
    mlx_lm.convert(hf_path=str(src), mlx_path=str(out), quantize=True, quant_predicate="mixed_3_6")
    ids = np.random.default_rng(2).integers(3, VOCAB, size=12)
    model, _ = mlx_lm.load(str(out))
    want = np.array(model(mx.array(ids[None])).astype(mx.float32))[0]
    cfg = json.loads((out / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        del cfg[key]["model.layers.1.mlp.down_proj"]  # 6-bit, the global block says 4
    (out / "config.json").write_text(json.dumps(cfg))
    ours = mlxrun.load(str(out), backend="cpu", dtype="float32", progress=False)
    assert ours.transformer.layers[1].down_proj.bits == 6
    assert rel_err(ours.logits(ids), want) < 1e-4


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_mlx_lm_calibrated_files_match_mlx_lm(tmp_path, method):
    """What mlx-lm's AWQ (its per-channel scales folded into the weights, a 4-bit g32
    embedding) and GPTQ write for a tiny llama: loads on torch-cpu and MLX with mlx-lm's own
    logits."""
    from mlx_lm.quant import gptq
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config
    from mlx_lm.utils import load, save

    dims = dict(hidden_size=64, intermediate_size=128, head_dim=16)
    src, _ = _make(tmp_path, "src", "llama", dims)
    model, tok, config = load(str(src), return_config=True)
    mx.random.seed(0)
    data = mx.array(np.random.default_rng(1).integers(3, VOCAB, size=(4, 32)))
    if method == "awq":
        awq_quantize(model, data, AWQ_MODEL_CONFIGS["llama"], bits=4, group_size=64,
                     embed_bits=4, embed_group_size=32, n_grid=4)  # fmt: skip
        config = update_config(model, config)
    else:
        model, q = gptq.gptq_quantize(model, data, 4, 64, 4, 32)
        config["quantization"] = config["quantization_config"] = q
    mx.eval(model.parameters())
    out = tmp_path / method
    save(str(out), str(src), model, tok, config)

    for ours in _match_mlx_lm(out):
        assert isinstance(ours.transformer.layers[0].down_proj, QuantizedWeight)


def test_mlx_lm_dynamic_quant_file_matches_mlx_lm(tmp_path):
    """mlx-lm's dynamic quantization (per-layer bits from measured sensitivities, as
    `mlx_lm.dynamic_quant` chooses them): the file loads on torch-cpu and MLX with mlx-lm's
    logits, each layer at the bits mlx-lm gave it."""
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import load, quantize_model, save

    dims = dict(hidden_size=64, intermediate_size=128, head_dim=16)
    src, _ = _make(tmp_path, "src", "llama", dims)
    model, tok, config = load(str(src), return_config=True)
    mx.random.seed(0)
    data = mx.array(np.random.default_rng(1).integers(3, VOCAB, size=(4, 32)))
    sens = dict(estimate_sensitivities(model, data, 4, 64, 8, 64, batch_size=2))
    cut = estimate_threshold(model, sens, target_bpw=5.0, low_bits=4, low_group_size=64,
                             high_bits=8, high_group_size=64)  # fmt: skip

    def predicate(p, m):
        if not hasattr(m, "to_quantized"):
            return False
        return {"bits": 8, "group_size": 64} if sens.get(p, 0) > cut else True

    model, config = quantize_model(model, config, 64, 4, quant_predicate=predicate)
    out = tmp_path / "dynamic"
    save(str(out), str(src), model, tok, config)
    bits = {e["bits"] for e in config["quantization"].values() if isinstance(e, dict)}
    assert bits == {8}  # some layers took the high bits, the rest the default 4

    _match_mlx_lm(out)


def test_mlx_lm_dwq_file_matches_mlx_lm(tmp_path):
    """mlx-lm's DWQ (scales and biases trained against the dense model's outputs): its file
    loads on torch-cpu and MLX with mlx-lm's logits."""
    import copy

    import mlx.optimizers as optim
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import load, quantize_model, save

    dims = dict(hidden_size=64, intermediate_size=128, head_dim=16)
    src, _ = _make(tmp_path, "src", "llama", dims)
    model, tok, config = load(str(src), return_config=True)
    q = copy.deepcopy(model)
    _, config = quantize_model(q, config, group_size=64, bits=4)
    before = np.array(q.layers[0].mlp.down_proj.scales)
    rng = np.random.default_rng(1)
    data = [(rng.integers(3, VOCAB, size=33).tolist(), 0) for _ in range(4)]
    dwq_quantize(q, lambda b, i, split: model(b), optim.Adam(learning_rate=1e-3), data,
                 data[:2], batch_size=2, max_seq_length=33, seed=0, dtype=mx.float32)  # fmt: skip
    assert not np.array_equal(np.array(q.layers[0].mlp.down_proj.scales), before)  # trained
    out = tmp_path / "dwq"
    save(str(out), str(src), q, tok, config)

    _match_mlx_lm(out)
