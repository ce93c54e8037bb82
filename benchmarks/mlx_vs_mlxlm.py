"""A/B of mlxrun's MLX path against mlx-lm's generate_step on the same arrays, reps
interleaved (A B C A B C ...) so a shared or drifting machine hits every variant alike.

Variants (each a greedy batch-1 generation, timed at the token yields as `mlxrun bench`,
plus CPU times, see `clocked`; and per format the host CPU time to build one decode
step's graph in each engine, see `build_ms`):
  mlxrun           the code as it is
  mlxrun-unfused   SwiGLU as three elementwise ops (the code before the fused kernel)
  mlxrun-finite    the logits' NaN/inf check as eight kernels (before it was compiled)
  mlxrun-allqueries  the prompt pass's last layer projects, rotates and attends with every
                   query, its output then cut to the last row (before: now the last query
                   alone, as mlx-lm leaves the others unevaluated)
  mlxrun-fullrows  the prompt pass's last layer runs its attention, output projection and MLP
                   on every row (before both cuts: now on the last row alone, the one whose
                   logits are kept)
  mlxrun-stream    mlxrun inside a dedicated stream, as mlx-lm's generate_step runs
  mlxrun-maskarray the prompt's causal mask as a boolean array (the code before sdpa's
                   own "causal" mode)
  mlxrun-ropebase  rope from its base, as mlx-lm's nn.RoPE, not our stored freqs (unscaled
                   rope only)
  mlxrun-chunk2048 prefill in passes of 2048 tokens (mlx-lm's), not the planner's 512
  mlxrun-denseprefill  passes of 64 rows or more expand each packed weight and run a dense
                   matmul (MLXBackend.dense_rows), not MLX's quantized one; decode as is
  mlx-lm           mlx-lm's own model classes and generate_step, holding our arrays

    python benchmarks/mlx_vs_mlxlm.py --model shape:llama3-8b --quant none,int4 \
        --prompt-tokens 512 --gen-tokens 128 --reps 5 --json out.json

--model also takes anything `mlxrun.load` does (smollm2, a GGUF, an MLX checkpoint); a
stored-quantized checkpoint runs as stored under its own format and dequantized under none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

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
        "--variants",
        default="mlxrun,mlxrun-finite,mlxrun-allqueries,mlxrun-fullrows,mlxrun-stream,"
        "mlxrun-ropebase,mlxrun-chunk2048,mlxrun-denseprefill,mlx-lm",
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


def clocked(steps) -> tuple[float, float, float, float, float, float]:
    """Run a token generator: (TTFT s, decode steps/s over tokens 2..n, host CPU ms a step,
    queueing ms a step, process CPU ms of the prompt, process CPU ms a step).

    Clocked at each yield, which follows the token's read to the host (a synchronisation),
    as `mlxrun bench` clocks both engines. Host CPU: the calling thread's CPU time over the
    decode steps (Python building each step's graph, MLX queueing its kernels, the token's
    conversion; not its waits where they block, as on the CPU device; a wait that spins
    counts). Queueing: from the previous yield to the return of mx.async_eval, through
    which both loops queue step n+1 before reading token n; it includes any wait MLX makes
    there for earlier work to drain (it caps the tasks in flight). Process CPU: every
    thread's, MLX's CPU workers included: on the CPU device, the work itself, which a
    loaded machine delays but does not add to.
    """
    import mlx.core as mx

    queued, yields, cpu, proc, async_eval = [], [], [], [], mx.async_eval

    def clocked_async_eval(*xs):
        async_eval(*xs)
        queued.append(time.perf_counter())

    mx.synchronize()
    mx.async_eval = clocked_async_eval  # both loops look it up on the module at each call
    try:
        t0, p0 = time.perf_counter(), time.process_time()
        for _ in steps:
            yields.append(time.perf_counter())
            cpu.append(time.thread_time())
            proc.append(time.process_time())
    finally:
        mx.async_eval = async_eval
    n = len(yields) - 1
    # queued[0] is the prompt's step; queued[k + 2], step k + 2's, follows yields[k]
    queue = [q - y for q, y in zip(queued[2:], yields)]
    return (
        yields[0] - t0,
        n / (yields[-1] - yields[0]),
        1e3 * (cpu[-1] - cpu[0]) / n,
        1e3 * statistics.median(queue),
        1e3 * (proc[0] - p0),
        1e3 * (proc[-1] - proc[0]) / n,
    )


def build_ms(m, mlm, steps: int = 64, reps: int = 5) -> dict[str, float]:
    """Host CPU ms to build one greedy decode step's graph, nothing evaluated (Python and
    MLX's graph construction alone, medians of `reps`): the host's share of a step that no
    wait or load on the device can blur. Each engine as its loop builds a step."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([list(range(1, 17))])

    def ours():
        cache = m.make_cache(1, 17 + steps)
        y = mx.argmax(m(prompt, cache, last_only=True), axis=-1)
        mx.eval(y, *cache.keys, *cache.values)
        t0 = time.thread_time()
        for _ in range(steps):
            logits = m(y.reshape(1, 1), cache, None, True)
            y, _ = m.be.argmax(logits), m.be.finite_rows(logits)
        return time.thread_time() - t0

    def theirs():
        cache = make_prompt_cache(mlm)
        y = mx.argmax(mlm(prompt, cache=cache)[:, -1, :], axis=-1)
        mx.eval(y, [c.state for c in cache])
        t0 = time.thread_time()
        for _ in range(steps):
            logits = mlm(y[:, None], cache=cache)[:, -1, :]
            y = mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
        return time.thread_time() - t0

    t = {"mlxrun": [], "mlx-lm": []}
    for _ in range(reps):
        t["mlxrun"].append(ours())
        t["mlx-lm"].append(theirs())
    return {k: 1e3 * statistics.median(v) / steps for k, v in t.items()}


def measure(a, q: str, m, names: list[str]) -> list[dict]:
    """Interleaved reps of each variant on model `m`; one result dict per variant."""
    import mlx.core as mx

    from mlxrun import bench_mlxlm
    from mlxrun import model as model_py
    from mlxrun.backends import mlx_backend as mb
    from mlxrun.backends.base import causal_mask_np
    from mlxrun.bench_models import _weights_label
    from mlxrun.generate import generate_step
    from mlxrun.model import Transformer
    from mlxrun.sampling import SamplingParams

    stream = mx.new_stream(mx.default_device())
    greedy = SamplingParams()
    mlm = bench_mlxlm.mlx_lm_model(m)
    gen_mlx_lm = bench_mlxlm._mlx_lm()[0].generate_step
    prompt = np.random.default_rng(0).integers(0, m.config.vocab_size, a.prompt_tokens).tolist()
    theta = m.config.rope_theta
    block = Transformer.block

    def full_rows(self, *args):  # block() without its last argument, last_row
        return block(self, *args[:9])

    def all_queries(q, mask):  # last_query() undone: block() then cuts the output
        return q, mask

    def mask_array(cache, length, pads, window=None):
        m = causal_mask_np(cache.offset, length, pads, window)
        return None if m is None else mx.array(m)

    def rope_base(be, x, positions, freqs):  # mlx-lm's nn.RoPE: the base, no freqs array
        return mx.fast.rope(x, x.shape[-1], traditional=False, base=theta, scale=1.0,
                            offset=positions)  # fmt: skip

    def ours(patches=(), in_stream=False, chunk=None):
        """Our generate_step with `patches` ((owner, name, value): the code before a
        change, or mlx-lm's way of a step) in place for the run."""
        saved = [(o, n, getattr(o, n)) for o, n, _ in patches]
        for o, n, v in patches:
            setattr(o, n, v)
        try:
            with mx.stream(stream) if in_stream else contextlib.nullcontext():
                return clocked(generate_step(m, [prompt], greedy, a.gen_tokens, chunk))
        finally:
            for o, n, v in saved:
                setattr(o, n, v)

    runs = {
        "mlxrun": lambda: ours(),
        "mlxrun-unfused": lambda: ours([(mb, "_swiglu_fused", mb._swiglu)]),
        "mlxrun-finite": lambda: ours([(mb, "_finite_fused", mb._finite)]),
        "mlxrun-allqueries": lambda: ours(
            [(model_py, "last_query", all_queries), (mb.MLXBackend, "short_queries", False)]
        ),
        "mlxrun-fullrows": lambda: ours([(Transformer, "block", full_rows)]),
        "mlxrun-stream": lambda: ours(in_stream=True),
        "mlxrun-maskarray": lambda: ours([(mb.MLXCache, "mask", mask_array)]),
        "mlxrun-ropebase": lambda: ours([(mb.MLXBackend, "rope", rope_base)]),
        "mlxrun-chunk2048": lambda: ours(chunk=2048),
        "mlxrun-denseprefill": lambda: ours([(mb.MLXBackend, "dense_rows", 64)]),
        "mlx-lm": lambda: clocked(gen_mlx_lm(mx.array(prompt), mlm, max_tokens=a.gen_tokens)),
    }
    if m.config.rope_scaling is not None and "mlxrun-ropebase" in names:
        print("mlxrun-ropebase skipped: the model's rope is scaled (freqs, in both engines)")
        names = [n for n in names if n != "mlxrun-ropebase"]
    for n in names:  # warm-up at the timed shapes
        runs[n]()
    samples = {n: [] for n in names}
    for _ in range(a.reps):
        for n in names:
            samples[n].append(runs[n]())
    build = build_ms(m, mlm)
    print(
        f"{q:5s} graph build, host CPU a step: mlxrun {build['mlxrun']:.3f} ms, "
        f"mlx-lm {build['mlx-lm']:.3f} ms",
        flush=True,
    )
    rows = []
    for n in names:
        ttft, tps, host, queue, pcpu, dcpu = (list(x) for x in zip(*samples[n]))
        row = dict(
            variant=n,
            quant=q,
            weights=_weights_label(m),
            decode_tps=statistics.median(tps),
            decode_tps_reps=tps,
            prefill_tps=a.prompt_tokens / statistics.median(ttft),
            ttft_ms_reps=[1e3 * t for t in ttft],
            host_cpu_ms=statistics.median(host),
            host_cpu_ms_reps=host,
            queue_ms=statistics.median(queue),
            queue_ms_reps=queue,
            prefill_cpu_ms=statistics.median(pcpu),
            prefill_cpu_ms_reps=pcpu,
            decode_cpu_ms=statistics.median(dcpu),
            decode_cpu_ms_reps=dcpu,
        )
        if n in build:
            row["build_ms"] = build[n]
        rows.append(row)
        print(
            f"{q:5s} {n:19s} decode {row['decode_tps']:8.1f} tok/s "
            f"[{min(tps):.1f}-{max(tps):.1f}]  prefill {row['prefill_tps']:9.1f} tok/s "
            f"[{a.prompt_tokens / max(ttft):.1f}-{a.prompt_tokens / min(ttft):.1f}]  "
            f"host CPU {row['host_cpu_ms']:.3f} ms/step [{min(host):.3f}-{max(host):.3f}]  "
            f"queue {row['queue_ms']:.3f}  process CPU: prompt {row['prefill_cpu_ms']:.1f} ms "
            f"[{min(pcpu):.1f}-{max(pcpu):.1f}], step {row['decode_cpu_ms']:.3f} ms "
            f"[{min(dcpu):.3f}-{max(dcpu):.3f}]",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
