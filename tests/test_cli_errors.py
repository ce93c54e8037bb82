"""Bad input: one line on stderr, exit status 1, no traceback, nothing half-written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from mlxrun.cli import main


def run_cli(capsys, *args):
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.err


def assert_one_line_error(code, err, *needles):
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxrun: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def copy_tiny(tiny_dir, tmp_path, name="llama_gqa_tied"):
    d, _ = tiny_dir(name)
    dst = tmp_path / name
    shutil.copytree(d, dst)
    return dst


def test_path_does_not_exist(capsys, tmp_path):
    code, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert_one_line_error(code, err, "no such file or directory")


def test_directory_without_config(capsys, tmp_path):
    code, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert_one_line_error(code, err, "has no config.json")


def test_truncated_safetensors(capsys, tiny_dir, tmp_path):
    d = copy_tiny(tiny_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu")
    assert_one_line_error(code, err, "truncated", "re-download")


def test_corrupt_safetensors_header(capsys, tiny_dir, tmp_path):
    d = copy_tiny(tiny_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu")
    assert_one_line_error(code, err, "corrupt safetensors header")


def _rewrite_tensors(d, edit):
    from mlxrun.weights import load_safetensors, save_safetensors

    tensors, meta = load_safetensors(d / "model.safetensors")
    tensors = {k: type(v)(v.dtype, v.data.copy()) for k, v in tensors.items()}
    edit(tensors)
    save_safetensors(d / "model.safetensors", tensors, meta)


def test_missing_tensor(capsys, tiny_dir, tmp_path):
    d = copy_tiny(tiny_dir, tmp_path)
    _rewrite_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu")
    assert_one_line_error(code, err, "model.layers.1.mlp.up_proj.weight")


def test_wrong_shape(capsys, tiny_dir, tmp_path):
    d = copy_tiny(tiny_dir, tmp_path)

    def edit(t):
        w = t["model.layers.0.self_attn.k_proj.weight"]
        t["model.layers.0.self_attn.k_proj.weight"] = type(w)(w.dtype, w.data[:16].copy())

    _rewrite_tensors(d, edit)
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu")
    assert_one_line_error(
        code, err, "model.layers.0.self_attn.k_proj.weight", "[16, 64]", "[32, 64]"
    )


def test_unknown_model_type(capsys, tiny_dir, tmp_path):
    d = copy_tiny(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu")
    assert_one_line_error(code, err, "gpt_neox", "llama, mistral, qwen2, qwen3")


def test_empty_prompt(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(capsys, "generate", "--model", str(d), "--prompt", "  ")
    assert_one_line_error(code, err, "prompt is empty")


def test_max_tokens_zero(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(capsys, "generate", "--model", str(d), "--max-tokens", "0")
    assert_one_line_error(code, err, "--max-tokens")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_cuda_without_cuda(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cuda")
    assert_one_line_error(code, err, "no CUDA GPU", "--backend cpu")


def test_mlx_not_installed(capsys, tiny_dir, monkeypatch):
    import mlxrun.backends.mlx_backend as mb

    monkeypatch.setattr(mb, "mx", None)
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "mlx")
    assert_one_line_error(code, err, "pip install 'mlxrun[mlx]'")


def test_hub_id_offline(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    code, err = run_cli(capsys, "generate", "--model", "someorg/not-cached-model")
    assert_one_line_error(code, err, "not in the local cache", "smollm2")


def test_entry_point_prints_no_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mlxrun", "generate", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("mlxrun: error: ") and "Traceback" not in r.stderr


def test_convert_failure_leaves_nothing(tmp_path, tiny_dir):
    from mlxrun.convert import convert
    from mlxrun.errors import MlxrunError

    d = copy_tiny(tiny_dir, tmp_path)
    out = tmp_path / "out"
    (d / "tokenizer.json").unlink()
    with pytest.raises(MlxrunError):
        convert(str(d), str(out), progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


# ---------------------------------------------------------------- quantization input


def _edit_quant(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for block in ("quantization", "quantization_config"):
        cfg[block].update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_quant_name_cli(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu",
                        "--quant", "int3")  # fmt: skip
    assert_one_line_error(code, err, "unknown quantization format 'int3'", "int4", "nvfp4")
    code, err = run_cli(capsys, "convert", "--model", str(d), "--quant", "q4_k",
                        "-o", str(tmp_path / "out"))  # fmt: skip
    assert_one_line_error(code, err, "unknown quantization format 'q4_k'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command,args,needle",
    [
        ("generate", ["--quant", "fp4", "--group-size", "64"], "group size 64 is not allowed"),
        ("generate", ["--quant", "int4", "--group-size", "48"], "use 32, 64 or 128"),
        ("generate", ["--quant", "int4", "--bits", "8"], "int4 stores 4-bit values, not 8-bit"),
        ("convert", ["--quant", "nvfp4", "--group-size", "32"], "use 16"),
        ("convert", ["--quant", "fp8", "--bits", "4"], "fp8 stores 8-bit values, not 4-bit"),
        ("convert", ["--group-size", "64"], "give --quant too"),
    ],
)
def test_group_size_or_bits_not_allowed_cli(capsys, tiny_dir, tmp_path, command, args, needle):
    d, _ = tiny_dir("llama_gqa_tied")
    out = ["-o", str(tmp_path / "out")] if command == "convert" else ["--backend", "cpu"]
    code, err = run_cli(capsys, command, "--model", str(d), *out, *args)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_checkpoint_with_unknown_mode_cli(capsys, int4_tiny, tmp_path):
    d = _edit_quant(int4_tiny, tmp_path / "bad", mode="int3")
    for args in (
        ["generate", "--model", str(d), "--backend", "cpu"],
        ["generate", "--model", str(d), "--backend", "mlx", "--quant", "int8"],
        ["convert", "--model", str(d), "--quant", "int8", "-o", str(tmp_path / "out")],
    ):
        code, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, "quantization mode 'int3' is not supported", "mxfp8")
    assert not (tmp_path / "out").exists()


def test_packed_shapes_do_not_match_config_cli(capsys, int4_tiny, tmp_path):
    d = _edit_quant(int4_tiny, tmp_path / "bad", bits=8)  # the files hold 4-bit values
    for backend in ("cpu", "mlx"):
        code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", backend)
        assert_one_line_error(
            code,
            err,
            "'model.embed_tokens.weight' has shape [96, 8] but config.json implies [96, 16]",
        )
    code, err = run_cli(capsys, "convert", "--model", str(d), "--quant", "fp8",
                        "-o", str(tmp_path / "out"))  # fmt: skip
    assert_one_line_error(code, err, "'model.embed_tokens.scales' is shape [96, 2]",
                          "int8 (affine) g32 implies [96, 1]")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_format_the_backend_cannot_run_cli(capsys, tiny_dir, tmp_path, monkeypatch):
    """A 3-bit mlx-lm checkpoint on CUDA (whose kernels take 4/8-bit only), on a machine
    without a GPU: a PyTorch-CPU backend that says it is cuda stands in for it."""
    import mlxrun.backends
    import mlxrun.planning
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.dense import quantize_tensors
    from mlxrun.loader import open_checkpoint
    from mlxrun.memory import probe_device
    from mlxrun.quant.formats import QuantSpec, to_config
    from mlxrun.weights import save_safetensors

    d, _ = tiny_dir("llama_gqa_tied")
    q3 = tmp_path / "q3"
    shutil.copytree(d, q3)
    spec = QuantSpec("affine", 3, 64)
    tensors, _ = quantize_tensors(open_checkpoint(str(d)).tensors, spec)
    save_safetensors(q3 / "model.safetensors", tensors)
    cfg = json.loads((q3 / "config.json").read_text())
    cfg["quantization"] = cfg["quantization_config"] = to_config(spec)
    (q3 / "config.json").write_text(json.dumps(cfg))

    def fake_cuda(name="auto", dtype=None):
        be = TorchBackend("cpu", dtype or "float32")
        be.device = "cuda"
        return be

    monkeypatch.setattr(mlxrun.backends, "get_backend", fake_cuda)
    monkeypatch.setattr(mlxrun.planning, "probe_device", lambda b, dev: probe_device(b, "cpu"))
    code, err = run_cli(capsys, "generate", "--model", str(q3), "--backend", "cuda",
                        "--max-tokens", "2")  # fmt: skip
    assert_one_line_error(
        code, err, "model.embed_tokens is stored as int3 (affine) g64, which --backend cuda "
        "cannot run", "use --backend cpu or mlx", "--quant int4"
    )  # fmt: skip


def test_convert_refuses_a_non_empty_directory(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "convert", "--model", str(d), "--quant", "int4", "-o", str(out))
    assert_one_line_error(code, err, "already exists and is not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left
