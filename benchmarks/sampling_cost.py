"""What one device sampling step costs on CUDA, alone: each plan captured in a CUDA graph
over random logits of the Llama-3 vocabulary, timed by replays (median, device events).

    python benchmarks/sampling_cost.py [--vocab 128256] [--batch 1 32]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from mlxrun.backends.torch_sampling import TorchSampler
from mlxrun.sampling import SamplingParams, pack, plan_for

SETTINGS = {
    "greedy (argmax)": None,
    "temp 0.7": dict(temperature=0.7),
    "temp 0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "temp 0.7 top-k 50": dict(temperature=0.7, top_k=50),
    "temp 0.7 top-k 50 top-p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "temp 0.7 min-p 0.05": dict(temperature=0.7, min_p=0.05),
    "temp 0.7 top-p 0.9 rep-pen 1.1": dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
    "temp 0.7 top-p 0.9 logprobs 5": dict(temperature=0.7, top_p=0.9),
}


def time_graph(fn, reps=200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    a = ap.parse_args()
    print(f"{'setting':34s}" + "".join(f"  batch {b:>3d} us" for b in a.batch))
    for name, kw in SETTINGS.items():
        cells = []
        for B in a.batch:
            logits = (torch.randn(B, a.vocab, device="cuda") * 3).to(torch.bfloat16)
            if kw is None:
                us = time_graph(lambda logits=logits: logits.argmax(-1))
            else:
                params = [SamplingParams(seed=i, **kw) for i in range(B)]
                lp = 5 if "logprobs" in name else None
                plan = plan_for(params, a.vocab, lp)
                s = TorchSampler(plan, pack(params, [[1, 2, 3]] * B, plan), "cuda", triton=True)
                us = time_graph(lambda s=s, logits=logits: s(logits))
            cells.append(f"  {us:12.1f}")
        print(f"{name:34s}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
