"""Calibrated 4-bit quantization against rounding to nearest and mlx-lm's AWQ and GPTQ, on
the same dense weights, calibration windows and evaluation text, in one run.

    python benchmarks/calib_quality.py [--samples 16] [--seq-len 320] [--backend cpu]
        [--max-tokens 4096] [--no-mlx-lm] [--methods awq,gptq]

The dense reference is the bundled SmolLM2 GGUF dequantized to float32. Rows: RTN int4 g64
(mlxrun's quantize-on-load, the bytes of `mlx_lm.convert -q`), each `mlxrun convert
--calibrate` method (int4 g64, embedding g32), and mlx-lm's `awq_quantize` (embedding 4-bit
g32) and `gptq_quantize` (embedding g32 fallback) fed the same token windows. Prints the
eval table (bytes/weight of the matrices as held) and each calibration's wall time.
mlx-lm's quantizers run on MLX (the GPU on a Mac or mlx-cuda, else the CPU, where AWQ is
slow: --no-mlx-lm skips them).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from mlxrun.against import against_candidates
from mlxrun.convert import convert
from mlxrun.evaluate import QuantChoice, evaluate_many, format_table, save_dense
from mlxrun.loader import open_checkpoint
from mlxrun.quant.calibrate import CalibOptions, calib_text, calib_windows


def _mlx_lm(method: str, dense: Path, out: Path, wins: np.ndarray) -> float:
    """mlx-lm's AWQ or GPTQ of `dense` on windows `wins` [n, T] written to `out`;
    returns the calibration seconds."""
    import mlx.core as mx
    from mlx_lm.quant import gptq
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config
    from mlx_lm.utils import load, save

    model, tok, config = load(str(dense), lazy=True, return_config=True)
    mx.random.seed(123)
    t = time.perf_counter()
    data = mx.array(wins)
    if method == "awq":
        cfg = AWQ_MODEL_CONFIGS[config["model_type"]]
        awq_quantize(model, data, cfg, bits=4, group_size=64, embed_bits=4, embed_group_size=32)
        config = update_config(model, config)
    else:
        model, q = gptq.gptq_quantize(model, data, 4, 64, 4, 32)
        config["quantization"] = config["quantization_config"] = q
    mx.eval(model.parameters())
    secs = time.perf_counter() - t
    save(str(out), str(dense), model, tok, config)
    return secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--backend", default="cpu", help="where mlxrun calibrates and scores")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--methods", default="awq,gptq")
    ap.add_argument("--no-mlx-lm", action="store_true")
    args = ap.parse_args(argv)
    opts = CalibOptions(samples=args.samples, seq_len=args.seq_len)
    lines, dirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        dense = save_dense("smollm2", Path(tmp) / "dense", "float32")
        ck = open_checkpoint(str(dense))
        wins = calib_windows(ck.tokenizer.encode(calib_text(None), add_special_tokens=False), opts)
        for m in [x for x in args.methods.split(",") if x]:
            out = Path(tmp) / f"mlxrun-{m}"
            t = time.perf_counter()
            convert(
                str(dense),
                str(out),
                quant="int4",
                group_size=64,
                progress=True,
                calibrate=CalibOptions(m, None, args.samples, args.seq_len),
                backend=args.backend,
            )
            lines.append(f"mlxrun {m}: {time.perf_counter() - t:.1f} s (calibrate + write)")
            dirs.append(str(out))
        if not args.no_mlx_lm:
            for m in ("awq", "gptq"):
                out = Path(tmp) / f"mlx-lm-{m}"
                secs = _mlx_lm(m, dense, out, wins)
                lines.append(f"mlx-lm {m}: {secs:.1f} s (calibration)")
                dirs.append(str(out))
        extra = against_candidates(ck, dirs, args.backend, "float32")
        run = evaluate_many(
            str(dense),
            [QuantChoice(None), QuantChoice("int4", 64)],
            backend=args.backend,
            dtype="float32",
            max_tokens=args.max_tokens,
            extra=extra,
            progress=True,
        )
        print(f"\nSmolLM2-135M on {run.backend}, calibration {wins.shape[0]} x {wins.shape[1]}")
        print(format_table(run.results))
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
