"""Decode speed on the CPU: mlxrun (PyTorch-CPU and MLX-CPU) against Hugging Face
transformers' generate() on the same SmolLM2 weights and dtype, in one process.

    python benchmarks/cpu_decode_vs_hf.py [--tokens 128] [--reps 3] [--gguf FILE.gguf]

Both load one dense float32 copy of the bundled GGUF (written by mlxrun.dense.save_dense)
and decode greedily from the same prompt. With --gguf, both read that file instead:
transformers through its GGUF loader (dequantized to float32), mlxrun as `generate` would
(its default path: the weights as stored, or dense where the plan says that is faster). Decode tokens/s = (N - 1) / (time of token N -
time of token 1): prefill is excluded for both.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def hf_dense_dir(tmp: Path) -> Path:
    """The bundled GGUF dequantized to a float32 Hugging Face directory (mlxrun's own
    `save_dense`: transformers 5 refuses to save a model it loaded from GGUF)."""
    from mlxrun.dense import save_dense

    return save_dense("smollm2", tmp / "smollm2-f32", "float32")


class Timer:
    """Streamer for transformers' generate(): records when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.first = True

    def put(self, value):
        if self.first:  # the prompt is put first
            self.first = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def decode_tps(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def bench_hf(d: Path, ids: list[int], n: int, reps: int, gguf: Path | None = None) -> list[float]:
    from transformers import AutoModelForCausalLM

    if gguf is None:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
    x = torch.tensor([ids])
    out = []
    for _ in range(reps + 1):
        t = Timer()
        with torch.no_grad():
            hf.generate(
                x, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=t, pad_token_id=0
            )
        out.append(decode_tps(t.times))
    return out[1:]  # the first run warms up


def bench_mlxrun(
    d: Path, backend: str, ids: list[int], n: int, reps: int, default: bool = False
) -> list[float]:
    import mlxrun
    from mlxrun.generate import generate_step
    from mlxrun.sampling import SamplingParams

    if default:  # as `mlxrun generate` loads it
        m = mlxrun.load(str(d), backend=backend, progress=False, fastest=True)
        print(f"mlxrun --backend {backend}: {m.transformer.be.describe()}; " + "; ".join(m.notes))
    else:
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    out = []
    for _ in range(reps + 1):
        times = []
        for _tok in generate_step(m.transformer, [ids], SamplingParams(), max_tokens=n):
            times.append(time.perf_counter())
        out.append(decode_tps(times))
    return out[1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gguf", type=Path, default=None, help="both engines read this file")
    args = ap.parse_args()
    import mlxrun
    from mlxrun.loader import open_checkpoint

    tmp = Path(tempfile.mkdtemp())
    g = None if args.gguf is None else args.gguf.resolve()
    try:
        d = hf_dense_dir(tmp) if g is None else g
        tok = open_checkpoint(str(d)).tokenizer
        ids = tok.prompt_ids("What is the capital of France?")
        rows = {"transformers generate()": bench_hf(d, ids, args.tokens, args.reps, g)}
        for be in ("cpu", "mlx"):
            try:
                rows[f"mlxrun --backend {be}"] = bench_mlxrun(
                    d, be, ids, args.tokens, args.reps, default=g is not None
                )
            except mlxrun.MlxrunError as e:
                print(f"skipped {be}: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(rows["transformers generate()"])
    print(
        f"{'SmolLM2-135M float32' if g is None else g.name}, {len(ids)}-token prompt, {args.tokens} greedy tokens, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(f"{'engine':28s} {'decode tok/s':>12s} {'min':>8s} {'max':>8s} {'vs HF':>7s}")
    for name, v in rows.items():
        med = statistics.median(v)
        print(f"{name:28s} {med:12.1f} {min(v):8.1f} {max(v):8.1f} {med / base:6.2f}x")
    ours = statistics.median(rows["mlxrun --backend cpu"])
    print(
        f"PyTorch-CPU ratio mlxrun / transformers = {ours / base:.2f} "
        f"({'OK' if ours >= base else 'SLOWER'})"
    )
    return 0 if ours >= base else 1


if __name__ == "__main__":
    raise SystemExit(main())
