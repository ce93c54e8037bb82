"""`mlxrun generate` with many prompts and `mlxrun plan`: files, batch sizes, refusals."""

from __future__ import annotations

import json

import pytest

from mlxrun.cli import main
from mlxrun.memory import DeviceMemory

from .test_cli_errors import assert_one_line_error, run_cli


def test_prompts_file_jsonl_output_in_input_order(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "w5 w6 w7"}\n\n{"prompt": "w9"}\n{"prompt": "w10 w11"}\n')
    out = tmp_path / "out.jsonl"
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu",
                        "--prompts", str(f), "--max-tokens", "5", "--batch-size", "2",
                        "--no-chat", "-o", str(out))  # fmt: skip
    assert code == 0, err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["w5 w6 w7", "w9", "w10 w11"]
    assert all(r["finish_reason"] in ("stop", "length") and r["tokens"] <= 5 for r in rows)
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_plain_prompts_file(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    f = tmp_path / "p.txt"
    f.write_text("w5 w6\nw7\n")
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "mlx",
                        "--prompts", str(f), "--max-tokens", "3", "--no-chat")  # fmt: skip
    assert code == 0, err


@pytest.mark.parametrize(
    "content,needle",
    [
        ("", "holds no prompts"),
        ("\n\n", "holds no prompts"),
        ('{"prompt": "ok"}\n{"prompt": "ok"\n', ":2: not a JSON object"),
        ('{"prompt": "ok"}\n{"text": "no prompt"}\n', ":2: not a JSON object"),
        ('{"prompt": ""}\n', ':1: "prompt" must be a non-empty string'),
    ],
)
def test_bad_prompts_files(capsys, tiny_dir, tmp_path, content, needle):
    d, _ = tiny_dir("llama_gqa_tied")
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    code, err = run_cli(capsys, "generate", "--model", str(d), "--prompts", str(f))
    assert_one_line_error(code, err, needle)


def test_unreadable_prompts_file(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(
        capsys, "generate", "--model", str(d), "--prompts", str(tmp_path / "missing.txt")
    )
    assert_one_line_error(code, err, "cannot read prompts file")


def test_batch_size_zero(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    code, err = run_cli(
        capsys, "generate", "--model", str(d), "-p", "w3", "-p", "w4", "--batch-size", "0"
    )
    assert_one_line_error(code, err, "--batch-size must be a positive integer")


def test_context_longer_than_model(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")  # max_position_embeddings 256
    code, err = run_cli(capsys, "plan", "--model", str(d), "--context", "1000")
    assert_one_line_error(code, err, "max_position_embeddings (256)")
    code, err = run_cli(capsys, "generate", "--model", str(d), "-p", "w3", "-p", "w4",
                        "--max-tokens", "300", "--no-chat")  # fmt: skip
    assert_one_line_error(code, err, "exceeds the model's context of 256")


def test_batch_that_cannot_fit_names_the_largest_that_does(capsys, tiny_dir, monkeypatch):
    """A simulated CPU whose budget holds exactly the plan for 4 sequences: 16 are refused,
    and the message names a batch size that fits."""
    import mlxrun
    import mlxrun.planning as planning

    d, _ = tiny_dir("llama_gqa_tied")
    prompt = " ".join(["w5"] * 50)
    n = len(mlxrun.load(str(d), backend="cpu").tokenizer.prompt_ids(prompt, chat=False))
    # the plan generate makes: the longest prompt + --max-tokens, the prompt prefilled
    need4 = mlxrun.plan(
        str(d), context=n + 200, batch=4, backend="cpu", prompt_tokens=n
    ).total_bytes
    gib = 1 << 30  # with 2 GiB total the CPU reserve is 1 GiB

    def small(backend, device):
        return DeviceMemory(
            "cpu", "simulated", 2 * gib, gib + need4, False, sources={"total_bytes": "test"}
        )

    monkeypatch.setattr(planning, "probe_device", small)
    prompts = sum((["-p", prompt] for _ in range(16)), [])
    code, err = run_cli(capsys, "generate", "--model", str(d), "--backend", "cpu", *prompts,
                        "--max-tokens", "200", "--batch-size", "16", "--no-chat")  # fmt: skip
    assert_one_line_error(code, err, "budget", "--batch-size 4")


def test_plan_prints_the_numbers(capsys, tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(d), "--context", "128", "--batch", "2", "--backend", "cpu"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    # KV per token: 2 layers x 2 x 2 kv heads x 16 head_dim x 4 bytes (fp32 on cpu) = 512 B
    assert "512 B/token" in out or "0.5 KiB/token" in out, out
    assert "max batch" in out and "fits" in out
