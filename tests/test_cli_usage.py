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
