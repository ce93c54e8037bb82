"""A/B of the MoE decode step's variants in one process (CUDA): one random model of a MoE
shape is built once, then the captured batch-1 decode step is timed with each variant in
turn (a new capture each time, decoding from the same position), alternating (in reverse
order every other round), so load time and drift are shared.

    python3 benchmarks/moe_fused_ab.py --model shape:qwen3-30b-a3b --quant int4
    python3 benchmarks/moe_fused_ab.py --model shape:gpt-oss-20b --quant fp4 --rounds 3
    python3 benchmarks/moe_fused_ab.py --variants 1 --qcfg 'auto;gu:w2;dn:n8'
    python3 benchmarks/moe_fused_ab.py --variants 1 --router 0,1
    python3 benchmarks/moe_fused_ab.py --variants 1 --down '0;1;w2n8' --topk 0,1

H100 (benchmarks/results/h100-moe-fused.txt), ms a step, 0 -> 1: qwen3-30b-a3b int4 2.247 ->
1.958 (445.1 -> 510.8 tok/s), gpt-oss-20b fp4 2.181 -> 2.075 (458.5 -> 482.0).

Variants: cuda_moe.FUSED (as MLXRUN_MOE_FUSED: 0, torch sums the k slots and casts after
down; 1, the down kernel sums them and the router kernel launches with PDL). Each row:
ms a step by CUDA events over graph replays (median of --reps), tok/s = batch / that.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from profile_decode import _events_ms as events_ms  # noqa: E402  (this script's directory)

import mlxrun.backends.cuda_moe as cm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:qwen3-30b-a3b")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="times each variant is captured")
    ap.add_argument("--reps", type=int, default=30, help="timed replays a capture")
    ap.add_argument("--variants", default="1,0", help="cuda_moe.FUSED values, in turn")
    ap.add_argument("--qcfg", default="auto",
                    help="packed kernel launches, ';' between them, each as MLXRUN_MOE_QCFG "
                         "(every one with every --variants value)")  # fmt: skip
    ap.add_argument("--router", default="auto",
                    help="cuda_moe.ROUTER values (as MLXRUN_MOE_ROUTER), e.g. 0,1,bias: the "
                         "router's linear and routing in one launch (1; bias: for routers with "
                         "a bias) or apart (0)")  # fmt: skip
    ap.add_argument("--router-tile", default="auto",
                    help="route_linear's tiles, ';' between them, as MLXRUN_MOE_ROUTER_TILE "
                         "(rows,warps,vec), e.g. 'auto;1,1,64'")  # fmt: skip
    ap.add_argument("--bias", default="auto",
                    help="torch_weights._BIAS_IN_GEMV values (as MLXRUN_BIAS_IN_GEMV), e.g. "
                         "1,0: q/k/v/o biases added in the GEMV's epilogue (1) or after (0)")  # fmt: skip
    ap.add_argument("--attn", default="auto",
                    help="decode attention launches, ';' between them, each as "
                         "MLXRUN_ATTN_LAUNCH, e.g. 'auto;block=32'")  # fmt: skip
    ap.add_argument("--down", default="auto",
                    help="down kernels, ';' between them, each as MLXRUN_MOE_DOWN, e.g. "
                         "'0;1;w2n8': per slot (0) or the joined GEMV (cuda_moe_down.py)")  # fmt: skip
    ap.add_argument("--topk", default="auto",
                    help="the top-k's form, as MLXRUN_MOE_TOPK, e.g. 0,1: float max (0) or "
                         "integer keys (1)")  # fmt: skip
    a = ap.parse_args()
    from mlxrun.backends import cuda_attention, torch_weights
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.bench import _quant_specs, build_random, shape_config
    from mlxrun.memory import prefill_chunk_for

    cfg = shape_config(a.model)
    be = TorchBackend("cuda", "bfloat16")
    (qn, spec), *_ = _quant_specs([a.quant]).items()
    model = build_random(cfg, be, spec)
    variants = [(int(v), q, r + "/" + t + "/" + b + "/" + at + "/" + d + "/" + tk) for v in a.variants.split(",")
                for q in a.qcfg.split(";") for r in a.router.split(",")
                for t in a.router_tile.split(";") for b in a.bias.split(",")
                for at in a.attn.split(";") for d in a.down.split(";")
                for tk in a.topk.split(",")]  # fmt: skip
    cache = model.make_cache(1, a.context + a.reps + 64)
    ids = torch.randint(0, cfg.vocab_size, (1, a.context), device="cuda")
    chunk = prefill_chunk_for(be.name, be.memory_kind, 1)
    for s in range(0, a.context, chunk):
        y = be.argmax(model(ids[:, s : s + chunk], cache, None, last_only=True))
    y = y.view(1, 1)
    for _ in range(2):  # warm-up: the experts' repack, autotuning, the allocator
        y = be.argmax(model(y, cache, None, last_only=True)).view(1, 1)
    torch.cuda.synchronize()
    base = cache.offset  # every capture decodes from here: the same positions for each
    print(f"{torch.cuda.get_device_name()} {a.model} {qn} batch 1, context {a.context}")
    res: dict[tuple, list[float]] = {v: [] for v in variants}
    qcfg, router, tile, bias = cm.QCFG, cm.ROUTER, cm.ROUTER_TILE, torch_weights._BIAS_IN_GEMV
    down, topk = cm.DOWN, cm.TOPK_PACKED
    attn = cuda_attention._env_launch  # what decode_attention reads (MLXRUN_ATTN_LAUNCH)
    for r in range(a.rounds):
        for v, q, rt in variants if r % 2 == 0 else variants[::-1]:
            cm.FUSED = bool(v)
            cm.QCFG = qcfg if q == "auto" else cm.parse_qcfg(q)
            r_, t_, b_, at_, d_, tk_ = rt.split("/")
            cm.DOWN = down if d_ == "auto" else cm.parse_down(d_)
            cm.TOPK_PACKED = topk if tk_ == "auto" else tk_ == "1"
            launch = cuda_attention.AttnLaunch.from_spec(at_) if at_ != "auto" else None
            cuda_attention._env_launch = attn if launch is None else (lambda x=launch: x)
            torch_weights._BIAS_IN_GEMV = bias if b_ == "auto" else b_ != "0"
            cm.ROUTER = router if r_ == "auto" else r_
            cm.ROUTER_TILE = tile if t_ == "auto" else tuple(int(v) for v in t_.split(","))
            be._session = None  # a new capture with this variant's kernels
            cache.offset = base
            dec = be.decode_step(model, cache, 1, None)
            tok = dec(y.view(-1))
            ms = events_ms(lambda dec=dec, tok=tok: dec(tok), reps=a.reps)
            dec.close()
            res[v, q, rt].append(ms)
            print(f"  round {r} fused={v} qcfg={q} router/tile/bias/attn/down/topk={rt}: {ms:.4f} ms/step "
                  f"{1e3 / ms:8.1f} tok/s", flush=True)  # fmt: skip
    for (v, q, rt), ms in res.items():
        best = min(ms)
        print(f"{a.model} {qn} fused={v} qcfg={q} router/tile/bias/attn/down/topk={rt}: best {best:.4f} ms/step {1e3 / best:.1f} tok/s "
              f"(all: {', '.join(f'{m:.4f}' for m in ms)})")  # fmt: skip


if __name__ == "__main__":
    main()
