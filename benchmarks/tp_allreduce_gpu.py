"""The fused sum + residual add + RMSNorm (backends/cuda_allreduce.py) on the GPUs of one
host: every rank's output bit for bit against the one-shot all-reduce then add_rms_norm,
eagerly and from a captured CUDA graph replayed many times (new partials each replay), and
the microseconds of one fused call against the two launches it replaces, both as CALLS of
them replayed from one graph (a decode step of an 8B model makes 64).

    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 60 torchrun --nproc-per-node 2 \\
        benchmarks/tp_allreduce_gpu.py --n 4096 --rows 1,4

Rank 0 prints one JSON line per row count; a mismatch or a hang (timeout) is a failure.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from mlxrun.backends import cuda_ops
from mlxrun.backends.cuda_allreduce import sum_add_rms_norm
from mlxrun.backends.torch_tp import AllSum


def bits(t):
    return t.view(torch.int16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    s = AllSum(dev)
    s.fused = s.one_shot  # whatever MLXRUN_FUSED_SUM says: this checks the kernel
    peers = s.peers(args.n)
    assert peers is not None, "no symmetric memory handle with buffer_ptrs/signal_pad_ptrs"
    n, eps = args.n, 1e-5
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    w = torch.rand(n, device=dev, generator=torch.Generator(device=dev).manual_seed(7)) + 0.5
    w = w.bfloat16()

    def reference(y, h):
        return cuda_ops.add_rms_norm(h, s(y.clone()), w, eps)

    for rows in (int(r) for r in args.rows.split(",")):
        bad = 0
        # eager: several uses in a row (the slots alternate), h shared by every rank
        h = torch.randn(
            rows, n, device=dev, generator=torch.Generator(device=dev).manual_seed(rows)
        )
        h = h.bfloat16()
        for _ in range(5):
            y = torch.randn(rows, n, device=dev, generator=g) * 4
            fh, fx = sum_add_rms_norm(y, h, w, eps, peers)
            rh, rx = reference(y, h)
            bad += int(not torch.equal(bits(fh), bits(rh))) + int(
                not torch.equal(bits(fx), bits(rx))
            )
        # a graph of `calls` fused sums chained through h, replayed with new partials
        ys = torch.randn(args.calls, rows, n, device=dev, generator=g)
        h0 = h.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())

        def chain(fused, ys=ys, h0=h0):
            hh = h0
            for i in range(args.calls):
                if fused:
                    hh, x = sum_add_rms_norm(ys[i], hh, w, eps, peers)
                else:
                    hh, x = reference(ys[i], hh)
            return hh, x

        with torch.cuda.stream(side):
            chain(True)
            chain(False)
        torch.cuda.current_stream().wait_stream(side)
        graphs, outs = {}, {}
        for fused in (True, False):
            graphs[fused] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[fused]):
                outs[fused] = chain(fused)
        for rep in range(args.replays):
            ys.copy_(torch.randn(ys.shape, device=dev, generator=g) * (1 + rep % 3))
            graphs[True].replay()
            graphs[False].replay()
            torch.cuda.synchronize()
            for a, b in zip(outs[True], outs[False]):
                bad += int(not torch.equal(bits(a), bits(b)))
        times = {}
        for fused in (True, False):  # alternated, best of 3
            times[fused] = []
        for _ in range(3):
            for fused in (True, False):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                torch.cuda.synchronize()
                a.record()
                for _ in range(20):
                    graphs[fused].replay()
                b.record()
                torch.cuda.synchronize()
                times[fused].append(a.elapsed_time(b) * 1e3 / (20 * args.calls))
        bad_all = torch.tensor([bad], device=dev)
        dist.all_reduce(bad_all)
        if rank == 0:
            print(json.dumps({
                "world": world, "rows": rows, "n": n, "mismatches": int(bad_all.item()),
                "fused_us": round(min(times[True]), 2),
                "one_shot_plus_norm_us": round(min(times[False]), 2),
            }), flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
