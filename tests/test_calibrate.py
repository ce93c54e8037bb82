"""Calibrated quantization (quant/calibrate.py, its numerics in quant/calib_search.py): lower
output error than rounding to nearest at the same bytes, stored bytes in MLX's layout, and
`mlxrun convert --calibrate` output that mlx-lm loads with the logits mlxrun computes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxrun.cli import main
from mlxrun.convert import convert
from mlxrun.quant.calib_search import (
    fake_quant,
    gptq_codes,
    make_grid,
    output_error,
    search_clip,
    search_scales,
)
from mlxrun.quant.calibrate import CalibOptions, calib_text, calib_windows
from mlxrun.quant.formats import resolve

from .test_cli_errors import assert_one_line_error, run_cli

SPECS = [resolve("int4", group_size=64), resolve("int4", group_size=32), resolve("fp4")]


def _layer(seed=0, out=96, inp=256, n=2048):
    """A weight and activations with a few loud input channels, as real layers have."""
    rng = np.random.default_rng(seed)
    w = (0.05 * rng.standard_normal((out, inp))).astype(np.float32)
    loud = np.ones(inp, np.float32)
    loud[rng.choice(inp, 8, replace=False)] = 20.0
    x = (rng.standard_normal((n, inp)) * loud).astype(np.float32)
    h = x.T @ x / n
    return w, x, h, np.abs(x).mean(0)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-g{s.group_size}")
def test_calibrated_layer_has_lower_output_error_than_rtn(spec):
    w, x, h, xmean = _layer()
    y = x @ w.T
    rtn = fake_quant(w, spec, "float32")
    err_rtn = float(((x @ rtn.T - y) ** 2).sum())
    # output_error from H is the activations' squared error
    assert output_error(rtn - w, h) * len(x) == pytest.approx(err_rtn, rel=1e-3)
    s = search_scales([w], x[:512], xmean, spec, "float32", 20)
    ws, hs = w * s, h / np.outer(s, s)
    grid = make_grid(ws, spec, "float32", search_clip(ws, hs, spec, "float32"))
    awq = grid.values(grid.codes(ws)) / s
    err_awq = float(((x @ awq.T - y) ** 2).sum())
    gq = grid.values(gptq_codes(ws, hs, grid)) / s
    err_gptq = float(((x @ gq.T - y) ** 2).sum())
    assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)
    assert err_gptq < err_awq, (err_gptq, err_awq)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-g{s.group_size}")
def test_stored_bytes_are_mlx_layout(spec):
    mx = pytest.importorskip("mlx.core")
    w, _, h, _ = _layer(1)
    grid = make_grid(w, spec, "float32", np.full((96, 256 // spec.group_size), 0.8, np.float32))
    q = gptq_codes(w, h, grid)
    t = grid.tensors(q)
    extra = {} if spec.mode == "affine" else {"mode": spec.mode}
    deq = mx.dequantize(
        mx.array(t["weight"]),
        mx.array(t["scales"]),
        mx.array(t["biases"]) if "biases" in t else None,
        group_size=spec.group_size,
        bits=spec.bits,
        dtype=mx.float32,
        **extra,
    )
    np.testing.assert_allclose(np.array(deq), grid.values(q), rtol=1e-6, atol=1e-7)
    if spec.mode == "affine":  # unclipped: the same bytes as mx.quantize
        g0 = make_grid(w, spec, "float32")
        ref = mx.quantize(mx.array(w), group_size=spec.group_size, bits=spec.bits)
        assert (np.array(ref[0]) == g0.tensors(g0.codes(w))["weight"]).all()


def test_calib_windows_are_seeded_and_checked(tmp_path):
    opts = CalibOptions(samples=3, seq_len=10, seed=1)
    a, b = calib_windows(list(range(100)), opts), calib_windows(list(range(100)), opts)
    assert a.shape == (3, 10) and (a == b).all() and (a[:, 0] % 10 == 0).all()
    with pytest.raises(Exception, match="gives 25 tokens, 2 windows of 10"):
        calib_windows(list(range(25)), opts)
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert calib_text(str(f)) == "one\n\ntwo"
    f.write_text('{"txt": "one"}\n')
    with pytest.raises(Exception, match='line 1 has no string "text" field'):
        calib_text(str(f))
    assert len(calib_text(None).split()) > 4000  # the bundled text


def _calib_file(tmp_path, vocab=96, n=2000):
    rng = np.random.default_rng(0)
    f = tmp_path / "calib.txt"
    f.write_text(" ".join(f"w{i}" for i in rng.integers(3, vocab, n)))
    return f


def test_convert_calibrate_errors(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(
        capsys, "convert", "-m", str(d), "-o", str(tmp_path / "o"), "--calibrate", "awq"
    )
    assert_one_line_error(code, err, "--calibrate needs --quant")
    f = _calib_file(tmp_path, n=50)
    code, err = run_cli(
        capsys,
        *("convert", "-m", str(d), "-o", str(tmp_path / "o"), "--quant", "int4"),
        *("--calibrate", "awq", "--calib-data", str(f), "--calib-seq-len", "32"),
    )
    assert_one_line_error(code, err, "calibration text gives 50 tokens")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("method,name", [("awq", "qwen2_bias"), ("gptq", "llama_gqa_tied")])
def test_convert_calibrated_loads_in_mlx_lm_with_our_logits(tiny_dir, tmp_path, method, name):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlxrun

    d, hf = tiny_dir(name)
    f = _calib_file(tmp_path)
    out = tmp_path / "q"
    with pytest.raises(SystemExit) as e:
        main(
            [
                *("convert", "-m", str(d), "-o", str(out), "--quant", "int4", "--group-size"),
                *("32", "--calibrate", method, "--calib-data", str(f)),
                *("--calib-samples", "4", "--calib-seq-len", "64"),
            ]
        )
    assert e.value.code in (0, None)
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["bits"] == 4 and q["group_size"] == 32
    ids = np.array([[1, 5, 17, 40, 3, 77, 12, 9]])
    model, _ = mlx_lm.load(str(out))
    theirs = np.array(model(mx.array(ids)).astype(mx.float32))[0]
    ours = mlxrun.load(str(out), backend="cpu", dtype="float32", progress=False)
    mine = ours.transformer.be.to_numpy(
        ours.transformer(ours.transformer.be.ids(ids), ours.transformer.make_cache(1, 8))
    )[0]
    np.testing.assert_allclose(mine, theirs, rtol=1e-3, atol=1e-3)
    # and it is a quantization of the model: near the dense logits
    import torch

    with torch.no_grad():
        dense = hf(torch.tensor(ids)).logits[0].numpy()
    assert np.corrcoef(mine.ravel(), dense.ravel())[0, 1] > 0.8


def test_eval_against_scores_a_checkpoint_like_the_same_format(capsys, tiny_dir, tmp_path):
    """A checkpoint converted to int4 g32 holds the bytes that quantize-on-load makes, so
    `--against` it must score exactly as the `int4:g32` row of the same run."""
    from .test_eval_cli import run_cli as run_eval
    from .test_eval_cli import table

    d, _ = tiny_dir("llama_gqa_tied")
    out = tmp_path / "rtn"
    convert(str(d), str(out), quant="int4", group_size=32, progress=False)
    f = _calib_file(tmp_path, n=140)
    code, text, err = run_eval(
        capsys, "eval", "-m", str(d), "-b", "cpu", "--quant", "int4:g32",
        "--against", str(out), "--text", str(f), "--window", "64",
    )  # fmt: skip
    assert code == 0, err
    rows = table(text)
    assert list(rows) == ["int4 g32", str(out)]
    assert rows[str(out)] == rows["int4 g32"] and rows["int4 g32"][2] > 0
    code, err = run_cli(capsys, "eval", "-m", str(d), "--text", str(f))
    assert_one_line_error(code, err, "eval needs --quant")
