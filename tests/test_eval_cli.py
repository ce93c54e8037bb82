"""`mlxrun eval` and `mlxrun devices` from the command line: the eval table against a
transformers oracle and the library, what the reference is, one-line errors; the devices
report against this machine's facts."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.cli import main
from mlxrun.convert import convert

from .test_cli_errors import assert_one_line_error

pytest.importorskip("mlx.core")

ROW = re.compile(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)% \| (\d+) \|$")


def run_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def table(out: str) -> dict[str, tuple[float, float, float, float, int]]:
    """label -> (bytes/weight, perplexity, KL, top-1 fraction, tokens) from the printed table."""
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            bpw, ppl, kl, top1 = (float(m[i]) for i in range(2, 6))
            rows[m[1]] = (bpw, ppl, kl, top1 / 100, int(m[6]))
    return rows


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    rng = np.random.default_rng(2)
    ids = [int(i) for i in rng.integers(3, 96, size=140)]
    f = tmp_path_factory.mktemp("evaltext") / "words.txt"
    f.write_text(" ".join(f"w{i}" for i in ids))
    return f, ids


def test_eval_table_for_several_formats(capsys, tiny_dir, words):
    d, hf = tiny_dir("llama_gqa_tied")
    f, ids = words
    code, out, err = run_cli(
        capsys, "eval", "-m", str(d), "-b", "cpu", "--quant", "none, int8,int4:g32",
        "--text", str(f), "--window", "64",
    )  # fmt: skip
    assert code == 0, err
    assert "reference: the checkpoint's own unquantized weights" in out
    rows = table(out)
    assert list(rows) == ["none", "int8 g64", "int4 g32"]
    # oracle: transformers for the reference, MLX's quantized_matmul for int8 (evaluate ran
    # on PyTorch-CPU), scored with torch's own functions over the same 64-token windows
    q = mlxrun.load(str(d), backend="mlx", quant="int8", progress=False)
    nll = kl = agree = n = 0.0
    with torch.no_grad():
        for i in range(0, len(ids), 64):
            w = torch.tensor([ids[i : i + 64]])
            lp = torch.log_softmax(hf(w).logits[0, :-1].double(), -1)
            lq = torch.log_softmax(torch.from_numpy(q.logits(w[0].tolist())[:-1]).double(), -1)
            nll += float(torch.nn.functional.nll_loss(lp, w[0, 1:], reduction="sum"))
            kl += float(torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="sum"))
            agree += float((lp.argmax(-1) == lq.argmax(-1)).sum())
            n += w.shape[1] - 1
    bpw, ppl, kl0, top1, tokens = rows["none"]
    assert tokens == n == 140 - 3
    assert ppl == pytest.approx(float(np.exp(nll / n)), rel=1e-3)
    assert (kl0, top1, bpw) == (0.0, 1.0, 4.0)  # float32 dense
    bpw, _, kl8, top1, tokens = rows["int8 g64"]
    assert kl8 == pytest.approx(kl / n, rel=2e-2) and 0 < kl8 < 0.01
    assert abs(top1 - agree / n) <= 1 / n + 1e-4
    assert bpw == pytest.approx(1 + 8 / 64)  # float32 scale + bias per 64
    assert rows["int4 g32"][2] > rows["int8 g64"][2]  # fewer bits, larger KL
    assert rows["int4 g32"][0] == pytest.approx(0.5 + 8 / 32)  # float32 scale + bias


def test_eval_of_a_quantized_checkpoint_names_its_dense_reference(
    capsys, tiny_dir, words, tmp_path
):
    d, _ = tiny_dir("llama_gqa_tied")
    q = tmp_path / "q"
    convert(str(d), str(q), quant="int4", group_size=32, progress=False)
    f, ids = words
    code, out, err = run_cli(
        capsys, "eval", "-m", str(q), "-b", "mlx", "--quant", "none",
        "--text", str(f), "--window", "64",
    )  # fmt: skip
    assert code == 0, err
    assert "stored quantized (affine 4-bit g32)" in out and "dense copy" in out
    rows = table(out)
    # the reference is the packed checkpoint's own model: its perplexity, loaded as stored
    m = mlxrun.load(str(q), backend="mlx", progress=False)
    nll = n = 0.0
    for i in range(0, len(ids), 64):
        w = ids[i : i + 64]
        lq = torch.log_softmax(torch.from_numpy(m.logits(w)[:-1]).double(), -1)
        nll += float(torch.nn.functional.nll_loss(lq, torch.tensor(w[1:]), reduction="sum"))
        n += len(w) - 1
    assert rows["none"][1] == pytest.approx(float(np.exp(nll / n)), rel=1e-3)
    assert set(rows) == {"none"}


@pytest.mark.parametrize(
    "quant, needle",
    [
        ("int8,int3", "unknown quantization format 'int3'"),
        ("auto", "not auto"),
        ("int8,,int4", "empty entry"),
        ("int4:x", "'x' is neither gN"),
        ("int4:g48", "group size 48 is not allowed"),
        ("fp4:clip", "clip search applies to int4/int8 only"),
    ],
)
def test_eval_bad_quant_fails_before_loading(capsys, tmp_path, quant, needle):
    # the model does not exist: the --quant error must come first
    code, _, err = run_cli(capsys, "eval", "-m", str(tmp_path / "nope"), "--quant", quant)
    assert_one_line_error(code, err, needle)


def test_eval_text_errors(capsys, tiny_dir, tmp_path):
    d, _ = tiny_dir("llama_gqa_tied")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    short = tmp_path / "short.txt"
    short.write_text("w3 w4 w5")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    for text, needle in [
        (tmp_path / "missing.txt", "missing.txt: no such file"),
        (empty, "empty.txt: the file is empty"),
        (tmp_path, "cannot be read"),  # a directory
        (binary, "not UTF-8"),
        (short, "only 2 scored tokens"),
    ]:
        code, _, err = run_cli(
            capsys, "eval", "-m", str(d), "-b", "cpu", "--quant", "int8", "--text", str(text)
        )
        assert_one_line_error(code, err, needle)


# --- mlxrun devices -------------------------------------------------------------------------


def _mem_total_line() -> str:
    from mlxrun.device_memory import _fmt

    kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    total = kb * 1024
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.exists() and limit.read_text().split()[0].isdigit():
        total = min(total, int(limit.read_text().split()[0]))
    return f"total {_fmt(total)}"


def test_devices_on_this_cpu_machine(capsys):
    code, out, err = run_cli(capsys, "devices")
    assert code == 0, err
    blocks = {b.splitlines()[0].split(":")[0]: b for b in out.strip().split("\n\n")}
    assert set(blocks) == {"[0] mlx cpu", "[1] torch cpu"}  # no GPU here
    mlx, tch = blocks["[0] mlx cpu"], blocks["[1] torch cpu"]
    for b in (mlx, tch):
        assert _mem_total_line() in b
        for fmt in ("int4", "int8", "fp8", "fp4", "nvfp4"):
            assert re.search(rf"^    {fmt} +\S.* float32$", b, re.M), (fmt, b)
    assert "profile  mlx-cpu: MLX on the CPU" in mlx
    assert "auto     int4: MLX's CPU qmv" in mlx
    assert "mx.quantized_matmul" in mlx
    assert "profile  torch-cpu: PyTorch on the CPU" in tch
    assert "auto     none: expanding a layer per call" in tch
    assert re.search(r"^    int4 +torch-dequant-per-layer +float32$", tch, re.M)
    code, out, _ = run_cli(capsys, "devices", "--verbose")
    assert code == 0 and "no fused kernel: each call expands the layer" in out


# --- generate reports the weights' bytes after quantization ---------------------------------


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_generate_reports_weight_bytes_after_quantization(capsys, tiny_dir, backend):
    d, hf = tiny_dir("llama_gqa_tied")
    code, _, err = run_cli(
        capsys, "generate", "-m", str(d), "-b", backend, "--quant", "int4",
        "--prompt", "w3 w4 w5", "--max-tokens", "2", "--no-chat",
    )  # fmt: skip
    assert code == 0, err
    # int4 g64 of every matrix (tied embedding once): 4 bits a weight, float32 scale and
    # bias per 64; norms stay float32
    want = 0
    for _, p in hf.named_parameters():
        o, i = (p.shape[0], p.shape[1]) if p.ndim == 2 else (p.numel(), 0)
        want += o * i // 2 + o * (i // 64) * 8 if p.ndim == 2 else 4 * o
    dense = sum(4 * p.numel() for p in hf.parameters())
    assert f"Weights: 0.000 GB ({want} bytes, quantized on load to affine 4-bit g64)" in err
    assert want / dense == pytest.approx((0.5 + 8 / 64) / 4, rel=0.05)  # norms stay dense
