"""A/B of mlxrun's MLX path against mlx-lm's generate_step on the same arrays, reps
interleaved (A B C A B C ...) so a shared or drifting machine hits every variant alike.

Variants (each a greedy batch-1 generation, timed at the token yields as `mlxrun bench`):
  mlxrun           the code as it is (SwiGLU one compiled kernel)
  mlxrun-unfused   SwiGLU as three elementwise ops (the code before the fused kernel)
  mlxrun-stream    mlxrun inside a dedicated stream, as mlx-lm's generate_step runs
  mlxrun-maskarray the prompt's causal mask as a boolean array (the code before sdpa's
                   own "causal" mode)
  mlx-lm           mlx-lm's own model classes and generate_step, holding our arrays

    python benchmarks/mlx_vs_mlxlm.py --model shape:llama3-8b --quant none,int4 \
        --prompt-tokens 512 --gen-tokens 128 --reps 5 --json out.json

--model also takes anything `mlxrun.load` does (smollm2, a GGUF, an MLX checkpoint); a
stored-quantized checkpoint runs as stored under its own format and dequantized under none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="shape:llama3-8b")
    ap.add_argument("--quant", default="none,int4")
    ap.add_argument("--dtype", default=None, help="default: the backend's (bf16 GPU, fp32 CPU)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--variants", default="mlxrun,mlxrun-unfused,mlxrun-stream,mlxrun-maskarray,mlx-lm"
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import mlx.core as mx

    from mlxrun import bench_mlxlm
    from mlxrun.api import load
    from mlxrun.backends import get_backend
    from mlxrun.bench import SHAPE_PREFIX, build_random, shape_config
    from mlxrun.bench_models import _dequantized
    from mlxrun.quant.formats import resolve

    results = []
    for q in a.quant.split(","):
        spec = None if q == "none" else resolve(q)
        if a.model.startswith(SHAPE_PREFIX):
            m = build_random(shape_config(a.model), get_backend("mlx", a.dtype), spec)
        else:
            m = load(a.model, backend="mlx", dtype=a.dtype, quant=None, progress=False).transformer
            if spec is None and m.config.quantization is not None:
                m = _dequantized(m)
        mx.eval(m.embed, m.head)
        results += measure(a, q, m, a.variants.split(","))
        del m
        mx.clear_cache()
    if a.json:
        out = dict(
            model=a.model,
            device=str(mx.default_device()),
            mlx=mx.__version__,
            mlx_lm=bench_mlxlm.version(),
            settings=vars(a),
            rows=results,
        )
        with open(a.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(a.json + ".tmp", a.json)


def measure(a, q: str, m, names: list[str]) -> list[dict]:
    """Interleaved reps of each variant on model `m`; one result dict per variant."""
    import mlx.core as mx

    from mlxrun import bench_mlxlm
    from mlxrun.backends import mlx_backend as mb
    from mlxrun.backends.base import causal_mask_np
    from mlxrun.bench_models import _weights_label
    from mlxrun.bench_timing import _run_once
    from mlxrun.sampling import SamplingParams

    fused, causal = mb._swiglu_fused, mb.MLXCache.mask
    stream = mx.new_stream(mx.default_device())
    greedy = SamplingParams()
    mlm = bench_mlxlm.mlx_lm_model(m)
    prompt = np.random.default_rng(0).integers(0, m.config.vocab_size, a.prompt_tokens).tolist()

    def mask_array(cache, length, pads, window=None):
        m = causal_mask_np(cache.offset, length, pads, window)
        return None if m is None else mx.array(m)

    def ours(swiglu=fused, in_stream=False, mask=causal):
        mb._swiglu_fused, mb.MLXCache.mask = swiglu, mask
        try:
            if in_stream:
                with mx.stream(stream):
                    return _run_once(m, [prompt], a.gen_tokens, greedy)
            return _run_once(m, [prompt], a.gen_tokens, greedy)
        finally:
            mb._swiglu_fused, mb.MLXCache.mask = fused, causal

    runs = {
        "mlxrun": lambda: ours(),
        "mlxrun-unfused": lambda: ours(swiglu=mb._swiglu),
        "mlxrun-stream": lambda: ours(in_stream=True),
        "mlxrun-maskarray": lambda: ours(mask=mask_array),
        "mlx-lm": lambda: bench_mlxlm.run_once(mlm, prompt, a.gen_tokens),
    }
    for n in names:  # warm-up at the timed shapes
        runs[n]()
    samples = {n: [] for n in names}
    for _ in range(a.reps):
        for n in names:
            samples[n].append(runs[n]())
    rows = []
    for n in names:
        ttft = [t for t, _ in samples[n]]
        tps = [s for _, s in samples[n]]
        row = dict(
            variant=n,
            quant=q,
            weights=_weights_label(m),
            decode_tps=statistics.median(tps),
            decode_tps_reps=tps,
            prefill_tps=a.prompt_tokens / statistics.median(ttft),
            ttft_ms_reps=[1e3 * t for t in ttft],
        )
        rows.append(row)
        print(
            f"{q:5s} {n:16s} decode {row['decode_tps']:8.1f} tok/s "
            f"[{min(tps):.1f}-{max(tps):.1f}]  prefill {row['prefill_tps']:9.1f} tok/s",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
