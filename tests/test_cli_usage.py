"""Everyday CLI use: prompts from stdin, JSONL rows that keep the input's fields, --quiet,
one vocabulary of options across commands, --json."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from mlxrun.cli import cli, main

from .test_cli_errors import assert_one_line_error, run_cli


def invoke(*args, input=None):
    r = CliRunner().invoke(cli, [str(a) for a in args], input=input)
    assert r.exit_code == 0, (r.output, r.exception)
    return r


def tiny_args(tiny_dir, *more):
    d, _ = tiny_dir("llama_gqa_tied")
    return ["generate", "--model", d, "--backend", "cpu", "--no-chat", "--max-tokens", 4, *more]


def test_prompt_dash_reads_stdin(tiny_dir, tmp_path):
    ref, got = tmp_path / "ref.jsonl", tmp_path / "got.jsonl"
    invoke(*tiny_args(tiny_dir, "--prompt", "w5 w6 w7", "-o", ref))
    invoke(*tiny_args(tiny_dir, "--prompt", "-", "-o", got), input="w5 w6 w7\n")
    a, b = json.loads(ref.read_text()), json.loads(got.read_text())
    assert b["prompt"] == "w5 w6 w7" and b["text"] == a["text"] and a["text"]


def test_prompts_dash_reads_stdin_jsonl_and_keeps_ids(tiny_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    lines = '{"id": "a", "prompt": "w5 w6"}\n{"id": 7, "prompt": "w9", "lang": "x"}\n'
    invoke(*tiny_args(tiny_dir, "--prompts", "-", "-o", out), input=lines)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", 7] and rows[1]["lang"] == "x"
    assert [r["prompt"] for r in rows] == ["w5 w6", "w9"]


def test_piped_stdin_is_the_prompt_without_a_flag(capsys, monkeypatch, tiny_dir, tmp_path):
    ref = invoke(*tiny_args(tiny_dir, "--quiet", "--prompt", "w5 w6 w7")).stdout
    piped = tmp_path / "stdin.txt"  # a redirected file, as `mlxrun generate < stdin.txt`
    piped.write_text("w5 w6 w7\n")
    capsys.readouterr()
    with open(piped) as f, pytest.raises(SystemExit) as e:
        monkeypatch.setattr(sys, "stdin", f)
        main([str(a) for a in tiny_args(tiny_dir, "--quiet")])
    assert e.value.code == 0
    assert capsys.readouterr().out == ref and ref.strip()


def test_jsonl_tokens_match_the_stream_stats(tiny_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    # This prompt ends on the end-of-sequence token after one word on this seed.
    r = invoke(*tiny_args(tiny_dir, "--prompt", "w7 w94"))
    streamed = int(r.stderr.split("Generation: ")[1].split()[0])
    invoke(*tiny_args(tiny_dir, "--prompt", "w7 w94", "-o", out))
    row = json.loads(out.read_text())
    assert row["finish_reason"] == "stop" and row["tokens"] == streamed == 2


def test_output_in_a_missing_directory_is_refused_before_loading(capsys, tmp_path):
    missing = tmp_path / "no" / "such" / "out.jsonl"
    # The model does not exist either: the output path is what is checked first.
    code, err = run_cli(
        capsys, "generate", "--model", str(tmp_path / "nomodel"), "-p", "hi", "-o", str(missing)
    )
    assert_one_line_error(code, err, "does not exist", str(missing.parent))


def test_quiet_prints_only_the_answer(tiny_dir):
    loud = invoke(*tiny_args(tiny_dir, "--prompt", "w5 w6"))
    quiet = invoke(*tiny_args(tiny_dir, "--prompt", "w5 w6", "--quiet"))
    assert "Generation:" in loud.stderr and quiet.stderr == ""
    assert quiet.stdout == loud.stdout and quiet.stdout.strip()


def test_cli_errors_keep_the_flag_names(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(
        capsys, "generate", "--model", str(d), "-b", "cpu", "-p", "w5", "--top-p", "2"
    )
    assert_one_line_error(code, err, "--top-p must be in")


# --- one vocabulary across commands, --json --------------------------------------------------


def test_bench_takes_generate_spellings_and_defaults_the_model(monkeypatch):
    import mlxrun.bench as bench

    seen = {}

    def fake_run(model, backends, quants, **kw):
        seen.update(model=model, **kw)
        return "report"

    monkeypatch.setattr(bench, "run_bench", fake_run)
    monkeypatch.setattr(bench, "format_report", lambda r: "table")
    invoke("bench", "--max-tokens", 3, "--batch-size", 2, "--backends", "cpu")
    assert seen["model"] == "smollm2" and seen["gen_tokens"] == 3 and seen["batch"] == 2
    invoke("bench", "--gen-tokens", 4, "--batch", 5, "--backends", "cpu")
    assert seen["gen_tokens"] == 4 and seen["batch"] == 5


def test_generate_takes_bench_spellings(tiny_dir, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("w5 w6\nw9 w10\n")
    d, _ = tiny_dir("llama_gqa_tied")
    r = invoke(
        "generate", "-m", d, "-b", "cpu", "--no-chat", "--prompts", f, "--gen-tokens", 1,
        "--batch", 1,
    )  # fmt: skip
    assert "Prompts: 2 in batches of 1; 2 tokens generated" in r.stderr


def test_plan_takes_bench_shapes_and_prints_json():
    import mlxrun

    r = invoke("plan", "-m", "shape:llama3-8b", "-b", "cpu", "--context", 4096, "--json")
    got = json.loads(r.stdout)
    assert got["footprint"]["n_params"] == 8_030_261_248  # Llama 3 8B
    want = mlxrun.plan("shape:llama3-8b", backend="cpu", context=4096)
    assert got["total_bytes"] == want.total_bytes and got["fits"] == want.fits


def test_plan_says_when_prompt_tokens_changes_nothing(tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    a = invoke("plan", "-m", d, "-b", "cpu", "--context", 128, "--prompt-tokens", 16)
    b = invoke("plan", "-m", d, "-b", "cpu", "--context", 128)
    # (the free memory the plan reports may move between the two runs)
    same = [ln for ln in a.stdout.splitlines() if "available" not in ln]
    assert same == [ln for ln in b.stdout.splitlines() if "available" not in ln]
    assert "GiB" in a.stdout and "--prompt-tokens does not change the plan" in a.stderr


def test_eval_short_text_error_and_json(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    short = tmp_path / "short.txt"
    short.write_text("w5 w6 w7 w8")
    code, err = run_cli(
        capsys, "eval", "-m", str(d), "-b", "cpu", "--quant", "int8", "--text", str(short)
    )
    assert_one_line_error(code, err, "only 3 scored tokens", "longer --text")
    assert "--window" not in err  # a larger window scores fewer tokens, never more
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{3 + (i * 7) % 90}" for i in range(200)))
    r = invoke("eval", "-m", d, "-b", "cpu", "--quant", "none,int8", "--text", text, "--json")
    rows = {x["quant"]: x for x in json.loads(r.stdout)["results"]}
    assert rows["none"]["kl"] == 0 and rows["none"]["top1"] == 1.0
    assert 0 < rows["int8 g64"]["kl"] < 0.05 and rows["none"]["n_tokens"] == 199


def test_devices_json_and_verbose_says_each_note_once():
    r = invoke("devices", "--json")
    got = {(x["backend"], x["device"]): x for x in json.loads(r.stdout)}
    assert got[("torch", "cpu")]["auto"] == "none" and got[("mlx", "cpu")]["auto"] == "int4"
    out = invoke("devices", "--verbose").stdout
    assert out.count("no fused kernel: each call expands the layer") == 1
    assert out.count("reference figures from mlxrun/quant/profiles.py") == 2  # both CPU ones


# --- choices the tool makes: the fast default, warnings for known-bad choices -----------------


def test_default_expands_packed_weights_where_dense_is_faster(int4_tiny):
    args = ["generate", "-m", int4_tiny, "-b", "cpu", "--no-chat", "-p", "w5 w6", "--max-tokens", 4]
    default, none = invoke(*args), invoke(*args, "--quant", "none")
    assert "packed weights are expanded to float32 on load" in default.stderr
    for r in (default, none):
        assert "dequantized on load to float32" in r.stderr and "as stored" not in r.stderr
    assert default.stdout == none.stdout
    kept = invoke(*args, "--quant", "int4")  # the stored format stays packed
    assert "expanded" not in kept.stderr and kept.stdout == default.stdout
    mlx = invoke(*[a if a != "cpu" else "mlx" for a in args])  # MLX runs packed weights fast
    assert "expanded" not in mlx.stderr and "as stored" in mlx.stderr


def test_warnings_for_choices_known_to_be_bad(int4_tiny, tiny_dir):
    args = ["generate", "-m", int4_tiny, "-b", "cpu", "--no-chat", "-p", "w5", "--max-tokens", 1]
    r = invoke(*args, "--quant", "fp8", "--quiet")  # warnings show even with --quiet
    assert r.stderr.startswith("warning: --quant fp8 re-quantizes weights already stored as int4")
    d, _ = tiny_dir("llama_gqa_tied")
    r = invoke(
        "generate", "-m", d, "-b", "mlx", "--dtype", "bfloat16", "-p", "w5", "--max-tokens", 1
    )
    assert "warning: --dtype bfloat16 on MLX's CPU runs several times slower" in r.stderr
    r = invoke("generate", "-m", d, "-b", "mlx", "-p", "w5", "--max-tokens", 1)
    assert "warning" not in r.stderr


def test_convert_ends_with_a_summary(tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    out = tmp_path / "int4"
    r = invoke("convert", "-m", d, "--quant", "int4", "--group-size", 32, "-o", out)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert r.stdout.strip() == (
        f"wrote {out}: 1 safetensors file, {size / 1e9:.3f} GB ({size} bytes), affine 4-bit g32"
    )


# --- the README is a user's manual ----------------------------------------------------------


def test_readme_is_for_users():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "## The Python API" in readme and "<!-- ci:begin -->" in readme
    for f in (readme, (root / "docs/performance.md").read_text(),
              (root / "benchmarks/KERNEL_NOTES.md").read_text()):  # fmt: skip
        low = f.lower()
        assert "session" not in low and "the issue" not in low and "helper" not in low
