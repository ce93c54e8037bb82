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
