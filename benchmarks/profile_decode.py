"""Where a decode step's time goes on CUDA: per-kernel device time of one step, per format
and batch, for a random model of a given shape; and the linears of that shape timed alone.

    python3 benchmarks/profile_decode.py [--model shape:llama3-8b] [--quant none,int4]
        [--batch 1,32] [--context 1024] [--linears [--formats F,..] [--all]] [--attention]

Decode step: prefill `context` tokens, then a few eager steps under torch.profiler (kernel
durations are device times; launch gaps excluded) next to the same step replayed from the
CUDA graph and timed with events (launch gaps included, as generation runs it).

--linears: each linear shape of one layer (the joint q/k/v and gate/up as they run) at M=1
and M=batch, inside a CUDA graph that cycles through enough copies of the weight that
nothing stays in L2 between calls, as in a real step; our kernel's configs and cuBLAS bf16;
GB/s of the weight's bytes and their % of the device-to-device copy bandwidth. Formats are
benchmarks/kernels.py's, GGUF K-quants included (q4_k, q5_k, q6_k: random blocks in
quant/kquant_layout.py's layout), e.g. on the H100 (minutes: the compiles dominate):

    python3 benchmarks/profile_decode.py --linears --formats affine4g64,q4_k,q6_k,q5_k \
        --batch 1,32
--attention: one layer's decode attention (SDPA with a mask and GQA, as the graph runs it,
against alternatives) at each batch.
"""

from __future__ import annotations

import argparse
import collections
import math

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


def _events_ms(fn, reps: int = 20) -> float:
    """Median ms of fn() by CUDA events (fn is typically a graph replay)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        out.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in out)
    return ms[len(ms) // 2]


def _graphed(fn, calls: int):
    """A CUDA graph of `calls` invocations of fn(i); returns replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return g.replay


def profile_steps(model, batch: int, context: int, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile

    from mlxrun.memory import prefill_chunk_for

    be = model.be
    cache = model.make_cache(batch, context + steps + 40)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    chunk = prefill_chunk_for(be.name, be.memory_kind, batch)
    for s in range(0, context, chunk):
        y = be.argmax(model(ids[:, s : s + chunk], cache, None, last_only=True))
    y = y.view(batch, 1)
    for _ in range(2):  # warm-up (autotune, allocator)
        y = be.argmax(model(y, cache, None, last_only=True)).view(batch, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            y = be.argmax(model(y, cache, None, last_only=True)).view(batch, 1)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total / steps
            per[e.name][1] += 1
    total = sum(t for t, _ in per.values())
    dec = be.decode_step(model, cache, batch, None)
    tok = dec(y.view(-1))  # the graph's own token buffer: fed back without a copy, as in decode
    graph_ms = _events_ms(lambda: dec(tok), reps=10)
    dec.close()
    print(f"  batch {batch}, context {context}: kernels {total / 1e3:.3f} ms/step "
          f"(sum of device times), graph replay {graph_ms:.3f} ms/step")  # fmt: skip
    for name, (t, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"    {t / 1e3:7.3f} ms {100 * t / total:5.1f}%  x{n // steps:<4d} {name[:90]}")


def linears(
    cfg,
    ms: list[int],
    formats=("affine4g64",),
    show_all: bool = False,
    warps=(1,),
    prefetch=(True,),
) -> None:
    """Every linear shape of one layer and the head, per format, alone and cycled; with
    show_all, every config of the sweep (else the default and the best)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from kernels import FORMATS, copy_bandwidth, default_config, make_weight, matmul  # noqa: PLC0415

    from mlxrun.quant import triton_kernels as tk
    from mlxrun.quant import triton_kquant as kq

    copy_bw = copy_bandwidth() / 1e9  # GB/s, read + write, as the weights' bytes are counted
    print(f"  device-to-device copy {copy_bw:.0f} GB/s (1 GiB, read + write)")

    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    shapes = [(q + 2 * kv, H), (H, q), (2 * I, H), (H, I), (V, H)]
    for m in ms:
        print(f"  M = {m}")
        for n, k in shapes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dense_bytes = n * k * 2
            copies = max(2, math.ceil(400e6 / dense_bytes))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            t = _events_ms(
                _graphed(
                    lambda i, x=x, ws=ws, c=copies: torch.nn.functional.linear(x, ws[i % c]), 24
                )
            )
            us = t * 1e3 / 24
            line = [f"{n}x{k} bf16 {us:6.1f} us {dense_bytes / us / 1e3:5.0f} GB/s"]
            for fmt in formats:
                mode, bits, g = FORMATS[fmt]
                w0 = make_weight(n, k, mode, bits, g)
                copies = max(2, math.ceil(400e6 / w0.nbytes))
                wq = [w0] + [make_weight(n, k, mode, bits, g, seed=s) for s in range(1, copies)]
                kc = tk.KernelConfig
                if mode in kq.KINDS:
                    cfgs = _kquant_configs(mode, m, warps)
                elif m <= tk.GEMV_MAX_M:
                    cfgs = [
                        kc("gemv", 1, bn, sk, num_warps=nw, prefetch=pf)
                        for nw in warps
                        for bn in (8, 16)
                        for sk in (1, 2, 4, 8, 16)
                        for pf in prefetch
                    ]
                else:  # tensor-core tiles for a small batch: M=32 fills half a 64-row wgmma
                    cfgs = [
                        kc("gemm", 32, 128, 1, ng=2, num_warps=4, num_stages=4),
                        kc("gemm", 64, 128, 1, ng=2, num_warps=4, num_stages=4),
                        kc("gemm", 64, 256, 1, ng=1, num_warps=8, num_stages=3),
                        kc("gemm", 64, 128, 4, ng=2, num_warps=4, num_stages=4),
                        kc("gemm", 32, 128, 1, ng=2, num_warps=4, num_stages=4, swap=True),
                        kc("gemm", 32, 256, 1, ng=2, num_warps=8, num_stages=3, swap=True),
                        kc("gemm", 32, 128, 2, ng=2, num_warps=4, num_stages=4, swap=True),
                    ]
                    if show_all:  # the narrow swapped tiles, more widely
                        cfgs += [
                            kc("gemm", 32, 128, sk, ng=ng, num_warps=4, num_stages=st, swap=True)
                            for ng in (2, 4)
                            for st in (3, 5, 6)
                            for sk in (1, 2, 4)
                        ]
                best, every = None, []
                for c in [None, *cfgs]:
                    try:
                        rep = _graphed(
                            lambda i, c=c, x=x, wq=wq, n=copies: matmul(x, wq[i % n], c), 24
                        )
                    except Exception as e:  # a config the shape does not allow
                        print(f"    {c}: {type(e).__name__} {str(e)[:80]}")
                        continue
                    us = _events_ms(rep) * 1e3 / 24
                    name = "default" if c is None else _cfg_name(c)
                    if c is None:
                        d = default_config(m, w0, x)
                        name += f"({d.kernel} {d.block_m}x{d.block_n} s{d.split_k} w{d.num_warps})"
                        gbs = w0.nbytes / us / 1e3
                        line.append(f"{fmt} {name} {us:6.1f} us {gbs:5.0f} GB/s "
                                    f"{100 * gbs / copy_bw:3.0f}% copy")  # fmt: skip
                    else:
                        every.append(f"{name} {us:.1f}")
                        if best is None or us < best[1]:
                            best = (name, us)
                if best:
                    line.append(
                        f"best {best[0]} {best[1]:6.1f} us {w0.nbytes / best[1] / 1e3:5.0f} GB/s"
                    )
                if show_all:
                    line.append("all: " + ", ".join(every))
                del wq, w0
            print("    " + " | ".join(line))
            del ws
            torch.cuda.empty_cache()


def _cfg_name(c) -> str:
    """A launch config (KernelConfig or triton_kquant.KQConfig) in a few characters."""
    name = f"{c.block_m}x{c.block_n} s{c.split_k}{' swap' * getattr(c, 'swap', False)}"
    if c.kernel == "gemv" and c.num_warps > 1:
        name += f" w{c.num_warps}"
    if c.kernel == "gemv" and not getattr(c, "prefetch", True):
        name += " nopf"
    if getattr(c, "sb", 0) > 1:
        name += f" sb{c.sb}"
    if c.kernel == "gemm" and hasattr(c, "ng"):
        name += f" ng{c.ng} st{c.num_stages}"
    return name


def _kquant_configs(kind: str, m: int, warps) -> list:
    """Launches to sweep for a K-quant: the lane GEMV (the int4 GEMV's loop: 8 rows, warps,
    split-K), against the tile GEMV it replaced (16 or 32 rows x super-blocks a step,
    split-K; "1x16 s2 sb2"); or the tile GEMM's tiles ("32x128 s1 swap ... ng4"), against
    the per-super-block GEMM it replaced (no "swap")."""
    from mlxrun.quant import triton_kernels as tk
    from mlxrun.quant import triton_kquant as kq

    if m <= tk.GEMV_MAX_M:
        pf = kind != "Q6_K"  # lane_config's choice; the other one at 4 warps
        lane = [
            tk.KernelConfig("gemv", 1, 8, sk, num_warps=nw, prefetch=pf)
            for nw in sorted({*warps, 1, 2, 4})
            for sk in (1, 2, 4, 8)
        ]
        lane += [tk.KernelConfig("gemv", 1, 8, sk, num_warps=4, prefetch=not pf) for sk in (1, 2)]
        return lane + [kq.KQConfig("gemv", 1, 32, 2, sk, 4) for sk in (1, 4)]
    ng = 8 if kind == "Q6_K" else 4  # k-steps of 128 weights
    tile = [
        tk.KernelConfig("gemm", bm, 128, sk, ng, nw, st, swap=True)
        for bm, nw, st in ((32, 8, 4), (32, 4, 4), (64, 8, 4))
        for sk in (1, 2, 4)
    ]
    return tile + [kq.KQConfig("gemm", 32, 64, 1, sk, 8) for sk in (1, 4)]  # the one before


def attention(cfg, batches: list[int], context: int) -> None:
    from mlxrun.backends.cuda_attention import decode_attention

    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = nh // nkv
    for B in batches:
        L = context + 128
        q = torch.randn(B, nh, 1, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, nkv, L, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(B, 1, 1, L, device="cuda", dtype=torch.bool)
        mask[..., context:] = False
        kv_bytes = 2 * k.numel() * 2
        qg = q.view(B, nkv, g, hd)
        variants = {  # bound now: the lambdas run inside this iteration only
            "sdpa mask+gqa (as run)": lambda q=q, k=k, v=v, m=mask: sdpa(
                q, k, v, attn_mask=m, enable_gqa=True
            ),
            "grouped q (B,kv,G,D) + mask": lambda q=qg, k=k, v=v, m=mask: sdpa(
                q, k, v, attn_mask=m
            ),
            "gqa, no mask (flash)": lambda q=q, k=k, v=v: sdpa(q, k, v, enable_gqa=True),
            "mlxrun decode_attention + mask": lambda q=q, k=k, v=v, m=mask: decode_attention(
                q, k, v, hd**-0.5, m
            ),
        }
        ref = variants["sdpa mask+gqa (as run)"]().float()
        for name, fn in variants.items():
            try:
                out = fn()
                err = (out.reshape(ref.shape).float() - ref).abs().max().item()
                us = _events_ms(_graphed(lambda i, fn=fn: fn(), 32)) * 1e3 / 32
            except Exception as e:
                print(f"  B={B} {name}: {type(e).__name__} {str(e)[:100]}")
                continue
            print(f"  B={B} L={L} {name:30s} {us:8.1f} us/layer  "
                  f"{kv_bytes / us / 1e3:6.0f} GB/s of K+V  max diff {err:.1e}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:llama3-8b")
    ap.add_argument("--quant", default="none,int4")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--linears", action="store_true")
    ap.add_argument("--formats", default="affine4g64", help="formats of --linears")
    ap.add_argument("--all", action="store_true", help="--linears: print every config")
    ap.add_argument("--warps", default="1", help="--linears: GEMV warps per program to sweep")
    ap.add_argument("--no-prefetch", action="store_true", help="--linears: sweep it off too")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--steps", action="store_true", help="profile whole decode steps")
    a = ap.parse_args()
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.bench import _quant_specs, build_random, shape_config

    cfg = shape_config(a.model)
    batches = [int(b) for b in a.batch.split(",")]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if a.attention:
        print("decode attention, one layer:")
        attention(cfg, batches, a.context)
    if a.linears:
        print("linears (cycled weights, graph-replayed):")
        warps = [int(w) for w in a.warps.split(",")]
        pf = (True, False) if a.no_prefetch else (True,)
        linears(cfg, sorted({1, *batches}), a.formats.split(","), a.all, warps, pf)
    if a.steps:
        be = TorchBackend("cuda", "bfloat16")
        for qn, spec in _quant_specs(a.quant.split(",")).items():  # q4_k_m: llama.cpp's mix
            model = build_random(cfg, be, spec)
            print(f"decode step, {qn}:")
            for b in batches:
                profile_steps(model, b, a.context)
            be.release()
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
