"""One layer's decode attention on CUDA (backends/cuda_attention.py) over a bf16, int8 or fp8
KV cache: microseconds a call and GB/s of the K/V bytes it reads (codes and scales), inside a
CUDA graph, launch choices side by side (cuda_attention.AttnLaunch's fields: "" the default,
"per_sm_quant=8", "block=128,stages=2", "fp8_f16=0", ...), and "rope=0" / "rope=1" in a
spec: the step's rope and K/V store too, by rope_qkv's launch before the attention (0) or by
the attention kernel itself (1, torch_kv.RopeStep).

    python3 benchmarks/kv_attention.py                     # 4k and 32k, batch 1 and 8
    python3 benchmarks/kv_attention.py --contexts 32768 --batches 1 \
        --variants ";per_sm_quant=8;stages=2" --json /tmp/attn.json

Llama-3.1-8B's attention shape by default (32 query heads, 8 kv heads, head_dim 128); the cache
holds context + 128 positions and the mask shows the first `context`, as graph decode runs it.
Where one layer's K/V fit in L2 the graph cycles through enough layers' caches that each call
reads from memory. Variants alternate within each repetition; the median is printed. Every
variant's output is checked against SDPA over the dequantized cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # a check of the script itself, tiny sizes, under Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32  # (the interpreter's bf16 is not)

from mlxrun.backends import cuda_attention as ca  # noqa: E402
from mlxrun.backends.torch_kv import QuantKV, RopeStep  # noqa: E402
from mlxrun.kvquant import torch_dequantize, torch_quantize  # noqa: E402


def _cache(kind, B, nkv, S, D, copies):
    """`copies` (k, v) layer caches, bf16 or QuantKV, and their bytes a call reads / S."""
    out = []
    for _ in range(copies):
        k, v = (torch.randn(B, nkv, S, D, device=DEV, dtype=DT) for _ in "kv")
        if kind != "bf16":
            k, v = (QuantKV(*torch_quantize(x, kind), kind) for x in (k, v))
        out.append((k, v))
    per_key = 2 * nkv * (D * 2 if kind == "bf16" else D + 4)  # keys and values (and scales)
    return out, per_key


def _dense(x):
    if isinstance(x, QuantKV):
        return torch_dequantize(x.codes, x.scales, x.kind, torch.float32)
    return x.float()


def _bits_equal(a, b):
    if isinstance(a, QuantKV):
        return torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _time(replay, calls, reps):
    if DEV == "cpu":
        t = time.perf_counter()
        replay()
        return [(time.perf_counter() - t) * 1e6 / calls]
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        a.record()
        replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    return out


def _attn(spec):
    """decode_attention(q, k, v, scale, mask) with launch choices `spec`; with "rope=0|1" in
    it, q is the step's (q, k, v, positions, inverse frequencies, slot) before rope_qkv."""
    items = [x for x in spec.split(",") if x]
    rope = [x.split("=")[1] for x in items if x.startswith("rope=")]
    launch = ca.AttnLaunch.from_spec(",".join(x for x in items if not x.startswith("rope=")))
    if not rope:
        return lambda q, k, v, scale, mask: ca.decode_attention(q, k, v, scale, mask,
                                                                launch=launch)  # fmt: skip

    def attn(new, k, v, scale, mask):
        q, kn, vn, pos, inv, slot = new
        if rope[0] == "0":
            q = ca.rope_qkv(q, kn, vn, pos, inv, k, v, slot)
            return ca.decode_attention(q, k, v, scale, mask, launch=launch)
        step = RopeStep(q, kn, vn, pos, inv, k, v, slot)
        return ca.decode_attention(q, k, v, scale, mask, launch=launch, rope=step)

    return attn


def _graph(q, caches, scale, mask, calls, spec):
    """Replay of `calls` calls over the layers' caches in turn, with launch choices `spec`."""
    attn = _attn(spec)

    def run():
        for i in range(calls):
            k, v = caches[i % len(caches)]
            attn(q, k, v, scale, mask)

    if DEV == "cpu":
        return run
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g.replay


def run_case(B, ctx, kind, variants, nh, nkv, D, calls, reps, l2):
    S = ctx + 128
    per_layer = 2 * B * nkv * S * (D * 2 if kind == "bf16" else D + 4)
    copies = max(1, math.ceil(3 * l2 / per_layer))
    caches, per_key = _cache(kind, B, nkv, S, D, copies)
    read = B * ctx * per_key  # bytes of the visible keys and values
    q = torch.randn(B, nh, 1, D, device=DEV, dtype=DT)
    mask = torch.zeros(B, 1, 1, S, device=DEV, dtype=torch.bool)
    mask[..., :ctx] = True
    scale = D**-0.5
    k0, v0 = caches[0]
    # the step's new token as the qkv product holds it (its rope: position ctx - 1, its slot)
    qkv = torch.randn(B, 1, (nh + 2 * nkv) * D, device=DEV, dtype=DT)
    new = (
        qkv[..., : nh * D].reshape(B, 1, nh, D).swapaxes(1, 2),
        qkv[..., nh * D : (nh + nkv) * D].reshape(B, 1, nkv, D).swapaxes(1, 2),
        qkv[..., (nh + nkv) * D :].reshape(B, 1, nkv, D).swapaxes(1, 2),
        torch.full((B, 1), ctx - 1, device=DEV),
        1.0 / 500000 ** (torch.arange(0, D, 2, device=DEV).float() / D),
        torch.tensor([ctx - 1], device=DEV),
    )
    ref = {}
    ropes = {x.split("rope=")[1][0] for x in variants if "rope=" in x}
    for r in sorted(ropes | {"0"} if ropes else ropes):  # rope=0: the reference of rope=1
        kc, vc = (QuantKV(x.codes.clone(), x.scales.clone(), x.kind) if isinstance(x, QuantKV)
                  else x.clone() for x in (k0, v0))  # fmt: skip
        ref[r] = (_attn(f"rope={r}")(new, kc, vc, scale, mask), kc, vc)
    if len(ref) == 2:  # the fused kernel against the separate launch, bit for bit
        same = [_bits_equal(a, b) for a, b in zip(ref["0"], ref["1"])]
        # again on the caches that already hold the new row: equal now (and not the first
        # time) would say the first call read the row back before its store was visible
        again = _attn("rope=1")(new, ref["1"][1], ref["1"][2], scale, mask)
        same.append(_bits_equal(again, ref["0"][0]))
        print(f"  {kind} B {B} ctx {ctx}: rope=1 vs rope=0 bit-equal out/k/v/out again: {same}, "
              f"max |diff| {(ref['0'][0].float() - ref['1'][0].float()).abs().max().item():.3g}",
              flush=True)  # fmt: skip
    ref = {r: x[:1] for r, x in ref.items()}  # (the caches' copies freed)
    want = F.scaled_dot_product_attention(
        q.float(), _dense(k0), _dense(v0), attn_mask=mask, scale=scale, enable_gqa=True
    )
    graphs, errs = {}, {}
    for spec in variants:
        try:
            if "rope=" in spec and "0" in ref:  # against the separate launch's output
                got = _attn(spec)(new, k0, v0, scale, mask)
                errs[spec] = ((got.float() - ref["0"][0].float()).norm()
                              / ref["0"][0].float().norm()).item()  # fmt: skip
                graphs[spec] = _graph(new, caches, scale, mask, calls, spec)
                continue
            got = _attn(spec)(q, k0, v0, scale, mask)
            errs[spec] = ((got.float() - want).norm() / want.norm()).item()
            graphs[spec] = _graph(q, caches, scale, mask, calls, spec)
        except Exception as e:  # one variant that fails to build leaves the others
            print(f"  {kind} {spec or 'default'}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    variants = [spec for spec in variants if spec in graphs]
    times = {spec: [] for spec in variants}
    for _ in range(reps):  # alternate the variants
        for spec in variants:
            graphs[spec]()  # warm
            times[spec] += _time(graphs[spec], calls, 1)
    rows = []
    for spec in variants:
        us = sorted(times[spec])[len(times[spec]) // 2]
        rows.append(dict(batch=B, context=ctx, kv=kind, variant=spec or "default", us=us,
                         gbps=read / us / 1e3, rel_err=errs[spec], bytes=read))  # fmt: skip
    del graphs
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--kinds", default="bf16,int8,fp8")
    ap.add_argument("--variants", default="", help="';'-separated AttnLaunch specs")
    ap.add_argument("--shape", default="32,8,128", help="query heads, kv heads, head_dim")
    ap.add_argument("--calls", type=int, default=20, help="calls a graph replay")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    nh, nkv, D = (int(x) for x in a.shape.split(","))
    variants = a.variants.split(";")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if DEV == "cuda" else 0
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"{name}  heads {nh}/{nkv}  head_dim {D}  "
          f"graph of {a.calls} calls, median of {a.reps}", flush=True)  # fmt: skip
    rows, t0 = [], time.time()
    for ctx in (int(x) for x in a.contexts.split(",")):
        for B in (int(x) for x in a.batches.split(",")):
            for kind in a.kinds.split(","):
                case = run_case(B, ctx, kind, variants, nh, nkv, D, a.calls, a.reps, l2)
                for r in case:
                    print(f"ctx {ctx:6d} B {B:2d} {kind:4s} {r['variant']:24s} {r['us']:8.1f} us "
                          f"{r['gbps']:7.0f} GB/s  err {r['rel_err']:.1e}  "
                          f"[{time.time() - t0:.0f}s]",
                          flush=True)  # fmt: skip
                rows += case
                if a.json:  # after every case: a timeout keeps what was measured
                    with open(a.json + ".tmp", "w") as f:
                        json.dump(rows, f, indent=1)
                    os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
