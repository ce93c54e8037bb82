"""The report of `mlxrun bench`: its rows, the roofline fraction of each, the table it
prints, the JSON it writes (atomically) and the environment it records; the plot is
bench_plot.py."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import MlxrunError

GB = 1e9  # the report's unit for bytes, bandwidth and memory (decimal, as vendors quote)


@dataclass
class BenchRow:
    """One measured configuration. Speeds in tokens/s summed over the batch; bytes in bytes.

    bytes_per_token = (weights read per decode step + KV read at the mean context, all
    sequences) / batch; roofline = decode_tps x bytes_per_token / bandwidth.
    """

    engine: str  # "mlxrun", "transformers" or "mlx-lm"
    backend: str  # mlx | cpu | cuda | mps, or the peer's name (transformers, mlx-lm)
    device: str  # short: "cpu, float32", "cuda (NVIDIA H100), bfloat16"
    quant: str  # as asked: none | int4 | ...
    weights: str  # as run: "float32", "int4 g64", "int4 g32, head int8 g32 (stored)"
    load_s: float
    ttft_ms: float  # median: prefill of the whole batch + first sample
    prefill_tps: float  # batch x prompt_tokens / TTFT
    decode_tps: float  # median over reps: batch x (N-1) / (t_N - t_1)
    decode_tps_min: float
    decode_tps_max: float
    decode_tps_reps: list[float]
    ttft_ms_reps: list[float]
    peak_memory_bytes: int
    weight_bytes: int  # every array the model holds (a tied head once)
    weight_bytes_per_step: int  # what one decode step reads of them
    kv_bytes_per_step: int  # KV cache read per step at the mean context, all sequences
    bytes_per_token: float
    memory: str  # the memory it streams from: "cpu", "cuda" or "apple-gpu"
    bandwidth_Bps: float = 0.0  # that memory's copy bandwidth measured in this run
    roofline: float = 0.0  # fraction (can pass 1 when caches hold part of the weights)
    description: str = ""  # the backend's full describe()
    notes: list[str] = field(default_factory=list)
    sampling: str = "greedy"  # or the sampled setting, e.g. "temp 0.7 top-p 0.9"
    kv_quant: str = "none"  # the KV cache's format (mlxrun/kvquant.py); its bytes as stored


@dataclass
class Skipped:
    backend: str
    quant: str  # "*" when the whole backend could not run
    reason: str


@dataclass
class BenchReport:
    model: str
    source: str
    config: dict  # hidden, layers, heads, ... of the model measured
    settings: dict  # prompt_tokens, gen_tokens, batch, reps, prefill_chunk per backend, dtype
    rows: list[BenchRow]
    skipped: list[Skipped]
    bandwidth: dict[str, dict]  # "torch:cpu" -> {"device", "median_Bps", "trials_Bps", ...}
    environment: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- numbers -------------------------------------------------------------------------------


def _roofline(rows: list[BenchRow], bandwidth: dict[str, dict]) -> None:
    """Each row's bandwidth: the best copy measured on its memory (frameworks differ: MLX's
    CPU copy runs on one thread, torch's on all), and its roofline fraction."""
    for r in rows:
        r.bandwidth_Bps = max(
            b["median_Bps"] for b in bandwidth.values() if b["memory"] == r.memory
        )
        r.roofline = r.decode_tps * r.bytes_per_token / r.bandwidth_Bps


def _config_summary(c: ModelConfig) -> dict:
    keys = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "quantization",
    )
    return {k: getattr(c, k) for k in keys}


def _environment() -> dict:
    return dict(
        python=platform.python_version(),
        platform=platform.platform(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        numpy=np.__version__,
        torch=_version("torch"),
        mlx=_mlx_version(),
        transformers=_version("transformers"),
    )


def _version(module: str) -> str | None:
    m = sys.modules.get(module)
    return getattr(m, "__version__", None) if m is not None else None


def _mlx_version() -> str | None:
    return _version("mlx.core")


# --- output --------------------------------------------------------------------------------


def format_report(report: BenchReport) -> str:
    """One table (a row per backend x format, transformers last) and the skipped list."""
    s = report.settings
    head = (
        f"{report.model} ({report.source}): batch {s['batch']}, {s['prompt_tokens']}-token "
        f"prompt, {s['gen_tokens']} tokens, median of {s['reps']} (GB = 1e9 bytes)"
    )
    sampled = any(r.sampling != "greedy" for r in report.rows)
    cols = [
        "backend",
        "device",
        "quant",
        "weights",
        *(["sampling"] if sampled else []),
        "load s",
        "TTFT ms",
        "prefill tok/s",
        "decode tok/s [min-max]",
        "peak GB",
        "bytes/tok GB",
        "BW GB/s",
        "roofline %",
    ]
    table = [cols]
    for r in report.rows:
        table.append(
            [
                r.backend,
                r.device,
                r.quant + ("" if r.kv_quant == "none" else f" kv-{r.kv_quant}"),
                r.weights,
                *([r.sampling] if sampled else []),
                f"{r.load_s:.2f}",
                f"{r.ttft_ms:.1f}",
                f"{r.prefill_tps:.1f}",
                f"{r.decode_tps:.1f} [{r.decode_tps_min:.1f}-{r.decode_tps_max:.1f}]",
                f"{r.peak_memory_bytes / GB:.3f}",
                f"{r.bytes_per_token / GB:.4f}",
                f"{r.bandwidth_Bps / GB:.1f}",
                f"{100 * r.roofline:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    right = set(range(5 if sampled else 4, len(cols)))
    lines = [head]
    for k, row in enumerate(table):
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    bw = ", ".join(f"{k} {v['median_Bps'] / GB:.1f}" for k, v in report.bandwidth.items())
    lines.append(
        f"copy bandwidth measured (GB/s, read+write): {bw}; each row uses its memory's best"
    )
    if any(r.backend in ("cpu", "transformers") and r.memory == "cpu" for r in report.rows):
        lines.append(
            "peak GB on torch CPU rows is the process's RSS high-water mark (earlier rows included)"
        )
    for r in report.rows:
        for n in r.notes:
            lines.append(f"note ({r.backend} {r.quant}): {n}")
    for sk in report.skipped:
        what = sk.backend if sk.quant == "*" else f"{sk.backend} {sk.quant}"
        lines.append(f"skipped {what}: {sk.reason}")
    return "\n".join(lines)


def _atomic_write(path: str | os.PathLike, write) -> None:
    """Write through a temporary file in the same directory, then rename over `path`."""
    path = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(report: BenchReport, path: str | os.PathLike) -> None:
    """Every number of the report as JSON (atomic)."""
    text = json.dumps(report.to_dict(), indent=2, allow_nan=False)
    _atomic_write(path, lambda f: f.write(text.encode() + b"\n"))


def _matplotlib():
    try:
        import matplotlib  # noqa: PLC0415, F401
    except ImportError:
        raise MlxrunError(
            "--plot needs matplotlib: pip install matplotlib (or mlxrun[plot])"
        ) from None
    from matplotlib.figure import Figure  # noqa: PLC0415 (no pyplot: no GUI backend state)

    return Figure


def plot_report(report: BenchReport, path: str | os.PathLike) -> None:
    """PNG of decode tok/s per row against its roofline: see mlxrun.bench_plot."""
    from .bench_plot import plot_report as draw  # noqa: PLC0415

    draw(report, path)
