"""`mlxrun bench` from the command line: the table and JSON it writes for a tiny random
shape (bytes per token against a count by hand), what it runs for a checkpoint stored
4-bit (the bundled GGUF), and each user error as one line with exit status 1."""

from __future__ import annotations

import json
import sys

import pytest

from mlxrun import bench_timing
from mlxrun.cli import main
from tests.test_bench import _cuda_error, _tiny_bytes_per_token

FAST = ["--prompt-tokens", "16", "--gen-tokens", "8", "--reps", "2"]


@pytest.fixture(autouse=True)
def small_copy(monkeypatch):
    monkeypatch.setitem(bench_timing.COPY_BYTES, "cpu", 8 << 20)  # keeps each run near a second


def run_cli(capsys, *args):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def assert_one_line_error(code, err, *needles):
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxrun: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


def test_table_and_json(capsys, tmp_path):
    out_json = tmp_path / "b.json"
    code, out, err = run_cli(
        capsys, "--model", "shape:tiny", "--backends", "cpu,mlx", "--quant", "none,int4",
        *FAST, "--json", str(out_json),
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out_json.read_text())
    rows = [(r["backend"], r["quant"]) for r in data["rows"]]
    assert rows == [
        ("cpu", "none"), ("cpu", "int4"), ("mlx", "none"), ("mlx", "int4"),
    ]  # fmt: skip
    lines = out.splitlines()
    for r in data["rows"]:
        assert r["bytes_per_token"] == _tiny_bytes_per_token(r["quant"])
        assert r["roofline"] == pytest.approx(
            r["decode_tps"] * r["bytes_per_token"] / r["bandwidth_Bps"]
        )
        # the printed row carries the measured medians, not other numbers
        row = next(ln for ln in lines if ln.startswith(r["backend"]) and f" {r['quant']} " in ln)
        assert f"{r['decode_tps']:.1f} [{r['decode_tps_min']:.1f}-" in row
        assert f"{r['ttft_ms']:.1f}" in row and f"{100 * r['roofline']:.1f}" in row
    assert f"wrote {out_json}" in err


def test_unavailable_backend_is_listed_as_skipped(capsys):
    reason = _cuda_error()
    if reason is None:
        pytest.skip("CUDA is available here")
    code, out, err = run_cli(
        capsys, "--model", "shape:tiny", "--backends", "cpu,cuda", "--quant", "none", *FAST
    )
    assert code == 0, err
    assert f"skipped cuda: {reason}" in out.splitlines()


def test_compare_needs_a_torch_backend(capsys):
    """--compare reaches the run: transformers needs torch, so with MLX alone it is skipped
    with the fix (test_bench.py measures the transformers row itself)."""
    code, out, err = run_cli(
        capsys, "--model", "shape:tiny", "--backends", "mlx", "--quant", "none", *FAST,
        "--compare", "transformers",
    )  # fmt: skip
    assert code == 0, err
    assert (
        "skipped transformers none: no torch backend (cpu, cuda, mps) ran; add cpu to --backends"
        in out
    )


def test_no_backend_can_run(capsys):
    reason = _cuda_error()
    if reason is None:
        pytest.skip("CUDA is available here")
    code, _, err = run_cli(capsys, "--model", "shape:tiny", "--backends", "cuda", *FAST)
    assert_one_line_error(code, err, "nothing could be measured", reason)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "shape:llama9"], "unknown model shape 'shape:llama9'"),
        (["--reps", "0"], "--reps must be at least 1, got 0"),
        (["--prompt-tokens", "-5"], "--prompt-tokens must be at least 1, got -5"),
        (["--gen-tokens", "-1"], "--gen-tokens must be at least 2"),
        (["--batch", "0"], "--batch must be at least 1, got 0"),
        (["--backends", ","], "--backends is empty"),
        (["--backends", "tpu"], "unknown backend"),
        (["--quant", "int3"], "unknown quantization format 'int3'"),
        (["--quant", "auto"], "--quant auto is not measurable"),
        (["--compare", "vllm"], "--compare 'vllm' is not supported"),
        (["--json", "/nonexistent-dir/b.json"], "its directory does not exist"),
    ],
)
def test_errors(capsys, args, needle):
    # click keeps the last value of a repeated option: `args` override the defaults here
    code, _, err = run_cli(capsys, "--model", "shape:tiny", "--backends", "cpu", *FAST, *args)
    assert_one_line_error(code, err, needle)


def test_plot_without_matplotlib_names_the_package(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, _, err = run_cli(
        capsys, "--model", "shape:tiny", "--backends", "cpu", "--plot", str(tmp_path / "b.png")
    )
    assert_one_line_error(code, err, "pip install matplotlib")
    assert not list(tmp_path.iterdir())
