"""Decode attention's launch (cuda_attention.AttnLaunch) timed in the model's batched decode
step (CUDA, random weights), variants alternated in one process.

    python3 benchmarks/attn_loop_ab.py [--model shape:llama3-8b] [--quant int4]
        [--batch 32:default,per_sm=1;64:default,per_sm=4] [--context 1024] [--steps 32]
        [--rounds 4] [--json out.json]

Per batch, the KV cache is filled with random keys and values up to `context` (no prefill:
its kernels would cost compiles and time, and the decode step reads the cache the same), the
decode step is captured as a CUDA graph once per variant (the AttnLaunch fields of
MLXRUN_ATTN_LAUNCH's form joined by "+", "default" for none; "gemm=128_4_3_4_1_2" sets the
batched-decode GEMM's launch, MLXRUN_SMALL_M_GEMM's numbers), and the graphs are replayed
alternately, `steps` steps a measurement, `rounds` rounds (every other one in reverse order),
the cache rewound to `context` each time: ms a step and tok/s (batch / step), the min and the
median of the rounds. The weights are built once for every batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:llama3-8b")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--batch", default="32:default,per_sm=1;64:default,per_sm=4",
                    help="BATCH:VARIANT,VARIANT;... (a variant's fields joined by '+')")  # fmt: skip
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from mlxrun.backends import cuda_attention as ca
    from mlxrun.backends.cuda_graph import GraphDecoder
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.bench import _quant_specs, build_random, shape_config
    from mlxrun.quant import triton_launch as launch_mod

    t0 = time.time()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    cfg = shape_config(a.model)
    be = TorchBackend("cuda", "bfloat16")
    spec = _quant_specs([a.quant])[a.quant]
    model = build_random(cfg, be, spec)
    print(f"model built [{time.time() - t0:.1f} s]", flush=True)
    out: dict = {}
    env_launch = ca._env_launch
    small_m = launch_mod.SMALL_M_GEMM, launch_mod.SMALL_M_GEMM_64
    for part in a.batch.split(";"):
        batch, _, names = part.partition(":")
        batch, variants = int(batch), names.split(",")
        cache = model.make_cache(batch, a.context + a.steps + 16)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for t in cache.keys + cache.values:  # (B, kv heads, slots, D)
            t.normal_(generator=gen)
        decs = {}
        for v in variants:
            items = [] if v == "default" else v.split("+")
            gemm = [i.split("=")[1].replace("_", ",") for i in items if i.startswith("gemm=")]
            launch = ca.AttnLaunch.from_spec(",".join(i for i in items if "gemm=" not in i))
            ca._env_launch = lambda launch=launch: launch  # what decode_attention reads
            if gemm:  # the batched-decode GEMM's launch (MLXRUN_SMALL_M_GEMM's numbers)
                launch_mod.SMALL_M_GEMM = launch_mod.SMALL_M_GEMM_64 = launch_mod._small_m_gemm(
                    gemm[0]
                )
            try:
                cache.offset = a.context
                decs[v] = GraphDecoder(model, cache, batch, None)
            finally:
                ca._env_launch = env_launch
                launch_mod.SMALL_M_GEMM, launch_mod.SMALL_M_GEMM_64 = small_m
            print(f"batch {batch} {v}: captured [{time.time() - t0:.1f} s]", flush=True)
        res: dict = {v: [] for v in variants}
        out[str(batch)] = res
        for r in range(a.rounds):
            # every other round in reverse order: a drift over the run (the clocks of a busy
            # host) then weighs on every variant alike
            for v in variants if r % 2 == 0 else variants[::-1]:
                dec = decs[v]
                tok = dec.tok.view(-1)
                cache.offset = a.context
                cache.rewind()
                dec(tok)  # warm
                cache.offset = a.context
                cache.rewind()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(a.steps):
                    dec(tok)
                e1.record()
                torch.cuda.synchronize()
                res[v].append(e0.elapsed_time(e1) / a.steps)
            print(f"batch {batch} round {r}: " + ", ".join(f"{v} {res[v][-1]:.4f}" for v in variants)
                  + f" ms/step [{time.time() - t0:.1f} s]", flush=True)  # fmt: skip
            if a.json:  # after each round: a time limit keeps what was measured
                with open(a.json + ".tmp", "w") as f:
                    json.dump(out, f, indent=1)
                os.replace(a.json + ".tmp", a.json)
        base = min(res[variants[0]])
        mid = statistics.median(res[variants[0]])
        for v in variants:
            ms, md = min(res[v]), statistics.median(res[v])
            print(f"batch {batch} {v:20s} ms/step " + " ".join(f"{t:.4f}" for t in res[v])
                  + f"  min {ms:.4f} ({batch * 1e3 / ms:.1f} tok/s, "
                  f"{100 * (ms / base - 1):+.2f}% vs {variants[0]}), median {md:.4f} "
                  f"({100 * (md / mid - 1):+.2f}%)", flush=True)  # fmt: skip
        for d in decs.values():
            d.close()
        del decs, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
