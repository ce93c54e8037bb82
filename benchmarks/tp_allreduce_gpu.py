"""The fused sum + residual add + RMSNorm (backends/cuda_allreduce.py) on the GPUs of one
host: every rank's output bit for bit against the one-shot all-reduce then add_rms_norm,
eagerly and from a captured CUDA graph replayed many times (new partials each replay), and
the microseconds of one fused call (pull: each rank reads the others' partials; push: each
writes its partial into the others' buffers, then a flag; lamport: writes it, no flag) against the two launches it replaces ("old":
one-shot sum + add_rms_norm), each as CALLS of them replayed from one graph (a decode step
of an 8B model makes 64).

    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 60 torchrun --nproc-per-node 2 \\
        benchmarks/tp_allreduce_gpu.py --width 4096 --rows 1,4

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
    ap.add_argument("--width", type=int, default=4096)  # not --n: torchrun takes --n*
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    s = AllSum(dev)  # the one-shot sum of the reference
    n, eps = args.width, 1e-5
    peers = {}
    for mode in ("pull", "push", "lamport"):  # whatever MLXRUN_FUSED_SUM says: all three
        a = AllSum(dev)
        a.fused, a.push, a.lamport = a.one_shot, mode != "pull", mode == "lamport"
        peers[mode] = a.peers(n)
        assert peers[mode] is not None, "no symmetric memory handle with buffer/signal ptrs"
    modes = ("pull", "push", "lamport", "old")
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    w = torch.rand(n, device=dev, generator=torch.Generator(device=dev).manual_seed(7)) + 0.5
    w = w.bfloat16()

    def step(mode, y, h):
        if mode == "old":
            return cuda_ops.add_rms_norm(h, s(y.clone()), w, eps)
        return sum_add_rms_norm(y, h, w, eps, peers[mode])

    def differ(a, b):
        return int(not all(torch.equal(bits(u), bits(v)) for u, v in zip(a, b)))

    for rows in (int(r) for r in args.rows.split(",")):
        bad = dict.fromkeys(modes[:3], 0)
        # eager: several uses in a row (the slots alternate), h shared by every rank
        hg = torch.Generator(device=dev).manual_seed(rows)
        h = torch.randn(rows, n, device=dev, generator=hg).bfloat16()
        for _ in range(5):
            y = torch.randn(rows, n, device=dev, generator=g) * 4
            want = step("old", y, h)
            for mode in modes[:3]:
                bad[mode] += differ(step(mode, y, h), want)
        # a graph of `calls` sums chained through h a mode, replayed with new partials
        ys = torch.randn(args.calls, rows, n, device=dev, generator=g)
        h0 = h.clone()

        def chain(mode, ys=ys, h0=h0):
            hh = h0
            for i in range(args.calls):
                hh, x = step(mode, ys[i], hh)
            return hh, x

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for mode in modes:
                chain(mode)
        torch.cuda.current_stream().wait_stream(side)
        graphs, outs = {}, {}
        for mode in modes:
            graphs[mode] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[mode]):
                outs[mode] = chain(mode)
        for rep in range(args.replays):
            ys.copy_(torch.randn(ys.shape, device=dev, generator=g) * (1 + rep % 3))
            for mode in modes:
                graphs[mode].replay()
            torch.cuda.synchronize()
            for mode in modes[:3]:
                bad[mode] += differ(outs[mode], outs["old"])
        times = {mode: [] for mode in modes}
        for _ in range(3):  # alternated, best of 3
            for mode in modes:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                torch.cuda.synchronize()
                a.record()
                for _ in range(20):
                    graphs[mode].replay()
                b.record()
                torch.cuda.synchronize()
                times[mode].append(a.elapsed_time(b) * 1e3 / (20 * args.calls))
        got = torch.tensor([bad[m] for m in modes[:3]], device=dev)
        dist.all_reduce(got)
        if rank == 0:
            row = {"world": world, "rows": rows, "n": n}
            row.update({f"mismatches_{m}": int(v) for m, v in zip(modes, got.tolist())})
            row.update({f"{m}_us": round(min(times[m]), 2) for m in modes})
            print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
