"""Quantized checkpoints as convert writes them and as sources read again: shards with an
index, mx.quantize's bytes, a stored format kept, re-quantized or dequantized (on load, by
convert, from the CLI) equal to the same done to the dequantized values, and a repacking
backend's embedding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxrun.backends import get_backend
from mlxrun.backends.base import QuantizedWeight
from mlxrun.build import build_model
from mlxrun.convert import convert
from mlxrun.dense import save_dense
from mlxrun.evaluate import window_logits
from mlxrun.loader import open_checkpoint
from mlxrun.quant.formats import resolve, to_config
from mlxrun.weights import Tensor

from .conftest import rel_err
from .test_quantized import IDS, _load

pytest.importorskip("mlx.core")


def _dense_twin(src, tmp_path):
    """The dense float32 checkpoint whose weights are the numpy reference's dequantization
    of `src`'s stored bytes: the oracle for re-quantizing `src`."""
    return save_dense(str(src), tmp_path / "dense_twin", "float32")


def _build(path, backend, quant=None, group=None, dense=False):
    """build_model on a checkpoint as `mlxrun.load` does (quant: a --quant name)."""
    ck = open_checkpoint(str(path))
    spec = None if quant is None else resolve(quant, group_size=group)
    be = get_backend(backend, "float32")
    return build_model(
        ck.config, ck.tensors, be, spec, progress=False, dense=dense, group_asked=group is not None
    )


def _logits(transformer):
    return window_logits(transformer, np.asarray(IDS))


@pytest.mark.parametrize("backend", ["mlx", "cpu"])
def test_requested_format_already_stored_keeps_the_bytes(converted, backend):
    src = converted("int4", 32)
    stored, notes0 = _build(src, backend)
    for group in (None, 32):  # no group asked, or the stored one
        model, notes = _build(src, backend, "int4", group)
        assert notes == [
            "16 stored layer(s) already are int4 (affine): keeping their stored weights"
        ]
        down = model.layers[0].down_proj
        assert isinstance(down, QuantizedWeight) and down.group_size == 32
        assert np.array_equal(_logits(model), _logits(stored))
    assert notes0 == []


@pytest.mark.parametrize("backend", ["mlx", "cpu"])
@pytest.mark.parametrize("quant,group", [("int4", 64), ("int8", None), ("fp8", None),
                                         ("fp4", None), ("nvfp4", None)])  # fmt: skip
def test_requantize_equals_quantizing_the_dequantized_values(
    converted, tmp_path, backend, quant, group
):
    src = converted("int4", 32)
    model, notes = _build(src, backend, quant, group)
    # the oracle: the stored layers dequantized by the numpy reference, then quantized on
    # load as a dense checkpoint is (mx.quantize / the reference, bit-exact with it)
    twin = _dense_twin(src, tmp_path)
    spec = resolve(quant, group_size=group if group else 32 if quant == "int8" else None)
    want, _ = _build(twin, backend, quant, spec.group_size)
    down = model.layers[0].down_proj
    assert (down.mode, down.bits, down.group_size) == (spec.mode, spec.bits, spec.group_size)
    assert rel_err(_logits(model), _logits(want)) < 1e-6
    assert len(notes) == 1 and notes[0].startswith(
        f"re-quantizing 16 layer(s) from a quantized source (int4 (affine) g32) to {spec.label}"
    )


@pytest.mark.parametrize("backend", ["mlx", "cpu"])
def test_quant_none_dequantizes_stored_layers(converted, tmp_path, backend):
    src = converted("fp4", None)
    model, notes = _build(src, backend, dense=True)
    assert notes == ["--quant none: dequantized 16 stored layer(s) to float32"]
    assert not isinstance(model.layers[1].up_proj, QuantizedWeight)
    stored, _ = _build(src, backend)
    want, _ = _build(_dense_twin(src, tmp_path), backend)
    assert rel_err(_logits(model), _logits(want)) < 1e-6
    assert rel_err(_logits(model), _logits(stored)) < 1e-5


def test_convert_from_quantized_source(converted, tmp_path):
    from mlxrun.weights import load_safetensors

    src = converted("int4", 32)
    twin = _dense_twin(src, tmp_path)
    # same format: the stored bytes are copied
    kept = tmp_path / "kept"
    notes = convert(str(src), str(kept), quant="int4", progress=False)
    assert notes == ["16 stored layer(s) already are int4 (affine): copied without change"]
    assert (kept / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    # another format: equal to converting the dequantized values
    for quant in ("int8", "nvfp4"):
        a, b = tmp_path / f"re_{quant}", tmp_path / f"twin_{quant}"
        notes = convert(str(src), str(a), quant=quant, group_size=None, progress=False)
        assert notes[0].startswith("re-quantized 16 layer(s) from a quantized source")
        group = 32 if quant == "int8" else None  # int8 keeps the source's group size
        convert(str(twin), str(b), quant=quant, group_size=group, progress=False)
        ta, tb = (
            load_safetensors(a / "model.safetensors")[0],
            load_safetensors(b / "model.safetensors")[0],
        )
        assert set(ta) == set(tb)
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and np.array_equal(ta[k].data, tb[k].data), k
        assert (
            json.loads((a / "config.json").read_text())["quantization"]
            == json.loads((b / "config.json").read_text())["quantization"]
        )
    # none: the dequantized values, no quantization block
    dense = tmp_path / "dense"
    assert convert(str(src), str(dense), quant="none", progress=False) == [
        "--quant none: dequantized 16 stored layer(s)"
    ]
    cfg = json.loads((dense / "config.json").read_text())
    assert "quantization" not in cfg and "quantization_config" not in cfg
    td, tt = (
        load_safetensors(dense / "model.safetensors")[0],
        load_safetensors(twin / "model.safetensors")[0],
    )
    assert set(td) == set(tt) and all(np.array_equal(td[k].data, tt[k].data) for k in td)


def test_convert_writes_shards_with_an_index(wide, tmp_path):
    from mlxrun.weights import load_safetensors

    out = tmp_path / "sharded"
    limit = 40_000  # bytes: WIDE int4 g64 is ~150 kB, so several shards
    convert(str(wide), str(out), quant="int4", progress=False, shard_bytes=limit)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total, names = 0, set()
    for f in files:
        tensors = load_safetensors(out / f)[0]
        size = sum(t.nbytes for t in tensors.values())
        assert size <= limit or len(tensors) == 1
        assert all(index["weight_map"][k] == f for k in tensors)
        names |= set(tensors)
        total += size
    assert names == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"] == to_config(resolve("int4"))
    one = tmp_path / "one"
    convert(str(wide), str(one), quant="int4", progress=False)
    assert np.array_equal(_load(out, "mlx").logits(IDS), _load(one, "mlx").logits(IDS))
    assert not list(tmp_path.glob(".*partial*"))


def test_repacking_backend_keeps_the_embedding_bytes(converted):
    """A backend that repacks packed weights for its kernels (PyTorch with the Triton
    kernels, as on CUDA) keeps only the repack of a linear, but the embedding's rows are
    gathered, so its canonical bytes stay: a lookup gives the reference's dequantized rows.
    The repack itself needs no GPU."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import stored_dense

    pytest.importorskip("triton")
    be = TorchBackend("cpu", "float32")
    be.triton_kernels = True
    ck = open_checkpoint(str(converted("int4", 32)))
    rows = [3, 7, 100]
    for quant in (None, "int8"):  # the stored bytes, and re-quantized on load
        spec = resolve(quant or "int4", group_size=32)
        model, _ = build_model(ck.config, ck.tensors, be, quant and spec, progress=False)
        q = model.layers[0].q_proj
        assert q.weight is None and q.kernel is not None
        e = model.embed
        parts = [Tensor.from_numpy(be.to_numpy(x)) for x in (e.weight, e.scales, e.biases)]
        parts[0] = Tensor.from_numpy(e.weight.cpu().numpy().view(np.uint32))
        got = be.to_numpy(be.embedding(be.ids(np.asarray([rows])), e))[0]
        assert np.array_equal(got, stored_dense(*parts, spec)[rows]), quant


def _cli(capsys, *args):
    from mlxrun.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    assert e.value.code == 0, out.err
    return out.out, out.err


def test_cli_generate_quant_on_a_quantized_checkpoint(capsys, converted, tmp_path):
    src = converted("int4", 32)
    twin = _dense_twin(src, tmp_path)
    gen = ["--backend", "cpu", "--max-tokens", "4", "--prompt", "w5 w6 w7"]
    for quant, note in (
        ("int4", "note: 16 stored layer(s) already are int4 (affine): keeping"),
        ("nvfp4", "note: re-quantizing 16 layer(s) from a quantized source (int4 (affine) g32)"),
        ("none", "note: --quant none: dequantized 16 stored layer(s) to float32"),
    ):
        out, err = _cli(capsys, "generate", "--model", str(src), "--quant", quant, *gen)
        assert note in err
        # the same text as the oracle: the dequantized copy, quantized on load (or not)
        oracle = _load(twin, "cpu", **({} if quant == "none" else {"quant": quant}))
        if quant == "int4":
            oracle = _load(src, "cpu")
        assert out.strip() == oracle.generate("w5 w6 w7", max_tokens=4).strip()


def test_cli_convert_writes_mx_quantize_bytes(capsys, wide, tmp_path):
    import mlx.core as mx

    from mlxrun.weights import load_safetensors

    out = tmp_path / "fp4"
    _, err = _cli(capsys, "convert", "--model", str(wide), "--quant", "fp4", "-o", str(out))
    assert err == ""
    got = load_safetensors(out / "model.safetensors")[0]
    dense = load_safetensors(wide / "model.safetensors")[0]
    for path in ("model.layers.1.mlp.down_proj", "model.embed_tokens", "lm_head"):
        w, s = mx.quantize(mx.array(dense[f"{path}.weight"].data), 32, 4, mode="mxfp4")
        assert np.array_equal(got[f"{path}.weight"].data, np.array(w)), path
        assert np.array_equal(got[f"{path}.scales"].data, np.array(s)), path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_text() == (wide / name).read_text()
