"""The MoE layer's expert kernels alone on CUDA (backends/cuda_moe.py): GB/s of the bytes a
step actually reads, against the copy bandwidth measured in the same run.

    python3 benchmarks/moe_kernels.py                                  # ~3 min on an H100
    python3 benchmarks/moe_kernels.py --shape gpt-oss-20b --formats mxfp4 --batch 1
    python3 benchmarks/moe_kernels.py --formats int4,mxfp4 --warps auto,1,2,4   # A/B
    python3 benchmarks/moe_kernels.py --formats int4,mxfp4 --path slot,grouped --batch 8,16,32,64
    python3 benchmarks/moe_kernels.py --formats int4,mxfp4 --batch 1 --fused 0,1 --no-per-slot
    python3 benchmarks/moe_kernels.py --batch 1 --no-per-slot --qcfg 'auto;gu:w2;dn:n8'
    python3 benchmarks/moe_kernels.py --batch 1 --no-per-slot --down '0;w2n16;w1n8'
    python3 benchmarks/moe_kernels.py --router      # router linear + route vs route_linear
    python3 benchmarks/moe_kernels.py --router --router-tile 'auto;4,1,64;1,1,64' --topk 0,1
    TRITON_INTERPRET=1 python3 benchmarks/moe_kernels.py --tiny        # CPU: values only

Shapes: gpt-oss-20b (32 experts, top-4, hidden = intermediate = 2880, biases, clamped
SwiGLU) and qwen3-30b-a3b (128 experts, top-8, hidden 2048, expert intermediate 768, SiLU).
Formats: bf16 (dense experts), int4 (affine 4-bit g64, bf16 scales), mxfp4, nvfp4, mxfp8,
int8 (affine 8-bit g64). Batch: tokens a step (1, 8, 32 by default).

Each row times one layer's experts -- `moe_experts`: the gate/up launch, the down launch and
the sum over the k slots -- for random routes (top-k distinct experts per token, a new draw
each call), inside a CUDA graph of CALLS calls that cycle through enough copies of the
layer's weights (at least 4x the L2 cache) that no call finds its experts in L2. Bytes read
a call: every distinct expert its tokens picked, gate + up + down (codes, scales, biases,
expert biases) once, plus x and the output: what the roofline of `mlxrun bench` counts.
`route+us` adds the router (cuda_moe.route on random logits; ids of the other columns are
drawn by torch beforehand); `err0` is the largest relative difference of those results
(from the graph's last replay) from the unfused path's, run eagerly (a race of the slot
sum would show there). --fused 0,1 times both (format/f0, /f1): the k slots summed by
torch after down (0, as MLXRUN_MOE_FUSED=0) or by the down kernel itself (1).
H100 (benchmarks/results/h100-moe-fused.txt), batch 1, us a layer (route+us): qwen3-30b-a3b
int4 23.0 (24.1) -> 19.5 (19.6), gpt-oss-20b mxfp4 46.6 (47.0) -> 43.4 (42.6).
Packed formats' rows take the decode path moe_experts picks (per slot below 2 slots an
expert, else grouped by expert: cuda_moe.grouped_wins); --path slot,grouped times both
(format/s, format/g), --warps the per-slot kernel's warps a program (format/w2).
--down times the down launch's kernels (as MLXRUN_MOE_DOWN: 0 per slot, 1 or wXnY the
joined GEMV of cuda_moe_down.py, /d0, /d1.. rows); `gu us` is the gate/up launch alone (the
same routes), so `us` - `gu us` is down's share.
`per-slot` times the kernel that reads each slot's expert on its own (`_moe_gemv`, the path
before the packed one) on the same weights and routes, for comparison in the same process;
`err` is the packed result's relative difference from it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from profile_decode import _events_ms as events_ms  # noqa: E402  (this script's directory)
from profile_decode import _graphed as graphed  # noqa: E402

import mlxrun.backends.cuda_moe as cm  # noqa: E402
from mlxrun.backends import torch_moe  # noqa: E402
from mlxrun.backends.base import QuantizedWeight  # noqa: E402
from mlxrun.moe import Experts, MoEOptions  # noqa: E402

SHAPES = {
    # name: (E, top-k, hidden, expert intermediate, gpt-oss's options)
    "gpt-oss-20b": (32, 4, 2880, 2880, True),
    "qwen3-30b-a3b": (128, 8, 2048, 768, False),
    "tiny": (4, 2, 256, 64, True),
}
FORMATS = {
    "bf16": None,
    "int4": ("affine", 4, 64),
    "mxfp4": ("mxfp4", 4, 32),
    "nvfp4": ("nvfp4", 4, 16),
    "mxfp8": ("mxfp8", 8, 32),
    "int8": ("affine", 8, 64),
}


def options(shape) -> MoEOptions:
    E, k, _, I, oss = SHAPES[shape]
    if oss:
        return MoEOptions(E, k, I, "topk_softmax", act="swiglu_clamped", bias=True)
    return MoEOptions(E, k, I, "softmax_topk", norm_topk=True)


def stacked(E, n, k, fmt, dev, gen):
    """Random stacked weight (E, n, k): dense bf16 ~ N(0, 0.02), or canonical packed codes
    with scales that keep the products near that size."""
    if fmt is None:
        return (torch.randn(E, n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    mode, bits, g = fmt
    w = torch.randint(-(2**31), 2**31 - 1, (E, n, k * bits // 32), generator=gen, device=dev)
    w = w.to(torch.int32)
    if mode == "mxfp8":  # no E4M3 NaN codes (exponent 15, mantissa 7): exponent bit 0 cleared
        w = w & -0x08080809  # 0xF7F7F7F7 as int32
    kg = k // g
    if mode == "affine":
        s = (torch.rand(E, n, kg, generator=gen, device=dev) * 0.004 + 1e-3).to(torch.bfloat16)
        b = (-(2 ** (bits - 1)) * s.float()).to(torch.bfloat16)
    elif mode == "nvfp4":  # E4M3 codes 0x10..0x3E: 2^-5 .. 2^-2
        s, b = torch.randint(0x10, 0x3F, (E, n, kg), generator=gen, device=dev), None
        s = s.to(torch.uint8)
    else:  # E8M0 119..122: 2^-8 .. 2^-5
        s, b = torch.randint(119, 123, (E, n, kg), generator=gen, device=dev), None
        s = s.to(torch.uint8)
    return QuantizedWeight(w, s, b, mode, bits, g)


def layer(shape, fmt, dev, seed):
    E, _, H, I, oss = SHAPES[shape]
    gen = torch.Generator(device=dev).manual_seed(seed)
    e = Experts(None, *(stacked(E, n, k, fmt, dev, gen) for n, k in ((I, H), (I, H), (H, I))))
    if oss:
        for name, width in (("gate_bias", I), ("up_bias", I), ("down_bias", H)):
            b = (torch.randn(E, width, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
            setattr(e, name, b)
    return e


def expert_bytes(e: Experts) -> int:
    """Bytes of one expert's gate, up and down (and biases) as stored."""
    total = 0
    for w in (e.gate, e.up, e.down):
        parts = (w.weight, w.scales, w.biases) if isinstance(w, QuantizedWeight) else (w,)
        total += sum(p[0].numel() * p.element_size() for p in parts if p is not None)
    for b in (e.gate_bias, e.up_bias, e.down_bias):
        total += 0 if b is None else b[0].numel() * b.element_size()
    return total


def routes(batch, E, k, n, dev, gen):
    """n draws of (ids (batch, k) distinct a token, routing weights (batch, k))."""
    out = []
    for _ in range(n):
        logits = torch.randn(batch, E, generator=gen, device=dev)
        w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
        out.append((ids, w / w.sum(-1, keepdim=True), logits))
    return out


def per_slot(x, ids, weights, e, o):
    """The per-slot kernel (`_moe_gemv`): each slot reads its expert's rows itself."""
    T, H = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1).to(torch.int32)
    rw = weights.reshape(-1).to(torch.float32)
    h = torch.empty((T * k, o.intermediate_size), dtype=x.dtype, device=x.device)
    cm._launch(x, flat, h, rw, e.gate, e.gate_bias, e.up, e.up_bias, k, o, True, False)
    y = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    cm._launch(h, flat, y, rw, e.down, e.down_bias, None, None, 1, o, False, True)
    return y.view(T, k, H).sum(dim=1).to(x.dtype)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, read + write bytes/s (median of 20, CUDA events)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / (ms * 1e-3)


def run_tiny() -> None:
    """Values only (CPU, TRITON_INTERPRET=1): packed and per-slot kernels against torch."""
    o = options("tiny")
    gen = torch.Generator().manual_seed(0)
    for name, fmt in FORMATS.items():
        e = layer("tiny", fmt, "cpu", 1)
        if fmt is None:
            e = Experts(None, *(w.float() for w in (e.gate, e.up, e.down)),
                        gate_bias=e.gate_bias.float(), up_bias=e.up_bias.float(),
                        down_bias=e.down_bias.float())  # fmt: skip
        else:
            for b in ("gate_bias", "up_bias", "down_bias"):
                setattr(e, b, getattr(e, b).float())
        ids, w, _ = routes(2, o.num_experts, o.top_k, 1, "cpu", gen)[0]
        x = torch.randn(2, SHAPES["tiny"][2], generator=gen)
        want = (torch_moe._gathered(x, ids, e, o) * w.unsqueeze(-1)).sum(1)
        slot = per_slot(x, ids, w, copy.copy(e), o)
        got = cm.moe_experts(x, ids, w, e, o)
        errs = [float((a - want).norm() / want.norm()) for a in (got, slot)]
        print(f"tiny {name:<6} packed err {errs[0]:.2e}  per-slot err {errs[1]:.2e}")


def row(shape, name, o, layers, stored, batch, calls, bw, slots) -> str:
    """One line of the table: `layers` (copies of one layer; `stored`: the same with their
    stored experts) at `batch` tokens a call."""
    E, k, H, I, _ = SHAPES[shape]
    dev, copies = "cuda", len(layers)
    per_expert = expert_bytes(stored[0])
    gen = torch.Generator(device=dev).manual_seed(batch)
    rs = routes(batch, E, k, calls, dev, gen)
    xs = torch.randn(calls, batch, H, generator=gen, device=dev).to(torch.bfloat16)
    used = sum(int(torch.unique(ids).numel()) for ids, _, _ in rs) / calls
    act = 2 * batch * H * 2 + batch * k * (I * 2 + H * 4)  # x, out, h, y
    nbytes = used * per_expert + act

    def packed(i):
        ids, w, _ = rs[i]
        return cm.moe_experts(xs[i], ids, w, layers[i % copies], o)

    outs = {}  # routed's results of the last replay (held: not reused inside the graph)

    def routed(i):
        w, ids = cm.route(rs[i][2], o)
        outs[i] = cm.moe_experts(xs[i], ids, w, layers[i % copies], o)
        return outs[i]

    def slot(i):
        ids, w, _ = rs[i]
        return per_slot(xs[i], ids, w, stored[i % copies], o)

    flats = [ids.reshape(-1).to(torch.int32) for ids, _, _ in rs]  # made outside the graph
    rw = torch.ones(batch * k, dtype=torch.float32, device=dev)  # unused (not SCALED)
    h = torch.empty((batch * k, I), dtype=torch.bfloat16, device=dev)

    def gate_up(i):
        p = cm.prepared(layers[i % copies])
        if p is not None:
            e = layers[i % copies]
            cm._qlaunch(xs[i], flats[i], h, rw, p[0], e.gate_bias, e.up_bias, k, o, False)
        return h

    us = events_ms(graphed(packed, calls)) * 1e3 / calls
    gus = events_ms(graphed(gate_up, calls)) * 1e3 / calls
    rus = events_ms(graphed(routed, calls)) * 1e3 / calls
    torch.cuda.synchronize()
    fused, cm.FUSED = cm.FUSED, False
    ref = [cm.moe_experts(xs[i], *cm.route(rs[i][2], o)[::-1], layers[i % copies], o).float()
           for i in range(calls)]  # fmt: skip
    cm.FUSED = fused
    err0 = max(float((outs[i].float() - r).norm() / r.norm()) for i, r in enumerate(ref))
    gbs = nbytes / us / 1e3
    line = (f"{shape:<14} {name:<9} {batch:>5} {used:>7.1f} {nbytes / 1e6:>7.1f} "
            f"{us:>8.1f} {gbs:>6.0f} {100 * gbs * 1e9 / bw:>5.1f}% {rus:>8.1f} {err0:>7.1e} "
            f"{gus:>6.1f}")  # fmt: skip
    if slots:
        sus = events_ms(graphed(slot, calls)) * 1e3 / calls
        ref = slot(0).float()
        err = float((packed(0).float() - ref).norm() / ref.norm())
        sgbs = nbytes / sus / 1e3
        line += f" {sus:>11.1f} {100 * sgbs * 1e9 / bw:>5.1f}% {err:>8.1e}"
    return line


def router_row(shape, calls, l2) -> str:
    """The router alone: its linear as the model runs it (cuda_ops.dense_gemv, + bias) then
    route (two or three launches) against route_linear (one), each in a CUDA graph cycling
    through enough copies of the router (bf16 (E, H), as stored) that none stays in L2."""
    from mlxrun.backends import cuda_ops  # noqa: PLC0415

    E, _, H, _, oss = SHAPES[shape]
    o = options(shape)
    gen = torch.Generator(device="cuda").manual_seed(3)
    n = max(calls, math.ceil(4 * l2 / (E * H * 2)))
    ws = [(torch.randn(E, H, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
          for _ in range(n)]  # fmt: skip
    b = (torch.randn(E, generator=gen, device="cuda") * 0.1).to(torch.bfloat16) if oss else None
    xs = torch.randn(n, 1, H, generator=gen, device="cuda").to(torch.bfloat16)

    def old(i):
        logits = cuda_ops.dense_gemv(xs[i], ws[i])
        return cm.route(logits if b is None else logits + b, o)

    def new(i):
        return cm.route_linear(xs[i], ws[i], b, o)

    us_old = events_ms(graphed(old, n)) * 1e3 / n
    us_new = events_ms(graphed(new, n)) * 1e3 / n
    diff = sum(not all(torch.equal(p, q) for p, q in zip(old(i), new(i))) for i in range(n))
    return (f"{shape:<14} router {E}x{H}{' +bias' if b is not None else ''}: linear + route "
            f"{us_old:6.2f} us, route_linear {us_new:6.2f} us, calls whose ids or weights "
            f"differ: {diff} of {n}")  # fmt: skip


_CHOOSE = cm.choose_qconfig
_WINS = cm.grouped_wins
_FUSED = cm.FUSED
_QCFG = cm.QCFG
_DOWN = cm.DOWN


def _forced(grouped: bool):
    return lambda slots, o: grouped


def _with_warps(warps: str):
    """choose_qconfig, or the same with `warps` warps a program (for A/B rows)."""
    if warps == "auto":
        return _CHOOSE
    return lambda p: dataclasses.replace(_CHOOSE(p), warps=int(warps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shape", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--calls", type=int, default=48, help="calls a graph (distinct routes)")
    ap.add_argument("--no-per-slot", action="store_true", help="skip the per-slot kernel")
    ap.add_argument("--path", default="auto",
                    help="packed experts' decode path to time: auto,slot,grouped (a row each)")  # fmt: skip
    ap.add_argument("--warps", default="auto",
                    help="packed kernel's warps a program to time, e.g. auto,1,2,4 (a row each)")  # fmt: skip
    ap.add_argument("--fused", default="auto",
                    help="slot sum in the down kernel: auto,0,1 (a row each; as "
                         "MLXRUN_MOE_FUSED)")  # fmt: skip
    ap.add_argument("--qcfg", default="auto",
                    help="packed kernel launches to time, ';' between them, each as "
                         "MLXRUN_MOE_QCFG, e.g. 'auto;gu:w2;dn:n8' (a row each: /q1, /q2..)")  # fmt: skip
    ap.add_argument("--down", default="auto",
                    help="down kernels to time, ';' between them, each as MLXRUN_MOE_DOWN, e.g. "
                         "'0;1;w2n16' (a row each: /d0, /d1..)")  # fmt: skip
    ap.add_argument("--router", action="store_true",
                    help="time the router alone (linear + route against route_linear), then stop")  # fmt: skip
    ap.add_argument("--router-tile", default="auto",
                    help="--router: route_linear's tiles, ';' between them, as "
                         "MLXRUN_MOE_ROUTER_TILE (rows,warps,vec), e.g. 'auto;4,1,64'")  # fmt: skip
    ap.add_argument("--topk", default="auto",
                    help="--router: the top-k's form, as MLXRUN_MOE_TOPK, e.g. 0,1")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="CPU values check (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    if a.tiny:
        run_tiny()
        return
    dev = "cuda"
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s (read + write), "
          f"L2 {l2 >> 20} MiB")  # fmt: skip
    if a.router:
        for shape in a.shape.split(","):
            for tile in a.router_tile.split(";"):
                if tile != "auto":
                    cm.ROUTER_TILE = tuple(int(v) for v in tile.split(","))
                for topk in a.topk.split(","):
                    cm.TOPK_PACKED = topk == "1" if topk != "auto" else cm.TOPK_PACKED
                    print(f"{router_row(shape, a.calls, l2)} [tile {cm.ROUTER_TILE}, "
                          f"topk {int(cm.TOPK_PACKED)}]", flush=True)  # fmt: skip
        return
    qcfgs = a.qcfg.split(";")
    for i, q in enumerate(qcfgs):
        if q != "auto":
            print(f"# q{i}: MLXRUN_MOE_QCFG={q}")
    downs = a.down.split(";")
    for i, d in enumerate(downs):
        if d != "auto":
            print(f"# d{i}: MLXRUN_MOE_DOWN={d}")

    print(f"{'shape':<14} {'format':<9} {'batch':>5} {'experts':>7} {'MB':>7} "
          f"{'us':>8} {'GB/s':>6} {'%copy':>6} {'route+us':>8} {'err0':>7} {'gu us':>6} "
          f"{'per-slot us':>11} "
          f"{'%copy':>6} {'err':>8}")  # fmt: skip
    for shape in a.shape.split(","):
        E = SHAPES[shape][0]
        o = options(shape)
        for name in a.formats.split(","):
            fmt = FORMATS[name]
            one = layer(shape, fmt, dev, 0)
            layer_bytes = expert_bytes(one) * E
            # copies: >= 4x L2 in total, at most ~8 GB (the packed repack doubles them)
            copies = max(2, min(math.ceil(4 * l2 / layer_bytes), (8 << 30) // layer_bytes))
            layers = [one] + [layer(shape, fmt, dev, c + 1) for c in range(copies - 1)]
            # the per-slot kernel reads the stored experts, which the repack replaces in
            # the layer: it keeps its own references (both held here, unlike in a model)
            stored = [copy.copy(e) for e in layers]
            for e in layers:  # the repack is made on first use: before any capture
                cm.prepared(e)
            for batch in [int(b) for b in a.batch.split(",")]:
                for path in a.path.split(",") if fmt is not None else ["auto"]:
                    cm.grouped_wins = _WINS if path == "auto" else _forced(path == "grouped")
                    for warps in a.warps.split(",") if fmt is not None else ["auto"]:
                        cm.choose_qconfig = _with_warps(warps)
                        for fused in a.fused.split(","):
                            cm.FUSED = _FUSED if fused == "auto" else fused != "0"
                            for qi, q in enumerate(qcfgs if fmt is not None else ["auto"]):
                                cm.QCFG = _QCFG if q == "auto" else cm.parse_qcfg(q)
                                for di, d in enumerate(downs if fmt is not None else ["auto"]):
                                    cm.DOWN = _DOWN if d == "auto" else cm.parse_down(d)
                                    label = name + ("" if path == "auto" else f"/{path[0]}")
                                    label += "" if warps == "auto" else f"/w{warps}"
                                    label += "" if fused == "auto" else f"/f{fused}"
                                    label += "" if q == "auto" else f"/q{qi}"
                                    label += "" if d == "auto" else f"/d{di}"
                                    print(row(shape, label, o, layers, stored, batch, a.calls,
                                              bw, not a.no_per_slot), flush=True)  # fmt: skip
                cm.choose_qconfig, cm.grouped_wins, cm.FUSED = _CHOOSE, _WINS, _FUSED
                cm.QCFG, cm.DOWN = _QCFG, _DOWN
            del layers, stored, one
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
