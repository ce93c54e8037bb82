"""Hostile and careless inputs: each ends in one MlxrunError line naming what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxrun.cli import main
from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError

from .conftest import TINY
from .test_cli_errors import assert_one_line_error, copy_tiny, run_cli

BASE = dict(TINY["llama_gqa_tied"])


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"hidden_size": "big"}, ["hidden_size is 'big'", "positive integer"]),
        ({"num_hidden_layers": -1}, ["num_hidden_layers is -1", "positive integer"]),
        ({"num_hidden_layers": 0}, ["num_hidden_layers is 0"]),
        ({"vocab_size": 9.5}, ["vocab_size is 9.5"]),
        ({"num_attention_heads": True}, ["num_attention_heads is True"]),
        ({"intermediate_size": None}, ["intermediate_size is None"]),
        (
            {"num_key_value_heads": 3},
            ["num_key_value_heads is 3", "divisor of num_attention_heads"],
        ),
        ({"hidden_size": 66}, ["hidden_size is 66", "multiple of 2 x num_attention_heads"]),
        ({"head_dim": 15}, ["head_dim is 15", "even"]),
        ({"head_dim": "16"}, ["head_dim is '16'"]),
        ({"rms_norm_eps": -1e-5}, ["rms_norm_eps is -1e-05", "positive finite"]),
        ({"rms_norm_eps": float("nan")}, ["rms_norm_eps is nan"]),
        ({"rope_theta": "1e4"}, ["rope_theta is '1e4'"]),
        ({"max_position_embeddings": 2**40}, ["max_position_embeddings is 1099511627776"]),
        ({"tie_word_embeddings": "yes"}, ["tie_word_embeddings is 'yes'", "true or false"]),
        ({"eos_token_id": [2, "x"]}, ["eos_token_id is [2, 'x']", "token id"]),
        ({"bos_token_id": -1}, ["bos_token_id is -1"]),
        ({"rope_scaling": "llama3"}, ["rope_scaling is 'llama3'"]),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 0}},
            ["rope_scaling.factor is 0", "positive finite"],
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4}},
            ["rope_scaling.high_freq_factor is 4.0", "greater than low_freq_factor"],
        ),
        ({"rope_scaling": {"type": ["linear"]}}, ["rope_scaling.rope_type is ['linear']"]),
        ({"rope_parameters": {"rope_theta": 0}}, ["rope_parameters.rope_theta is 0"]),
        ({"quantization": [4]}, ["quantization is [4]"]),
        ({"quantization": {"bits": 4, "mode": ["affine"]}}, ["quantization.mode is ['affine']"]),
    ],
)
def test_config_values_name_field_value_and_rule(change, needles):
    with pytest.raises(MlxrunError) as e:
        ModelConfig.from_dict({**BASE, **change})
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_valid_configs_still_parse():
    dims = {name: ModelConfig.from_dict(dict(kw)).head_dim for name, kw in TINY.items()}
    assert dims == {n: 32 if n == "qwen3_qknorm" else 16 for n in TINY}
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "head_dim": 0}
    c = ModelConfig.from_dict({**BASE, **rope, "eos_token_id": [2, 1], "bos_token_id": None})
    assert (c.rope_theta, c.head_dim, c.eos_token_id) == (5e5, 16, (2, 1))


def test_config_string_size_on_the_cli(capsys, tiny_dir, tmp_path):
    d = copy_tiny(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = -2
    (d / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu", "-p", "w3")
    assert_one_line_error(code, err, "num_hidden_layers is -2", "positive integer")


# ------------------------------------------------------------------------- chat templates


def _tokenizer(template: str):
    from mlxrun.tokenizer import Tokenizer

    from .conftest import word_tokenizer_json

    return Tokenizer.from_json(word_tokenizer_json(8), {"chat_template": template}, set())


@pytest.mark.parametrize(
    "template, why",
    [
        ("{{ cycler.__init__.__globals__ }}", "access to attribute '__init__'"),
        ("{{ range(10**9) | list }}", "Range too big"),
        ('{{ "a" * 10**8 }}', "a repeat of 1 x 100000000 is over the limit"),
        ("{{ 2 ** (10 ** 6) }}", "an exponent of 1000000 is over the limit"),
        ("{{ messages.append(1) }}", "access to attribute 'append'"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without end"),
        ("{% for m in messages %}", "TemplateSyntaxError"),
    ],
)
def test_refused_chat_template_is_one_line(template, why):
    with pytest.raises(MlxrunError) as e:
        _tokenizer(template).apply_chat_template([{"role": "user", "content": "w3"}])
    msg = str(e.value)
    assert msg.startswith("the checkpoint's chat template was refused: "), msg
    assert why in msg and "--no-chat skips it" in msg and "\n" not in msg


def test_bounded_sandbox_still_renders_ordinary_templates():
    t = _tokenizer('{{ messages[0].content | upper }} {{ 2 ** 10 }} {{ "ab" * 3 }}')
    assert t.apply_chat_template([{"role": "user", "content": "w3"}]) == "W3 1024 ababab"


def test_refused_chat_template_on_the_cli(capsys, tiny_dir, tmp_path):
    d = copy_tiny(tiny_dir, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    args = ("generate", "--model", str(d), "--backend", "cpu", "-p", "w3", "--max-tokens", "2")
    code, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, "chat template was refused", "unsafe", "--no-chat")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--no-chat"])
    assert e.value.code == 0


# ------------------------------------------------------------------------ killed convert


def test_convert_removes_partial_directories_of_dead_processes(tiny_dir, tmp_path):
    import subprocess
    import sys

    from mlxrun.convert import convert

    d, _ = tiny_dir("llama_gqa_tied")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".int4.partial-{dead.pid}"  # what a SIGKILLed convert leaves
    left.mkdir()
    (left / ".part-0.safetensors").write_bytes(b"x" * 64)
    running = tmp_path / ".other.partial-1"  # pid 1 is alive: its convert is running
    running.mkdir()
    foreign = tmp_path / f".mine.partial-{dead.pid}"  # holds a folder: not convert's
    (foreign / "sub").mkdir(parents=True)
    notes = convert(str(d), str(tmp_path / "out"), progress=False)
    assert notes[0] == f"removed {left}, left by a convert that was killed"
    assert not left.exists() and running.is_dir() and foreign.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".mine.partial-" + str(dead.pid),
        ".other.partial-1",
        "out",
    ]
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ---------------------------------------------------------------------- non-finite values


def _with_nan(tiny_dir, tmp_path, name="model.layers.1.mlp.down_proj.weight", at=(3, 5)):
    from mlxrun.weights import Tensor, load_safetensors, save_safetensors

    d = copy_tiny(tiny_dir, tmp_path)
    f = d / "model.safetensors"
    tensors = {k: Tensor(t.dtype, np.array(t.data)) for k, t in load_safetensors(f)[0].items()}
    tensors[name].data[at] = np.nan
    save_safetensors(f, tensors)
    return d


@pytest.mark.parametrize("dtype", ["F64", "F32", "F16", "BF16"])
def test_first_nonfinite_finds_nan_and_inf(dtype):
    from mlxrun.weights import Tensor, bf16_bits, first_nonfinite

    x = np.random.default_rng(0).normal(size=(3, 70001)) * 1e3  # crosses chunk edges
    make = {
        "F64": lambda a: Tensor("F64", a),
        "F32": lambda a: Tensor("F32", a.astype(np.float32)),
        "F16": lambda a: Tensor("F16", a.astype(np.float16)),
        "BF16": lambda a: Tensor("BF16", bf16_bits(a.astype(np.float32))),
    }[dtype]
    assert first_nonfinite(make(x)) is None
    for value, at in ((np.inf, (2, 70000)), (-np.inf, (1, 65536)), (np.nan, (0, 9))):
        x[at] = value
        assert first_nonfinite(make(x)) == at[0] * 70001 + at[1]
    assert first_nonfinite(Tensor("U32", np.full(9, 0xFFFFFFFF, np.uint32))) is None


def test_first_nonfinite_byte_codes():
    from mlxrun.weights import Tensor, first_nonfinite

    b = Tensor("U8", np.array([0, 0x7E, 0xFE, 0x80, 0x7F], np.uint8))
    assert first_nonfinite(b, "E8M0") is None  # 0xFF is E8M0's only NaN
    assert first_nonfinite(b, "E4M3") == 4  # 0x7F and 0xFF are E4M3's
    assert first_nonfinite(Tensor("U8", np.array([3, 0xFF], np.uint8)), "E8M0") == 1


def test_nan_weight_is_refused_with_its_name(capsys, tiny_dir, tmp_path):
    d = _with_nan(tiny_dir, tmp_path)
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu", "-p", "w3")
    assert_one_line_error(code, err, "'model.layers.1.mlp.down_proj.weight' holds a NaN", "[3, 5]")
    code, err = run_cli(
        capsys, "generate", "--model", str(d), "-b", "cpu", "-p", "w3", "--quant", "int4"
    )
    assert_one_line_error(code, err, "'model.layers.1.mlp.down_proj.weight' holds a NaN")


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
@pytest.mark.parametrize("temp", ["0", "0.7"])
def test_nan_logits_stop_generation(capsys, tiny_dir, tmp_path, backend, temp):
    d = _with_nan(tiny_dir, tmp_path)
    args = ("generate", "-m", str(d), "-b", backend, "-p", "w3 w4", "--temp", temp)
    code, err = run_cli(capsys, *args, "--max-tokens", "4", "--no-check-weights", "--no-chat")
    assert_one_line_error(code, err, "logits are NaN or infinite at generated token 1")


def test_nan_logits_mid_generation(tiny_dir):
    """A row that turns non-finite after some good tokens stops at that token."""
    import mlxrun
    from mlxrun.generate import generate_step
    from mlxrun.sampling import SamplingParams

    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cpu", progress=False)
    model = m.transformer
    calls = []

    def poisoned(self, *a, **kw):  # the third forward pass (token 3) gives NaN logits
        out = type(self).__mro__[1].__call__(self, *a, **kw)
        calls.append(1)
        return out * float("nan") if len(calls) == 3 else out

    model.__class__ = type("Poisoned", (type(model),), {"__call__": poisoned})
    got = []
    with pytest.raises(MlxrunError, match="at generated token 3 \\(sequence 0\\)"):
        for toks in generate_step(model, [[3, 4]], SamplingParams(), 5):
            got.append(int(toks[0]))
    assert len(got) == 2


def test_nan_packed_scale_is_refused(tiny_dir, tmp_path):
    import mlxrun
    from mlxrun.convert import convert
    from mlxrun.weights import Tensor, load_safetensors, save_safetensors

    d, _ = tiny_dir("llama_gqa_tied")
    out = tmp_path / "fp4"
    convert(str(d), str(out), quant="fp4", progress=False)
    f = out / "model.safetensors"
    tensors = {k: Tensor(t.dtype, np.array(t.data)) for k, t in load_safetensors(f)[0].items()}
    tensors["model.layers.0.mlp.up_proj.scales"].data[1, 0] = 0xFF  # E8M0 NaN
    save_safetensors(f, tensors)
    with pytest.raises(MlxrunError) as e:
        mlxrun.load(str(out), backend="cpu", progress=False)
    assert "'model.layers.0.mlp.up_proj.scales' holds a NaN" in str(e.value)
    assert "E8M0" in str(e.value)


# ------------------------------------------------------------------- GGUF metadata types


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("llama.block_count", "x", "llama.block_count is 'x'"),
        ("llama.attention.layer_norm_rms_epsilon", "e", "layer_norm_rms_epsilon is 'e'"),
        ("tokenizer.ggml.bos_token_id", "s", "bos_token_id is 's'"),
        ("tokenizer.ggml.model", 3, "tokenizer.ggml.model is 3"),
        ("llama.attention.head_count", 0, "llama.attention.head_count is 0"),
    ],
)
def test_gguf_metadata_of_the_wrong_type(tmp_path, monkeypatch, key, value, needle):
    import gguf

    from mlxrun.loader import open_checkpoint

    from . import test_gguf

    real = gguf.GGUFWriter

    def writer(path, arch):  # the tiny GGUF, with `key` replaced just before writing
        w = real(path, arch)
        header = w.write_header_to_file

        def patched(*a, **kw):
            w.kv_data[0].pop(key, None)
            add = w.add_string if isinstance(value, str) else w.add_uint32
            add(key, value)
            return header(*a, **kw)

        w.write_header_to_file = patched
        return w

    monkeypatch.setattr(test_gguf.gguf, "GGUFWriter", writer)
    p = tmp_path / "t.gguf"
    test_gguf.write_synthetic(p)
    with pytest.raises(MlxrunError) as e:
        open_checkpoint(str(p))
    assert needle in str(e.value) and "\n" not in str(e.value)
