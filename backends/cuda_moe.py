"""Triton kernels for mixture-of-experts decode on CUDA: every token slot's expert in one
launch per projection, reading only the selected experts' bytes.

Slots are (token, j) pairs, j < top_k. One program computes a block of output rows of one
slot: it reads its expert id, streams that expert's rows of the stacked weight and dots them
with the slot's input row. Two launches a layer:
- gate and up together, the gate's activation (SiLU, or gpt-oss's clamped SwiGLU) in the
  epilogue: h (S, I);
- down, scaled by the slot's routing weight in the epilogue, each token's k slots summed by
  the kernel itself (partials and a ticket a row tile, the last program writes the token's
  (H,) row in the output dtype: no sum or cast launch after it).
No host sync, so the decode step stays capturable in a CUDA graph at any batch.

Packed experts (affine 4/8-bit, mxfp4, nvfp4, mxfp8) run `_moe_qgemv`: the dense GEMV's
k-step (quant/triton_kernels.py: its load-time repack, float-bit decoding, lanes along K,
next step's words in flight) on the expert's rows, found from the slot's id inside the
kernel. The repack is made once per layer on first use (`prepared`, backends/cuda_moe_pack.py):
gate and up of each expert joined, [gate_e; up_e], so a program's rows are gate rows and the
matching up rows. Dense experts (bf16/fp32) run `_moe_gemv`, which reads the stored (E, N, K)
arrays. The kernels are in backends/cuda_moe_kernels.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import torch
import triton

from mlxrun.backends.base import QuantizedWeight
from mlxrun.backends.cuda_moe_down import choose_down, joined_fits, joined_launch, parse_down
from mlxrun.backends.cuda_moe_kernels import (
    _moe_gemv,
    _moe_grouped,
    _moe_qgemv,
    _route_kernel,
    _router_kernel,
)
from mlxrun.backends.cuda_moe_pack import PackedExperts, _expert_rows, prepared
from mlxrun.errors import MlxrunError
from mlxrun.quant.triton_kernels import qmatmul
from mlxrun.quant.triton_launch import GEMV_WARPS, _counters, pdl_args
from mlxrun.quant.triton_layout import _MODE_ID

_MODE = {"dense": 0, "affine": 1, "mxfp4": 2, "nvfp4": 3, "mxfp8": 4}
# The per-slot down kernels sum each token's k slots themselves and the router kernel
# launches with PDL: three launches a layer (router, gate/up, down), against five with
# torch's sum over the slots and its cast after down. MLXRUN_MOE_FUSED=0: the five (A/B).
# H100, batch-1 decode step (benchmarks/moe_fused_ab.py): qwen3-30b-a3b int4 2.247 -> 1.958
# ms, gpt-oss-20b fp4 2.181 -> 2.075.
FUSED = os.environ.get("MLXRUN_MOE_FUSED", "1") != "0"


# The top-k's rounds over the values' order-preserving int32 bits: an integer max (one
# redux.sync on a warp) where a float max took 5 shuffles (_topk_store's PACKED; sm_90, the
# route kernel at 128 experts, top-8: 53 -> 8 SHFL). H200, qwen3-30b-a3b's router alone
# (linear + route) 3.30 -> 3.07 us. MLXRUN_MOE_TOPK: "1" integer keys (default), "0" the
# float max (A/B).
TOPK_PACKED = os.environ.get("MLXRUN_MOE_TOPK", "1") == "1"


def route(logits: torch.Tensor, o) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (weights (N, k) float32, expert ids (N, k) int32) in one
    launch: torch_moe.route's arithmetic without its topk/softmax/copy kernels (~10 a layer
    at batch 1). Ties go to the lower expert index."""
    n, E = logits.shape
    k = o.top_k
    w = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int32, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits.contiguous(), w, ids, E, TOP_K=k, KP=triton.next_power_of_2(k),
            BLOCK_E=triton.next_power_of_2(E), SOFTMAX_FIRST=o.routing == "softmax_topk",
            NORM=o.norm_topk, PACKED=TOPK_PACKED, num_warps=1 if E <= 128 else 4,
            **(pdl_args(logits.device) if FUSED else {}),
        )  # fmt: skip
    return w, ids


# The router's linear as cuda_ops.dense_gemv launches it by default: 4 rows a program, 4
# warps, 16 inputs a thread (its logits bit for bit, so the same experts are picked).
# MLXRUN_MOE_ROUTER_TILE="rows,warps,vec" sets others (A/B; e.g. "1,1,64": the top-k of the
# last program on one warp, as the route kernel's; the sums in another order).
ROUTER_TILE = tuple(int(v) for v in os.environ.get("MLXRUN_MOE_ROUTER_TILE", "4,4,16").split(","))


# The router's linear and the routing in one launch in decode (route_linear), where the
# linear, its bias add and `route` were launched apart: for routers with a bias (gpt-oss:
# three launches to one; H200, alone, 5.25 -> 4.15 us). Without one (qwen3: two to one) it
# is slower (3.43 -> 4.79 us; in the step 1.822 -> 1.901 ms): its top-k runs on 4 warps,
# where the route kernel's runs on one. MLXRUN_MOE_ROUTER: "bias" (default), "1" every
# router, "0" none (A/B).
ROUTER = os.environ.get("MLXRUN_MOE_ROUTER", "bias")


def routes_linear(x: torch.Tensor, e, o) -> bool:
    """Whether moe runs route_linear for x (T, H): ROUTER on for this router, a few rows of x (as many as
    the linear would run cuda_ops.dense_gemv for: its logits, bit for bit), the router
    dense in x's 16-bit dtype, rows contiguous."""
    from mlxrun.quant.triton_kernels import GEMV_MAX_M  # noqa: PLC0415

    r = e.router
    return (
        (ROUTER == "1" or (ROUTER == "bias" and e.router_bias is not None))
        and 0 < x.shape[0] <= GEMV_MAX_M
        and isinstance(r, torch.Tensor)
        and r.dtype == x.dtype in (torch.bfloat16, torch.float16)
        and r.stride(-1) == 1
        and r.stride(0) == r.shape[1]
        and (e.router_bias is None or e.router_bias.dtype == x.dtype)
    )


def route_linear(x: torch.Tensor, w: torch.Tensor, bias, o) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H) and the router w (E, H) (+ bias (E,)), dense in x's 16-bit dtype -> route's
    (weights (T, k) float32, ids (T, k) int32) in one launch (_router_kernel): the linear's
    logits, rounded as the linear and its bias add round them, then routed by the last
    program of each token, where the linear, the bias add and `route` were three launches
    (two without a bias)."""
    T, K = x.shape
    E = w.shape[0]
    k = o.top_k
    wout = torch.empty((T, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, k), dtype=torch.int32, device=x.device)
    if T:
        logits = torch.empty((T, E), dtype=x.dtype, device=x.device)
        rows, warps, vec = ROUTER_TILE
        block_k = 32 * warps * vec
        _router_kernel[(T, triton.cdiv(E, rows))](
            x.contiguous(), w, bias if bias is not None else w, logits, wout, ids,
            _counters(x.device, T), E, K, HAS_BIAS=bias is not None, BLOCK_N=rows,
            BLOCK_K=block_k, EVEN=E % rows == 0 and K % block_k == 0,
            ONE_STEP=K <= block_k, TOP_K=k, KP=triton.next_power_of_2(k),
            BLOCK_E=triton.next_power_of_2(E), SOFTMAX_FIRST=o.routing == "softmax_topk",
            NORM=o.norm_topk, PACKED=TOPK_PACKED, num_warps=warps, **pdl_args(x.device),
        )  # fmt: skip
    return wout, ids


@dataclasses.dataclass(frozen=True)
class QConfig:
    """_moe_qgemv's launch: warps a program (lanes along K), rows a program, prefetch."""

    warps: int
    block_n: int
    prefetch: bool


_QCFG_PART = re.compile(r"(gu|dn):(?:w(1|2|4|8))?(?:n(8|16))?(?:p([01]))?")


def parse_qcfg(spec: str) -> dict[str, dict]:
    """MLXRUN_MOE_QCFG, e.g. "gu:w2n16,dn:w1n8p0" -> {"gu": {...}, "dn": {...}}: the packed
    kernel's launch for gate/up (gu) or down (dn) in place of choose_qconfig's, field by
    field (w: warps a program, n: rows a program, 8 or 16, p: prefetch 0 or 1), for A/B
    timing (benchmarks/moe_kernels.py --qcfg, moe_fused_ab.py --qcfg)."""
    out: dict[str, dict] = {}
    for part in filter(None, spec.replace(" ", "").split(",")):
        m = _QCFG_PART.fullmatch(part)
        if m is None:
            raise MlxrunError(
                f"MLXRUN_MOE_QCFG: cannot read {part!r}: write gu: or dn: then any of w1/w2/w4/"
                "w8 (warps), n8/n16 (rows a program), p0/p1 (prefetch), e.g. gu:w2n16,dn:n8"
            )
        w, n, pf = m.group(2, 3, 4)
        out[m.group(1)] = {k: v for k, v in (("warps", w and int(w)), ("block_n", n and int(n)),
                                             ("prefetch", pf and pf == "1")) if v is not None}  # fmt: skip
    return out


QCFG = parse_qcfg(os.environ.get("MLXRUN_MOE_QCFG", ""))


def choose_qconfig(p: PackedExperts) -> QConfig:
    """As choose_config picks for a dense GEMV row of x: up to GEMV_WARPS warps while each
    gets 256 words of a row and the steps divide it; 16 rows (two halves sharing x) for affine, 8 for the float
    formats (they spill at 16 with one warp); no prefetch for E4M3 with many 4-warp steps.
    QCFG (MLXRUN_MOE_QCFG) replaces any of these for gate/up or down."""
    cfg = _default_qconfig(p)
    return dataclasses.replace(cfg, **QCFG.get("gu" if p.gated else "dn", {}))


def _default_qconfig(p: PackedExperts) -> QConfig:
    w = p.w
    kw = p.k * w.bits // 32
    warps = 1
    # more warps only while their k-step divides the row: gpt-oss-20b's 2880 inputs (360
    # 4-bit words) in one 2-warp step of 256 and a part-masked one ran slower than in 1-warp
    # steps of 128 (H200, a layer's mxfp4 experts at batch 1: 39.2 -> 33.4 us)
    while warps < GEMV_WARPS and 256 * warps <= kw and kw % (256 * warps) == 0:
        warps *= 2
    ksteps = math.ceil(kw / (128 * warps))
    bn = 16 if w.mode == "affine" else 8
    prefetch = not (w.mode == "mxfp8" and warps > 1 and ksteps > 2)
    return QConfig(warps, bn, prefetch)


# The down projection of a token's k slots as one GEMV over their joined rows
# (cuda_moe_down.py: no partials or ticket), where the per-slot kernel's programs each read
# one slot's short rows (qwen3-30b-a3b: 384 bytes). H200, the captured batch-1 step
# (moe_fused_ab.py --down 0;1 --topk 0,1, best of 3 alternated rounds), per-slot + float
# top-k -> joined with its first weights before the PDL wait + integer top-k: qwen3-30b-a3b
# int4 1.806 -> 1.685 ms (-6.7%), gpt-oss-20b fp4 1.579 -> 1.541 (-2.4%). MLXRUN_MOE_DOWN:
# "0" the per-slot kernel, "1" (default) joined with choose_down's launch, or "wXnY" joined
# with X warps, Y rows, and "wXnYe" its first weights loaded before the PDL wait (A/B).
DOWN = parse_down(os.environ.get("MLXRUN_MOE_DOWN", "1"))


def _down(h, flat, rw, y, dn: PackedExperts, bias, o, k: int) -> None:
    """The fused down launch: joined (DOWN) where it fits, else the per-slot kernel."""
    if DOWN and joined_fits(dn, k):
        warps, rows, early = DOWN if isinstance(DOWN, tuple) else choose_down(dn, k)
        joined_launch(h, flat, rw, y, dn, bias, k, warps, rows, early, pdl_args(h.device))
    else:
        _qlaunch(h, flat, y, rw, dn, bias, None, 1, o, True, top_k=k)


def _fused_args(out, top_k: int) -> dict:
    """The down kernels' slot-sum arguments (_slot_sum) for out (T, N), top_k slots a token:
    the (T*k, N) float32 partials and T * row tiles tickets (zeroed once, reset by the
    kernel); nothing (a slot a row of out) when top_k is 0."""
    if not top_k:
        return {}
    T, N = out.shape
    part = torch.empty((T * top_k, N), dtype=torch.float32, device=out.device)
    return {"PART": part, "CNT": _counters(out.device, T * triton.cdiv(N, 8)), "TOP_K": top_k}


def _qlaunch(x, ids, out, rw, p: PackedExperts, b1, b2, x_div, o, scaled, cfg=None, top_k=0):
    """_moe_qgemv over every slot of ids: out (S, N) a slot a row, or (T, N) with the top_k
    slots of each token summed in the kernel (top_k > 0, down only)."""
    cfg = cfg or choose_qconfig(p)
    w = p.w
    kw = p.k * w.bits // 32
    step = 128 * cfg.warps
    ksteps = math.ceil(kw / step)
    per_prog = cfg.block_n // 2 if p.gated else cfg.block_n
    even = p.n % per_prog == 0 and kw % step == 0
    bias = b1 is not None
    grid = (ids.shape[0], triton.cdiv(p.n, per_prog))
    _moe_qgemv[grid](
        x, ids, out, rw, w.weight, w.scales, w.biases if w.biases is not None else w.scales,
        b1 if bias else out, b2 if (bias and p.gated) else out, p.n, p.k, x_div,
        o.swiglu_limit, o.swiglu_alpha, MODE=_MODE_ID[w.mode], BITS=w.bits, G=w.group_size,
        GATED=p.gated, ACT=0 if o.act == "silu" else 1, HAS_BIAS=bias, SCALED=scaled,
        BLOCK_N=cfg.block_n, KSTEPS=ksteps, PREFETCH=cfg.prefetch, EVEN=even,
        KWC=kw if even else 0, WARPS=cfg.warps, num_warps=cfg.warps,
        **_fused_args(out, top_k), **pdl_args(x.device),
    )  # fmt: skip


def _parts(w):
    """(mode name, bits, group, weight, scales, biases) of a stacked expert weight."""
    if isinstance(w, QuantizedWeight):
        words = w.weight.view(torch.int32)
        biases = w.biases if w.biases is not None else w.scales
        return w.mode, w.bits, w.group_size, words, w.scales, biases
    return "dense", 32, 1, w, w, w


def _launch(x, ids, out, rw, w1, b1, w2, b2, x_div, o, gated, scaled, top_k=0):
    """_moe_gemv over every slot of ids, out as _qlaunch's."""
    mode, bits, g, W1, S1, B1 = _parts(w1)
    _, _, _, W2, S2, B2 = _parts(w2) if gated else (None, 0, 0, W1, S1, B1)
    S, N = ids.shape[0], out.shape[1]
    K = x.shape[-1]
    bias = b1 is not None
    # a k-step reads 128 bytes of each row (one cache line): 32 words of 4- or 8-bit
    # codes, 64 16-bit values (32 float32 ones)
    BLOCK_N, BW = 16, 32 if bits < 32 else 128 // W1.element_size()
    grid = (S, triton.cdiv(N, BLOCK_N))
    _moe_gemv[grid](
        x, ids, out, rw, W1, S1, B1, b1 if bias else out, W2, S2, B2,
        b2 if (bias and gated) else out, N, K, x_div, o.swiglu_limit, o.swiglu_alpha,
        MODE=_MODE[mode], BITS=bits, G=g, GATED=gated, ACT=0 if o.act == "silu" else 1,
        HAS_BIAS=bias, SCALED=scaled, BLOCK_N=BLOCK_N, BW=BW, num_warps=4,
        **_fused_args(out, top_k),
    )  # fmt: skip


GROUPED_BM = 16  # slots a tile: the tensor cores' narrowest M


def _slot_tiles(flat: torch.Tensor, num_experts: int, bm: int) -> torch.Tensor:
    """Slots (S,) int32 expert ids -> the padded expert-sorted slot list (P,) int32: each
    expert's slots in order, padded with -1 to a multiple of bm, experts in order, then -1 to
    P = S + E*(bm-1) rounded up to bm (the most any routing needs). Static shapes, no host
    sync: capturable."""
    S = flat.numel()
    dev = flat.device
    e = flat.long()
    order = torch.argsort(e, stable=True)
    se = e[order]
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, e, torch.ones_like(e))
    start = torch.cumsum(counts, 0) - counts
    padded = (counts + bm - 1) // bm * bm
    pstart = torch.cumsum(padded, 0) - padded
    pos = pstart[se] + torch.arange(S, device=dev) - start[se]
    total = (S + num_experts * (bm - 1) + bm - 1) // bm * bm
    out = torch.full((total,), -1, dtype=torch.int32, device=dev)
    out[pos] = order.to(torch.int32)
    return out


def _glaunch(x, ids, tiles, out, rw, p: PackedExperts, b1, b2, x_div, o, scaled):
    w = p.w
    bias = b1 is not None
    bn = 64
    ng = max(1, 64 // w.group_size)
    grid = (tiles.numel() // GROUPED_BM, triton.cdiv(p.n, bn))
    _moe_grouped[grid](
        x, ids, tiles, out, rw, w.weight, w.scales,
        w.biases if w.biases is not None else w.scales, b1 if bias else out,
        b2 if (bias and p.gated) else out, p.n, p.k, x_div, o.swiglu_limit, o.swiglu_alpha,
        MODE=_MODE_ID[w.mode], BITS=w.bits, G=w.group_size, GATED=p.gated,
        ACT=0 if o.act == "silu" else 1, HAS_BIAS=bias, SCALED=scaled, BM=GROUPED_BM, BN=bn,
        NG=ng, UPCAST=x.device.type != "cuda", num_warps=4,
    )  # fmt: skip


def grouped_wins(slots: int, o) -> bool:
    """Whether the grouped kernel runs a decode step: from 8 slots an expert on average
    (each weight tile then decoded once for several slots, against once a slot). H100,
    `benchmarks/moe_kernels.py --path slot,grouped` (a layer, us, slot / grouped): gpt-oss-20b
    int4 at 8 slots an expert (batch 64) 1,539 / 1,052, at 4 (batch 32) 793 / 1,020;
    mxfp4 at 4 806 / 757; qwen3-30b-a3b int4 at 4 (batch 64) 362 / 743, at 2 194 / 660."""
    return slots >= 8 * o.num_experts


def moe_grouped(x, ids, weights, e, o, out_dtype=None):
    """Many slots (prefill): x (T, H), ids (T, k), routing weights (T, k) -> (T, H) in
    `out_dtype` (x's when None; float32: a tensor-parallel rank's unrounded partial sums).

    Slots sorted by expert; each expert that was hit runs as two quantized matmuls over its
    tokens (qmatmul: the tensor-core GEMM that decodes weight tiles in registers, past 4
    rows), so its packed weights are read once and never expanded to a dense copy. One host
    sync (the counts): for prefill, not for a captured decode step. Needs `prepared(e)`."""
    from .torch_moe import expert_act  # noqa: PLC0415

    gu, dn = prepared(e)
    T, H = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=o.num_experts).tolist()
    xs = x[order // k]
    rw = weights.reshape(-1).float()[order]
    out = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    start = 0
    for j, c in enumerate(counts):
        if not c:
            continue
        sl = slice(start, start + c)
        start += c
        y = qmatmul(xs[sl], _expert_rows(gu, j))  # (c, 2I): gate, then up
        g, u = y[:, : gu.n], y[:, gu.n :]
        if e.gate_bias is not None:
            g, u = g + e.gate_bias[j], u + e.up_bias[j]
        d = qmatmul(expert_act(g, u, o), _expert_rows(dn, j), out_dtype=torch.float32)
        if e.down_bias is not None:
            d = d + e.down_bias[j]
        out[sl] = d * rw[sl, None]
    y = torch.empty_like(out)
    y[order] = out
    return y.view(T, k, H).sum(dim=1).to(out_dtype or x.dtype)


def moe_experts(x, ids, weights, e, o, grouped: bool | None = None, out_dtype=None,
                fused: bool | None = None):  # fmt: skip
    """x (T, H), ids (T, k) int, routing weights (T, k) -> (T, H) in `out_dtype` (as
    moe_grouped's): the top-k experts of every token, weighted and summed, in two launches.
    Packed experts: per slot (_moe_qgemv), or grouped by expert (_moe_grouped) where
    `grouped` (None: grouped_wins). `fused` (None: FUSED): the per-slot down kernels sum
    the k slots themselves (_slot_sum) and write (T, H) in the output dtype; else torch
    sums a (T*k, H) float32 result and casts it (two launches more)."""
    T, H = x.shape
    k = ids.shape[1]
    dt = out_dtype or x.dtype
    x = x.contiguous()
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty((T * k, o.intermediate_size), dtype=x.dtype, device=x.device)
    packed = prepared(e)
    slot = packed is None or not (grouped if grouped is not None else grouped_wins(T * k, o))
    if slot and (fused if fused is not None else FUSED):
        y = torch.empty((T, H), dtype=dt, device=x.device)
        if packed is None:
            _launch(x, flat, h, rw, e.gate, e.gate_bias, e.up, e.up_bias, k, o, True, False)
            _launch(h, flat, y, rw, e.down, e.down_bias, None, None, 1, o, False, True, k)
        else:
            gu, dn = packed
            _qlaunch(x, flat, h, rw, gu, e.gate_bias, e.up_bias, k, o, False)
            _down(h, flat, rw, y, dn, e.down_bias, o, k)
        return y
    y = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    if packed is None:
        _launch(x, flat, h, rw, e.gate, e.gate_bias, e.up, e.up_bias, k, o, True, False)
        _launch(h, flat, y, rw, e.down, e.down_bias, None, None, 1, o, False, True)
    elif not slot:
        gu, dn = packed
        tiles = _slot_tiles(flat, o.num_experts, GROUPED_BM)
        _glaunch(x, flat, tiles, h, rw, gu, e.gate_bias, e.up_bias, k, o, False)
        _glaunch(h, flat, tiles, y, rw, dn, e.down_bias, None, 1, o, True)
    else:
        gu, dn = packed
        _qlaunch(x, flat, h, rw, gu, e.gate_bias, e.up_bias, k, o, False)
        _qlaunch(h, flat, y, rw, dn, e.down_bias, None, 1, o, True)
    return y.view(T, k, H).sum(dim=1).to(dt)
