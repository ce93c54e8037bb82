"""Calibrated 4-bit quantization against rounding to nearest and mlx-lm's AWQ and GPTQ, on
the same dense weights, calibration windows and evaluation text, in one run.

    python benchmarks/calib_quality.py [--model GGUF_OR_DIR] [--backend cpu|cuda|mlx]
        [--methods rtn,awq,gptq,awq-mixed,mlx-lm-awq,mlx-lm-gptq] [--samples 16]
        [--seq-len 320] [--grid 20] [--target-bpw X] [--max-tokens 3584] [--json OUT.json]
        [--keep DIR [--calibrate-only]]

The dense reference is `--model` (default: the bundled SmolLM2 GGUF) dequantized to
float32. Rows: RTN int4 g64 (mlxrun's quantize-on-load, the bytes of `mlx_lm.convert -q`),
each `mlxrun convert --calibrate` method (int4 g64, embedding g32, layers run on
`--backend`; awq-mixed: awq with `--target-bpw`, by default the bits per weight of the
uniform awq file, i.e. mlx-lm AWQ's bytes), and mlx-lm's `awq_quantize` (embedding 4-bit g32) and `gptq_quantize`
(embedding 4-bit g32 fallback) fed the same token windows of the same calibration text.
mlx-lm's quantizers run on MLX's default device (the GPU on a Mac or with mlx-cuda, else the
CPU, where its AWQ takes hours for SmolLM2). All rows are scored in one `evaluate_many`
run on `--backend` over the first `--max-tokens` tokens of the evaluation text. Prints the
table, the calibration wall time of each method and, with --json, writes every number.
With --keep DIR the dense and quantized directories stay there and a later run reuses
them (and their recorded calibration times): to fit a limit per command, run each method
with --calibrate-only, then all of them once more to score.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mlxrun.against import against_candidates
from mlxrun.convert import convert
from mlxrun.dense import save_dense
from mlxrun.evaluate import QuantChoice, evaluate_many, format_table
from mlxrun.loader import open_checkpoint
from mlxrun.quant.calibrate import CalibOptions, calib_text, calib_windows

METHODS = ("rtn", "awq", "gptq", "awq-mixed", "mlx-lm-awq", "mlx-lm-gptq")


def _mlx_lm(method: str, dense: Path, out: Path, wins: np.ndarray, grid: int) -> float:
    """mlx-lm's AWQ or GPTQ of `dense` on windows `wins` [n, T] written to `out`;
    returns the calibration seconds (loading and saving excluded)."""
    import mlx.core as mx
    from mlx_lm.quant import gptq
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config
    from mlx_lm.utils import load, save

    model, tok, config = load(str(dense), lazy=True, return_config=True)
    mx.random.seed(123)
    data = mx.array(wins)
    t = time.perf_counter()
    if method == "awq":
        cfg = AWQ_MODEL_CONFIGS[config["model_type"]]
        awq_quantize(
            model, data, cfg, bits=4, group_size=64, embed_bits=4, embed_group_size=32, n_grid=grid
        )
        config = update_config(model, config)
    else:
        model, q = gptq.gptq_quantize(model, data, 4, 64, 4, 32)
        config["quantization"] = config["quantization_config"] = q
    mx.eval(model.parameters())
    secs = time.perf_counter() - t
    save(str(out), str(dense), model, tok, config)
    return secs


def file_bpw(ck, opts: CalibOptions) -> float:
    """Bits per weight of a uniform calibrated int4 g64 file of checkpoint `ck` (the
    embedding and head at opts.embed_group_size, float32 scales): mlx-lm AWQ's size."""
    from mlxrun.quant.formats import QuantSpec
    from mlxrun.quant.mixed_bits import matrix_bytes

    c = ck.config
    lin = QuantSpec("affine", 4, 64)
    emb = QuantSpec("affine", 4, opts.embed_group_size or 64)
    d, f = c.hidden_size, c.intermediate_size
    qd = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    shapes = [(qd, d), (kv, d), (kv, d), (d, qd), (f, d), (f, d), (d, f)]
    heads = 1 if c.tie_word_embeddings else 2
    n = c.num_hidden_layers * sum(o * i for o, i in shapes) + heads * c.vocab_size * d
    nbytes = c.num_hidden_layers * sum(matrix_bytes(s, lin, "float32") for s in shapes)
    nbytes += heads * matrix_bytes((c.vocab_size, d), emb, "float32")
    return 8 * nbytes / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="dense or quantized checkpoint / GGUF")
    ap.add_argument("--backend", default="cpu", help="where mlxrun calibrates and scores")
    ap.add_argument("--methods", default=",".join(METHODS), help="rows, comma separated")
    ap.add_argument("--samples", type=int, default=16, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=320, help="tokens per calibration window")
    ap.add_argument("--grid", type=int, default=20, help="scale search points (both AWQs)")
    ap.add_argument(
        "--target-bpw", type=float, default=None, help="awq-mixed's size (default: awq's)"
    )
    ap.add_argument("--calib-data", default=None, help="calibration text (default: bundled)")
    ap.add_argument("--text", default=None, help="evaluation text (default: bundled)")
    ap.add_argument("--max-tokens", type=int, default=3584, help="evaluation tokens")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--keep", default=None, help="keep (and reuse) the model dirs here")
    ap.add_argument("--calibrate-only", action="store_true", help="with --keep: no scoring")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(methods) - set(METHODS))
    if bad:
        ap.error(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
    if args.calibrate_only and not args.keep:
        ap.error("--calibrate-only needs --keep DIR (where the next run finds the models)")
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        dense = root / "dense"
        if not dense.exists():
            save_dense(args.model, dense, "float32")
        ck = open_checkpoint(str(dense))
        opts = CalibOptions(
            "awq", args.calib_data, args.samples, args.seq_len, seed=0, grid=args.grid
        )
        ids = ck.tokenizer.encode(calib_text(args.calib_data), add_special_tokens=False)
        wins = calib_windows(ids, opts)
        dirs: list[tuple[str, Path]] = []
        for m in methods:
            if m in ("rtn",):
                continue
            out = root / m
            recorded = root / f"{m}.seconds"
            if out.exists() and recorded.exists():  # made by an earlier run with --keep
                times[m] = float(recorded.read_text())
                dirs.append((m, out))
                continue
            shutil.rmtree(out, ignore_errors=True)  # a run killed before it finished
            print(f"== {m}", file=sys.stderr, flush=True)
            t = time.perf_counter()
            if m.startswith("mlx-lm-"):
                times[m] = _mlx_lm(m.removeprefix("mlx-lm-"), dense, out, wins, args.grid)
            else:
                cal = dataclasses.replace(opts, method=m.removesuffix("-mixed"))
                if m.endswith("-mixed"):
                    target = args.target_bpw or file_bpw(ck, opts)
                    cal = dataclasses.replace(cal, target_bpw=target)
                convert(str(dense), str(out), "int4", 64, calibrate=cal, backend=args.backend)
                times[m] = time.perf_counter() - t
            recorded.write_text(f"{times[m]:.3f}")
            dirs.append((m, out))
        if args.calibrate_only:
            print({m: round(times[m], 1) for m, _ in dirs})
            return 0
        extra = against_candidates(ck, [str(d) for _, d in dirs], args.backend, "float32")
        extra = [dataclasses.replace(c, label=m) for c, (m, _) in zip(extra, dirs, strict=True)]
        choices = [QuantChoice(None)] + ([QuantChoice("int4", 64)] if "rtn" in methods else [])
        run = evaluate_many(
            str(dense),
            choices,
            backend=args.backend,
            dtype="float32",
            text=args.text,
            max_tokens=args.max_tokens,
            window=args.window,
            extra=extra,
            progress=True,
        )
    rows = []
    for r in run.results:
        label = {"none": "dense", "int4 g64": "rtn"}.get(r.quant, r.quant)
        rows.append(
            dict(
                dataclasses.asdict(r),
                method=label,
                bits_per_weight=8 * r.bytes_per_weight,
                calib_seconds=times.get(label, 0.0),
            )
        )
    print(
        f"\n{args.model} on {run.backend}, calibration {wins.shape[0]} x {wins.shape[1]} "
        f"tokens, scale grid {args.grid}"
    )
    print(format_table(run.results))
    for r in rows:
        print(
            f"{r['method']}: {r['bits_per_weight']:.3f} bits/weight, "
            f"calibration {r['calib_seconds']:.1f} s"
        )
    if args.json:
        meta = dict(
            model=args.model,
            backend=run.backend,
            samples=int(wins.shape[0]),
            seq_len=int(wins.shape[1]),
            grid=args.grid,
            cpus=os.cpu_count(),
        )
        Path(args.json).write_text(json.dumps(dict(meta, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
