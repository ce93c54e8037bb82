"""`convert --calibrate ... --target-bpw X`: per-layer widths from measured sensitivity,
within the size asked, written as mlx-lm's per-layer overrides, loading in mlx-lm with
mlxrun's logits, and closer to the dense model than uniform 4-bit at the same bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from mlxrun.against import against_candidates
from mlxrun.cli import main
from mlxrun.convert import convert
from mlxrun.evaluate import evaluate_many
from mlxrun.loader import open_checkpoint
from mlxrun.quant.calibrate import CalibOptions
from mlxrun.quant.formats import resolve
from mlxrun.quant.mixed_bits import BITS, allocate, matrix_bytes

from .test_calibrate import _calib_file
from .test_cli_errors import assert_one_line_error, run_cli


def file_bpw(d) -> float:
    """Bits per weight of every quantized matrix in a converted directory: packed codes,
    scales and biases over the weights they hold (each at its own width)."""
    t = load_file(str(d / "model.safetensors"))
    q = json.loads((d / "config.json").read_text())["quantization"]
    nbytes = nweights = 0
    for k, v in t.items():
        if k.endswith(".scales"):
            p = k.removesuffix(".scales")
            nweights += t[p + ".weight"].size * 32 // q.get(p, q)["bits"]
            nbytes += v.nbytes + t[p + ".biases"].nbytes + t[p + ".weight"].nbytes
    return 8 * nbytes / nweights


def test_allocate_meets_the_budget_and_spends_it_where_it_pays():
    spec = resolve("int4", group_size=64)
    shapes = {"a": (256, 256), "b": (256, 256), "c": (256, 512)}
    # b is 20x as sensitive as a at every width; c as a; errors fall 4x per bit
    errs = {n: {b: f * 4.0 ** (4 - b) for b in BITS} for n, f in (("a", 1), ("b", 20), ("c", 1))}
    uniform = sum(matrix_bytes(s, spec, "float32") for s in shapes.values())
    n = sum(o * i for o, i in shapes.values())
    got = allocate(errs, shapes, spec, "float32", 8 * uniform / n, 0.0, 0)
    assert sum(matrix_bytes(shapes[k], resolve("int4", 64), "float32") for k in "abc") == uniform
    spent = sum(
        matrix_bytes(shapes[k], type(spec)("affine", b, 64), "float32") for k, b in got.items()
    )
    assert spent <= uniform
    assert got["b"] > 4 and min(got["a"], got["c"]) < 4
    assert sum(errs[k][b] for k, b in got.items()) < sum(e[4] for e in errs.values())
    with pytest.raises(Exception, match="below the smallest size reachable"):
        allocate(errs, shapes, spec, "float32", 3.0, 0.0, 0)


def test_target_bpw_file_is_within_size_loads_in_mlx_lm_and_beats_uniform(tiny_dir, tmp_path):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlxrun

    d, _ = tiny_dir("llama_gqa_tied")
    f = _calib_file(tmp_path)
    uni = tmp_path / "uniform"
    opts = CalibOptions("awq", str(f), 4, 64)
    convert(str(d), str(uni), "int4", 32, progress=False, calibrate=opts)
    target = file_bpw(uni)  # 6.0: 4-bit codes + float32 scale and bias per 32
    mixed = tmp_path / "mixed"
    with pytest.raises(SystemExit) as e:
        main(
            [
                *("convert", "-m", str(d), "-o", str(mixed), "--quant", "int4", "--group-size"),
                *("32", "--calibrate", "awq", "--calib-data", str(f), "--calib-samples", "4"),
                *("--calib-seq-len", "64", "--target-bpw", str(target)),
            ]
        )
    assert e.value.code in (0, None)
    assert target - 0.25 < file_bpw(mixed) <= target
    q = json.loads((mixed / "config.json").read_text())["quantization"]
    widths = {v["bits"] for k, v in q.items() if k.startswith("model.layers.")}
    assert len(widths) >= 2 and widths != {4}  # per-layer overrides, mlx-lm's format
    ids = np.array([[1, 5, 17, 40, 3, 77, 12, 9]])
    model, _ = mlx_lm.load(str(mixed))
    theirs = np.array(model(mx.array(ids)).astype(mx.float32))[0]
    ours = mlxrun.load(str(mixed), backend="cpu", dtype="float32", progress=False)
    tr = ours.transformer
    mine = tr.be.to_numpy(tr(tr.be.ids(ids), tr.make_cache(1, 8)))[0]
    np.testing.assert_allclose(mine, theirs, rtol=1e-3, atol=1e-3)
    # closer to the dense model than uniform 4-bit at the same bytes, on other text
    rng = np.random.default_rng(7)
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"w{i}" for i in rng.integers(3, 96, 520)))
    extra = against_candidates(open_checkpoint(str(d)), [str(uni), str(mixed)], "cpu", "float32")
    r = evaluate_many(str(d), [], text=str(text), max_tokens=512, window=64, extra=extra)
    u, m = r.results
    assert m.bytes_per_weight <= u.bytes_per_weight
    assert m.kl < 0.9 * u.kl, (m.kl, u.kl)


def test_target_bpw_errors(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    out = str(tmp_path / "o")
    code, err = run_cli(capsys, "convert", "-m", str(d), "-o", out, "--quant", "int4",
                        "--target-bpw", "4.5")  # fmt: skip
    assert_one_line_error(code, err, "--target-bpw needs --calibrate")
    f = _calib_file(tmp_path)
    code, err = run_cli(
        capsys,
        *("convert", "-m", str(d), "-o", out, "--quant", "int4", "--calibrate", "awq"),
        *("--calib-data", str(f), "--calib-samples", "2", "--calib-seq-len", "32"),
        *("--target-bpw", "3.2"),
    )
    assert_one_line_error(code, err, "below the smallest size reachable")
    assert not (tmp_path / "o").exists()
