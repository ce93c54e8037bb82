"""Quantization quality on real weights: the eval table for every format, plus mlx-lm's own
4-bit quantization of the same dense weights, all against one unquantized reference.

    python benchmarks/quant_quality.py [--model smollm2] [--backend cpu] [--max-tokens 4096]

For the bundled SmolLM2 GGUF (Q4_1 linears, Q8_0 embedding) the reference is its
dequantized dense weights; every format is quantized from those. The mlx-lm row is made by
`mlx_lm.convert(..., quantize=True, q_group_size=64, q_bits=4)` on a dense float32 copy,
read back by mlxrun and scored through the same windows; its first window is also run
through mlx-lm's own model (MLX) to show both forwards agree. Takes ~15 minutes on 2 CPU
cores (each of the 11 models runs ~4000 tokens).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mlxrun.backends import get_backend
from mlxrun.build import build_model
from mlxrun.dense import dense_checkpoint, quantize_tensors, save_dense
from mlxrun.evaluate import (
    Candidate,
    QuantChoice,
    eval_text,
    evaluate_many,
    expanded,
    format_table,
    matrix_bytes_per_weight,
    summarize_notes,
    window_logits,
)
from mlxrun.loader import open_checkpoint
from mlxrun.quant.formats import resolve

CHOICES = [
    QuantChoice(None),
    QuantChoice("int8"),
    QuantChoice("int4", 32),
    QuantChoice("int4", 64),
    QuantChoice("int4", 128),
    QuantChoice("fp8"),
    QuantChoice("fp4"),
    QuantChoice("nvfp4"),
    QuantChoice("int4", 64, clip_search=True),
]


def _candidate(label: str, source: str, be) -> tuple[Candidate, object]:
    """A Candidate scoring checkpoint `source` with mlxrun on `be`, and its transformer."""
    ck = open_checkpoint(source)
    model, _ = build_model(ck.config, ck.tensors, be, None, progress=False)
    bpw = matrix_bytes_per_weight(model)
    fast = expanded(model)
    return Candidate(label, lambda ids: window_logits(fast, ids), bpw), model


def _same_bytes(mlx_dir: Path, dense_tensors: dict) -> bool:
    """Whether mlx-lm's packed tensors equal the numpy reference's int4 g64 ones."""
    ours, _ = quantize_tensors(dense_tensors, resolve("int4", 64))
    theirs = open_checkpoint(str(mlx_dir)).tensors
    return set(ours) == set(theirs) and all(
        ours[k].dtype == theirs[k].dtype and np.array_equal(ours[k].data, theirs[k].data)
        for k in ours
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm row")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    be = get_backend(args.backend, "float32")
    extra, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_mlx_lm:
            import mlx.core as mx
            from mlx_lm import convert as mlx_convert
            from mlx_lm import load as mlx_load

            dense = save_dense(args.model, Path(tmp) / "dense", "float32")
            mlx_dir = Path(tmp) / "mlx_int4_g64"
            mlx_convert(
                hf_path=str(dense),
                mlx_path=str(mlx_dir),
                quantize=True,
                q_group_size=64,
                q_bits=4,
                q_mode="affine",
            )
            cand, packed = _candidate("mlx-lm int4 g64 (mlx_lm.convert)", str(mlx_dir), be)
            extra.append(cand)
            # mlx-lm's own forward on the start of the text, against mlxrun's on its files
            ck = dense_checkpoint(args.model)
            ids = np.asarray(ck.tokenizer.encode(eval_text(), add_special_tokens=False)[:64])
            m, _ = mlx_load(str(mlx_dir))
            theirs = np.array(m(mx.array(ids[None])).astype(mx.float32))[0]
            ours = window_logits(packed, ids)
            rel = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
            lines.append(
                f"mlx-lm's forward (MLX) vs mlxrun ({args.backend}) on its checkpoint, "
                f"64 tokens: rel. error {rel:.2e}"
            )
            same = _same_bytes(mlx_dir, ck.tensors)
            lines.append(
                "mlx-lm's packed int4 g64 tensors equal mlxrun's numpy reference bit for "
                f"bit: {'yes' if same else 'NO'}"
            )
            del ck, m
        if args.model == "smollm2":
            # the GGUF as shipped (Q4_1/Q8_0, run packed): the reference is its own weights
            cand, _ = _candidate("GGUF Q4_1 as shipped", args.model, be)
            extra.append(cand)
        run = evaluate_many(
            args.model,
            CHOICES,
            backend=args.backend,
            dtype="float32",
            max_tokens=args.max_tokens,
            window=args.window,
            extra=extra,
            progress=True,
        )
    print(f"\n{args.model} on {run.backend}\n{run.reference}")
    print(
        "bytes/weight: linear + embedding matrices as the backend holds them (scales and "
        "biases float32 where quantized here from float32; float16 in the GGUF)\n"
    )
    print(format_table(run.results))
    for line in lines:
        print(line)
    for note in summarize_notes(run.notes):
        print(f"note: {note}")
    print(f"\ntook {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
