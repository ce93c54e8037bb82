"""Decode speed of a random model of a given shape split over a launcher's ranks (tensor
parallel), to compare with the same script on one process; and, on CUDA, what one
all-reduce of a decode step's activation costs inside a CUDA graph.

    # one GPU (the baseline), then two:
    torchrun --nproc-per-node 1 benchmarks/tp_decode.py --shape llama3-8b --quant none,int4
    torchrun --nproc-per-node 2 benchmarks/tp_decode.py --shape llama3-8b --quant none,int4
    # CPU check of the code path (gloo; SmolLM2's shape splits over 1 or 3 ranks):
    torchrun --nproc-per-node 3 benchmarks/tp_decode.py --shape smollm2 --backend cpu \\
        --prompt-tokens 8 --gen-tokens 8 --reps 1

Each rank builds only its shard (mlxrun.shard's config: its heads, KV heads and MLP rows,
and its vocabulary rows of the embedding and head) with random weights; decode runs the
backend's captured graph on CUDA, with the two all-reduces a layer, the embedding's sum and
the logits' all-gather inside it. Rank 0 prints one JSON line per format.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from mlxrun.backends import get_backend
from mlxrun.bench import build_random, measure_bandwidth, shape_config, weight_bytes
from mlxrun.bench_timing import _run_once
from mlxrun.distributed import join
from mlxrun.quant.formats import resolve
from mlxrun.sampling import SamplingParams
from mlxrun.shard import check, shard_config, vocab_shard


def allreduce_us(be, hidden: int, calls: int = 64, reps: int = 50) -> float:
    """Microseconds of one all-reduce of a (1, hidden) activation, as `calls` of them
    replayed from one CUDA graph (a decode step of 32 layers makes 64). float32, as the
    model's partial products are summed (backends/torch_tp.py)."""
    import torch  # noqa: PLC0415

    x = torch.ones((1, hidden), dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            be.all_sum(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            be.all_sum(x)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * calls)


def profile(model, prompts, rank: int, path: str, steps: int = 16) -> None:
    """Every rank generates 2 tokens, then 2 + `steps` (the sums need them all); rank 0 runs
    both under torch.profiler and writes each kernel's device time a decode step (the
    difference of the two runs over `steps`, so the prefill drops out), most first, to
    `path` (text) and `path`.json."""
    import torch  # noqa: PLC0415

    greedy = SamplingParams()
    runs = []
    for n in (2, 2 + steps):  # (one token alone has no decode rate to report)
        if rank != 0:
            _run_once(model, prompts, n, greedy)
            continue
        # the device's kernels only (CPU ops would count their kernels twice); on the CPU
        # (a check of this code) the ops, nested ones counted twice
        cuda = torch.cuda.is_available()
        acts = [getattr(torch.profiler.ProfilerActivity, "CUDA" if cuda else "CPU")]
        with torch.profiler.profile(activities=acts) as prof:
            _run_once(model, prompts, n, greedy)
        runs.append(
            {
                e.key: (e.device_time_total if cuda else e.cpu_time_total, e.count)
                for e in prof.key_averages()
            }
        )
    if rank != 0:
        return
    a, b = runs
    rows = []
    for k, (us, cnt) in b.items():
        us0, cnt0 = a.get(k, (0, 0))
        rows.append((k, (us - us0) / steps, (cnt - cnt0) / steps))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    lines = [f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel (rank 0, total {total:.1f} us)"]
    for k, us, cnt in rows:
        if us > 0.5:
            lines.append(f"{us:9.1f} {cnt:6.1f} {us / max(cnt, 1e-9):8.2f}  {k[:90]}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path + ".json", "w") as f:
        json.dump({"total_us": total, "kernels": rows}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quant", default="none", help="comma list: none, int4, int8, fp8, ...")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--profile", default=None, help="file: rank 0's per-kernel device time of 16 tokens"
    )
    a = ap.parse_args()
    be = get_backend(a.backend, a.dtype)
    group = join(be)
    tp, rank = (1, 0) if group is None else (group.size, group.rank)
    cfg = shape_config(a.shape)
    rng = np.random.default_rng(0)  # the same prompts on every rank
    prompts = rng.integers(0, cfg.vocab_size, (a.batch, a.prompt_tokens)).tolist()
    out = {"shape": a.shape, "tp": tp, "backend": be.describe(), "batch": a.batch}
    if group is not None and be.name == "torch" and be.device == "cuda":
        out["allreduce_us"] = round(allreduce_us(be, cfg.hidden_size), 2)
    bandwidth = statistics.median(measure_bandwidth(be))  # this rank's device, bytes/s
    for q in a.quant.split(","):
        spec = None if q == "none" else resolve(q)
        check(cfg, tp, {spec.group_size} if spec else set())
        vocab = vocab_shard(cfg, tp, rank)  # this rank's rows of the embedding and head
        model = build_random(shard_config(cfg, tp), be, spec, seed=rank, vocab=vocab)
        greedy = SamplingParams()
        _run_once(model, prompts, a.gen_tokens, greedy)  # warm-up (and the graph capture)
        runs = [_run_once(model, prompts, a.gen_tokens, greedy) for _ in range(a.reps)]
        steps = statistics.median(r[1] for r in runs)
        per_step = weight_bytes(model, a.batch)[1]  # what one rank reads a step
        row = out | {
            "quant": q,
            "ttft_s": round(statistics.median(r[0] for r in runs), 5),
            "decode_tok_s": round(a.batch * steps, 2),
            "rank_weight_bytes_per_step": per_step,
            "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
            # weights only (the KV cache of a short context is far smaller)
            "roofline": round(steps * per_step / bandwidth, 3),
        }
        if rank == 0:
            print(json.dumps(row), flush=True)
        if a.profile:
            profile(model, prompts, rank, f"{a.profile}.{q}.txt")
        del model
        if hasattr(be, "release"):
            be.release()


if __name__ == "__main__":
    main()
