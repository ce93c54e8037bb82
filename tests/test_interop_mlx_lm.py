"""Interop with mlx-lm on real weights (a dense float32 copy of the bundled SmolLM2), both
ways: checkpoints quantized by `mlx_lm.convert` run in mlxrun on MLX and PyTorch-CPU with
mlx-lm's own logits, and checkpoints written by `mlxrun convert --quant` load in
`mlx_lm.load` and decode the same greedy tokens as mlxrun."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

import mlxrun
from mlxrun.backends.base import QuantizedWeight
from mlxrun.convert import convert
from mlxrun.dense import save_dense
from mlxrun.generate import generate_step
from mlxrun.loader import open_checkpoint
from mlxrun.quant.formats import QuantSpec, from_config
from mlxrun.sampling import SamplingParams

from .conftest import rel_err

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

# `mlx_lm.generate` is also a function name in the package namespace; get the module
mlx_lm_generate = importlib.import_module("mlx_lm.generate")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return save_dense("smollm2", tmp_path_factory.mktemp("smol") / "dense", "float32")


@pytest.fixture(scope="module")
def ids(dense):
    tok = open_checkpoint(str(dense)).tokenizer
    return tok.encode("The capital of France is", add_special_tokens=False)


def _ours(path, backend):
    return mlxrun.load(str(path), backend=backend, dtype="float32", progress=False)


@pytest.mark.parametrize(
    "mode,group,bits",
    [
        ("affine", 64, 4),
        ("affine", 32, 4),
        pytest.param("mxfp4", 32, 4, marks=pytest.mark.long),  # ~20 s on 2 cores
        ("mxfp8", 32, 8),
    ],
)
def test_mlxrun_runs_mlx_lm_quantized_checkpoint(dense, ids, tmp_path, mode, group, bits):
    out = tmp_path / "mlx"
    mlx_lm.convert(
        hf_path=str(dense),
        mlx_path=str(out),
        quantize=True,
        q_group_size=group,
        q_bits=bits,
        q_mode=mode,
    )
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert from_config(q) == QuantSpec(mode, bits, group)
    model, _ = mlx_lm.load(str(out))
    want = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    logits = {}
    for backend, tol in (("mlx", 1e-4), ("cpu", 1e-2)):
        ours = _ours(out, backend)
        assert isinstance(ours.transformer.layers[0].down_proj, QuantizedWeight)
        logits[backend] = ours.logits(ids)
        assert rel_err(logits[backend], want) < tol, backend
    assert rel_err(logits["cpu"], logits["mlx"]) < 1e-2


@pytest.mark.parametrize(
    "source,quant,group,stored",
    [
        ("dense", "int4", 64, ("affine", 4, 64)),
        # g32, fp4, fp8 and nvfp4 take 10-25 s each on 2 cores: -m long (group 64 and the
        # GGUF run by default; mxfp8 read back runs above; the formats' logits: test_quantized)
        pytest.param("dense", "int4", 32, ("affine", 4, 32), marks=pytest.mark.long),
        pytest.param("dense", "fp4", None, ("mxfp4", 4, 32), marks=pytest.mark.long),
        pytest.param("dense", "fp8", None, ("mxfp8", 8, 32), marks=pytest.mark.long),
        pytest.param("dense", "nvfp4", None, ("nvfp4", 4, 16), marks=pytest.mark.long),
        # the Q4_1 GGUF itself: linears copied as stored, the Q8_0 embedding re-quantized
        ("smollm2", "int4", None, ("affine", 4, 32)),
    ],
)
def test_mlx_lm_runs_mlxrun_converted_checkpoint(
    dense, ids, tmp_path, source, quant, group, stored
):
    out = tmp_path / "ours"
    src = str(dense) if source == "dense" else source
    notes = convert(src, str(out), quant=quant, group_size=group, progress=False)
    assert len(notes) == (0 if source == "dense" else 2)
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert from_config(q) == QuantSpec(*stored)
    model, _ = mlx_lm.load(str(out))
    ours = _ours(out, "mlx")
    prompt = ids  # a short plain prompt: the MLX CPU prefill is slow
    theirs = [
        int(t) for t, _ in mlx_lm_generate.generate_step(mx.array(prompt), model, max_tokens=16)
    ]
    mine = [
        int(t[0])
        for t in generate_step(ours.transformer, [prompt], SamplingParams(), max_tokens=16)
    ]
    assert len(theirs) == 16
    assert mine == theirs
