"""`bench --plot`: each row against its own engine's roofline, values on the bars, a legend
that names the engines, a title with device and dtype."""

from __future__ import annotations

import pytest

from mlxrun import bench_plot
from mlxrun.bench import BenchReport, BenchRow

GB = 1e9


def row(engine, backend, quant, tps, bytes_per_token, device="cpu, float32"):
    return BenchRow(
        engine=engine, backend=backend, device=device, quant=quant, weights=quant, load_s=1.0,
        ttft_ms=10.0, prefill_tps=100.0, decode_tps=tps, decode_tps_min=tps * 0.9,
        decode_tps_max=tps * 1.1, decode_tps_reps=[tps], ttft_ms_reps=[10.0],
        peak_memory_bytes=GB, weight_bytes=GB, weight_bytes_per_step=GB, kv_bytes_per_step=0,
        bytes_per_token=bytes_per_token, memory="cpu", bandwidth_Bps=15.6 * GB,
    )  # fmt: skip


@pytest.fixture
def report():
    rows = [
        row("mlxrun", "mlx", "none", 7.4, 0.54 * GB),
        row("mlxrun", "cpu", "none", 14.6, 0.54 * GB),
        row("transformers", "cpu", "none", 12.2, 0.54 * GB),
    ]
    bw = {
        "mlx:cpu": {"memory": "cpu", "median_Bps": 2.8 * GB},
        "torch:cpu": {"memory": "cpu", "median_Bps": 15.6 * GB},
    }
    settings = {"batch": 1, "prompt_tokens": 32, "gen_tokens": 8}
    return BenchReport("smollm2", "x.gguf", {}, settings, rows, [], bw, {})


def test_rows_use_their_own_engines_bandwidth(report):
    mlx, cpu, hf = bench_plot.bars(report)
    assert mlx.roofline_tps == pytest.approx(2.8 / 0.54)  # MLX's own copy, not torch's 15.6
    assert cpu.roofline_tps == pytest.approx(15.6 / 0.54) == hf.roofline_tps
    assert mlx.text == "7.4 tok/s (143% of roofline)"
    assert cpu.text == "14.6 tok/s (51% of roofline)"
    assert [b.engine for b in (mlx, cpu, hf)] == [
        "mlxrun, MLX", "mlxrun, PyTorch CPU", "transformers (PyTorch)",
    ]  # fmt: skip
    assert [b.label for b in (mlx, cpu, hf)] == [
        "MLX none",
        "PyTorch CPU none",
        "transformers (PyTorch)",
    ]
    assert "cpu, float32" in bench_plot.title(report)


def test_png_is_written(report, tmp_path):
    pytest.importorskip("matplotlib")
    bench_plot.plot_report(report, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
