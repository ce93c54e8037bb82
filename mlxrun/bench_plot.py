"""`mlxrun bench --plot`: one picture of a bench report a reader can take as is.

Horizontal bars of decode tokens/s on a linear axis (ratios read off directly), each bar
labelled with its value and its fraction of the roofline; each row's roofline is its own
engine's copy bandwidth over the bytes it reads per token (an MLX row against MLX's copy,
not PyTorch's); a legend names the engines; the title gives the model, device and dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bench_report import BenchReport, BenchRow

# engine label -> colour; the legend lists those present, in this order
COLOURS = {
    "mlxrun, MLX": "#1f77b4",
    "mlxrun, PyTorch CUDA": "#2ca02c",
    "mlxrun, PyTorch MPS": "#9467bd",
    "mlxrun, PyTorch CPU": "#ff7f0e",
    "transformers (PyTorch)": "#7f7f7f",
}
_TORCH = {"cuda": "PyTorch CUDA", "mps": "PyTorch MPS", "cpu": "PyTorch CPU"}


@dataclass(frozen=True)
class Bar:
    """One bar: label (engine and format), engine (a COLOURS key), decode tok/s with its
    min-max, roofline tok/s (own copy bandwidth / bytes per token), the text at its end."""

    label: str
    engine: str
    tps: float
    tps_min: float
    tps_max: float
    roofline_tps: float
    text: str


def engine_of(row: BenchRow) -> str:
    if row.engine == "transformers":
        return "transformers (PyTorch)"
    return (
        "mlxrun, MLX" if row.backend == "mlx" else f"mlxrun, {_TORCH.get(row.backend, row.backend)}"
    )


def own_bandwidth(report: BenchReport, row: BenchRow) -> float:
    """The copy bandwidth measured through the row's own engine on its memory (bytes/s);
    the row's stored figure where that engine's was not measured."""
    lib = "mlx" if row.engine == "mlxrun" and row.backend == "mlx" else "torch"
    for key, bw in report.bandwidth.items():
        if key.split(":")[0] == lib and bw.get("memory") == row.memory:
            return float(bw["median_Bps"])
    return row.bandwidth_Bps


def bars(report: BenchReport) -> list[Bar]:
    out = []
    for r in report.rows:
        ceiling = own_bandwidth(report, r) / r.bytes_per_token if r.bytes_per_token else 0.0
        pct = 100 * r.decode_tps / ceiling if ceiling else 0.0
        fmt = "" if r.engine == "transformers" else f" {r.quant}"
        out.append(
            Bar(
                label=f"{engine_of(r).removeprefix('mlxrun, ')}{fmt}",
                engine=engine_of(r),
                tps=r.decode_tps,
                tps_min=r.decode_tps_min,
                tps_max=r.decode_tps_max,
                roofline_tps=ceiling,
                text=f"{r.decode_tps:,.1f} tok/s ({pct:.0f}% of roofline)",
            )
        )
    return out


def title(report: BenchReport) -> str:
    """Model and run shape, then the devices with their compute dtype."""
    s = report.settings
    devices = list(dict.fromkeys(r.device for r in report.rows))
    return (
        f"{report.model}: decode speed, batch {s['batch']}, {s['prompt_tokens']}-token prompt "
        f"+ {s['gen_tokens']} tokens\n" + "; ".join(devices)
    )


def plot_report(report: BenchReport, path: str | os.PathLike) -> None:
    """Write the PNG (atomically)."""
    import numpy as np  # noqa: PLC0415

    from .bench_report import _atomic_write, _matplotlib  # noqa: PLC0415

    Figure = _matplotlib()
    bs = bars(report)
    n = len(bs)
    fig = Figure(figsize=(9.0, 1.6 + 0.55 * n), dpi=150)
    ax = fig.add_subplot()
    ys = np.arange(n)[::-1]  # the first row on top
    top = max(max(b.tps_max for b in bs), max(b.roofline_tps for b in bs))
    seen = set()
    for y, b in zip(ys, bs):
        label = None if b.engine in seen else b.engine
        seen.add(b.engine)
        ax.barh(y, b.tps, height=0.6, color=COLOURS.get(b.engine, "#8c564b"), label=label)
        if b.tps_max > b.tps_min:
            ax.errorbar(b.tps, y, xerr=[[b.tps - b.tps_min], [b.tps_max - b.tps]],
                        fmt="none", ecolor="black", elinewidth=0.8, capsize=2)  # fmt: skip
        if b.roofline_tps:
            ax.plot([b.roofline_tps] * 2, [y - 0.38, y + 0.38], color="black", lw=1.5,
                    label="roofline (own copy bandwidth / bytes per token)"
                    if "roof" not in seen else None)  # fmt: skip
            seen.add("roof")
        # past the whisker and the roofline tick, so neither crosses the text
        ax.text(max(b.tps_max, b.roofline_tps) + 0.015 * top, y, b.text, va="center", fontsize=8)
    ax.set_yticks(ys, [b.label for b in bs], fontsize=9)
    ax.set_xlim(0, 1.5 * top)  # room for the value labels
    ax.set_xlabel("decode tokens/s (higher is better)")
    ax.set_title(title(report), fontsize=9.5)
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    _atomic_write(path, lambda f: fig.savefig(f, format="png"))
