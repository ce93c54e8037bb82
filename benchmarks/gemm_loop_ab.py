"""Batched-decode GEMM launches timed in the model's decode step (CUDA, random weights).

    python3 benchmarks/gemm_loop_ab.py [--model shape:llama3-8b] [--quant int4]
        [--batch 32,64] [--context 1024] [--variants "default;128,4,1,2,2,0,1"]
        [--steps 32] [--rounds 3] [--json out.json]

A variant is a launch as MLXRUN_SMALL_M_GEMM takes it ("BLOCK_N,warps,stages,groups,
waves[,l2[,r]]", see benchmarks/gemm_smallm.py), set for M <= 32 and M <= 64 alike, or
"default" (choose_config as shipped). Per batch the model is prefilled once with `context`
tokens a row, the decode step is captured as a CUDA graph once per variant over that KV
cache, and the graphs are replayed alternately, `steps` steps a measurement, `rounds`
rounds, the cache rewound to `context` each time: ms a step (min over rounds) and tok/s
(batch / step). The greedy tokens of the first step are compared across variants (equal
outputs are expected: the launches differ in tiling and K split only, and the split's sum
order can move a near-tie, so a difference is reported, not fatal).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def patch(spec: str):
    """Make choose_config give batched decode the launch `spec`; returns undo."""
    from mlxrun.quant import triton_launch as launch

    saved = launch.SMALL_M_GEMM, launch.SMALL_M_GEMM_64
    if spec != "default":
        launch.SMALL_M_GEMM = launch.SMALL_M_GEMM_64 = launch._small_m_gemm(spec)

    def undo():
        launch.SMALL_M_GEMM, launch.SMALL_M_GEMM_64 = saved

    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:llama3-8b")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--batch", default="32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default="default", help="';'-separated launches")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from mlxrun.backends.cuda_graph import GraphDecoder
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.bench import _quant_specs, build_random, shape_config
    from mlxrun.memory import prefill_chunk_for

    cfg = shape_config(a.model)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    variants = a.variants.split(";")
    be = TorchBackend("cuda", "bfloat16")
    out: dict = {}
    for qn, spec in _quant_specs(a.quant.split(",")).items():
        t0 = time.time()
        model = build_random(cfg, be, spec)
        print(f"{qn}: model {time.time() - t0:.1f} s", flush=True)
        for batch in [int(b) for b in a.batch.split(",")]:
            t0 = time.time()
            cache = model.make_cache(batch, a.context + a.steps + 16)
            ids = torch.randint(0, cfg.vocab_size, (batch, a.context), device="cuda")
            chunk = prefill_chunk_for(be.name, be.memory_kind, batch)
            for s in range(0, a.context, chunk):
                model(ids[:, s : s + chunk], cache, None, last_only=True)
            torch.cuda.synchronize()
            print(f"{qn} batch {batch}: prefill {time.time() - t0:.1f} s", flush=True)
            decs, first = {}, {}
            for v in variants:
                t0 = time.time()
                undo = patch(v)
                try:
                    cache.offset = a.context
                    decs[v] = GraphDecoder(model, cache, batch, None)
                finally:
                    undo()
                cache.offset = a.context
                cache.rewind()
                decs[v].tok.zero_()  # the same input tokens for every variant
                first[v] = decs[v](decs[v].tok.view(-1)).clone()
                print(f"  captured {v} in {time.time() - t0:.1f} s", flush=True)
            ref = first[variants[0]]
            for v in variants[1:]:
                same = (first[v] == ref).float().mean().item()
                if same < 1:
                    print(f"  {v}: first-step tokens {same:.1%} equal to {variants[0]}'s")
            res: dict = {v: [] for v in variants}
            for r in range(a.rounds):
                for v in variants if r % 2 == 0 else variants[::-1]:
                    dec = decs[v]
                    cache.offset = a.context
                    cache.rewind()
                    dec(dec.tok.view(-1))  # warm
                    cache.offset = a.context
                    cache.rewind()
                    torch.cuda.synchronize()
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(a.steps):
                        dec(dec.tok.view(-1))
                    e1.record()
                    torch.cuda.synchronize()
                    res[v].append(e0.elapsed_time(e1) / a.steps)
            base = min(res[variants[0]])
            for v in variants:
                ms = res[v]
                print(f"  {qn} b{batch} {v:18s} ms/step " + " ".join(f"{t:.4f}" for t in ms)
                      + f"  min {min(ms):.4f} ({batch * 1e3 / min(ms):,.1f} tok/s, "
                      f"{100 * (min(ms) / base - 1):+.2f}% vs {variants[0]})", flush=True)  # fmt: skip
            out[f"{qn} b{batch}"] = res
            if a.json:  # after each batch: a later one may run out of time
                with open(a.json + ".tmp", "w") as f:
                    json.dump(out, f, indent=1)
                os.replace(a.json + ".tmp", a.json)
            for d in decs.values():
                d.close()
            del decs, cache
            torch.cuda.empty_cache()
        del model
        be.release()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
