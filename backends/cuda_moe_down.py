"""The MoE down projection of a token's k experts as one GEMV over their joined rows.

The per-slot down kernel (`_moe_qgemv`, TOP_K > 0) gives each (slot, row tile) a program and
sums a token's k slots through float32 partials and a ticket. At qwen3-30b-a3b's shape a
slot's expert row is 768 inputs (96 int4 words, 384 bytes): a 1-warp k-step of 128 words
leaves a quarter of the lanes masked, and each program makes one short pass, then the
partials' store, atomic and reload, so down read at about half the gate/up launch's rate.

Here output row n of token t is one dot product over the k slots' rows joined:
    y[t, n] = sum_j rw[t, j] * (h[t*k + j] . W[e_j, n])  (+ sum_j rw[t, j] * bias[e_j, n])
h's k rows of a token are contiguous, so they are the joined x as they lie; word w of the
joined row is word w % KWE of slot w // KWE's expert row (KWE = words an expert row). A lane
reads 4 words of one slot (KWE % 4 == 0) and scales its products by that slot's routing
weight with the group scale, so the lanes' one sum is the token's weighted sum: no partials,
no ticket, one program a (token, row tile). The k-step loop is the dense GEMV's
(quant/triton_gemv.py and its k-step, triton_gemv_step.py: the same word layout, decode and x
loads); only where a lane's words and scales come from differs (the slot's expert).
"""

from __future__ import annotations

import re

import triton
import triton.language as tl

from mlxrun.errors import MlxrunError
from mlxrun.quant.triton_decode import _gemv_scale
from mlxrun.quant.triton_gemv import _gemv_lanes, _gemv_sum
from mlxrun.quant.triton_gemv_step import _gemv_half, _gemv_words, _step_x
from mlxrun.quant.triton_launch import tlc


@triton.jit
def _joined_words(W, ids_t, rn, n_mask, rkw, kb, N, KWE: tl.constexpr, KW: tl.constexpr,
                  EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """Words [8, 4*LANES] of joined k-step kb of rows rn: joined word w is word w % KWE of
    the row of expert ids_t[w // KWE]."""
    kw = kb * (4 * LANES) + rkw
    j = kw // KWE
    if EVEN:
        e = tl.load(ids_t + j)
    else:
        e = tl.load(ids_t + j, mask=kw < KW, other=0)
    rows = e.to(tl.int64)[None, :] * N + rn[:, None]
    ptrs = W + rows * KWE + (kw - j * KWE)[None, :]
    if EVEN:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=n_mask[:, None] & (kw < KW)[None, :], other=0)
    return w


@triton.jit
def _joined_apply(acc, p, pb, xsum, S, B, ids_t, rw_t, s_row, n_mask, g_a, g_b, kb, N,
                  KGE: tl.constexpr, KGV: tl.constexpr, MODE: tl.constexpr, G: tl.constexpr,
                  BITS: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """acc [8, LANES] += (p * scale (+ bias * xsum)) * rw of each lane's slot: the group
    scales of the lane's slot's expert (its scale tiles start at e * N * KGE)."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    NG: tl.constexpr = 4 * LANES // WPG  # groups per k-step
    vg = kb * NG + g_a  # [LANES] joined group of words 0, 1
    ok = vg < KGV
    j = vg // KGE
    if EVEN:
        e = tl.load(ids_t + j)
        r = tl.load(rw_t + j)
    else:
        e = tl.load(ids_t + j, mask=ok, other=0)
        r = tl.load(rw_t + j, mask=ok, other=0.0)
    base = (e.to(tl.int64) * N * KGE)[None, :] + s_row[:, None]
    m = n_mask[:, None] & ok[None, :]
    scale, bias = _gemv_scale(S, B, base + ((vg - j * KGE) * 8)[None, :], m, MODE, EVEN)
    if MODE == 0:
        acc = acc + (p * scale + bias * xsum[None, :]) * r[None, :]
    elif WPG < 4:  # nvfp4: words 2, 3 in the next group, of the same slot
        vg2 = kb * NG + g_b
        m2 = n_mask[:, None] & (vg2 < KGV)[None, :]
        scale2, _ = _gemv_scale(S, B, base + ((vg2 - j * KGE) * 8)[None, :], m2, MODE, EVEN)
        acc = acc + (p * scale + pb * scale2) * r[None, :]
    else:
        acc = acc + p * scale * r[None, :]
    return acc


@triton.jit
def _joined_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, g_b, s_row, s_row_h,
                 n_mask, n_mask_h, S, B, ids_t, rw_t, N, KGE: tl.constexpr,
                 KGV: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                 HALVES: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """One joined k-step of 8 rows (16: wa_h, acc_h, the second half sharing x)."""
    xo, xmask = _step_x(kb, x_pair0, g_pair, KGV, G, BITS, LANES)
    w0, w1, w2, w3 = _gemv_words(wa, LANES)
    p, pb, xsum = _gemv_half(w0, w1, w2, w3, x_base, xo, xmask, MODE, BITS, G, EVEN, LANES)
    acc = _joined_apply(acc, p, pb, xsum, S, B, ids_t, rw_t, s_row, n_mask, g_a, g_b, kb, N,
                        KGE, KGV, MODE, G, BITS, EVEN, LANES)  # fmt: skip
    if HALVES == 2:
        v0, v1, v2, v3 = _gemv_words(wa_h, LANES)
        q, qb, _ = _gemv_half(v0, v1, v2, v3, x_base, xo, xmask, MODE, BITS, G, EVEN, LANES)
        acc_h = _joined_apply(acc_h, q, qb, xsum, S, B, ids_t, rw_t, s_row_h, n_mask_h, g_a,
                              g_b, kb, N, KGE, KGV, MODE, G, BITS, EVEN, LANES)  # fmt: skip
    return acc, acc_h


@triton.jit
def _moe_down(X, IDS, RW, OUT, W, S, B, BIAS, N, MODE: tl.constexpr, BITS: tl.constexpr,
              G: tl.constexpr, KE: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_N: tl.constexpr, WARPS: tl.constexpr, EVEN: tl.constexpr,
              EARLY: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    """OUT[t, rows] for token t = program 0, rows program 1 * BLOCK_N..: the sum over its
    TOP_K slots s = t*TOP_K + j of RW[s] * (X[s] . W[IDS[s], row] + BIAS[IDS[s], row]).

    X (T*TOP_K, KE) in 16 or 32 bits; W, S, B: a QLinear's repacked words and row-tiled
    scales (and affine biases) of all experts, expert e's N rows at e*N (not MODE 3: E4M3).
    The joined row is TOP_K * KE inputs; a k-step is 4 words a lane of WARPS warps (the
    dense GEMV's), each step's words loaded one step ahead. EVEN: no row or K masks.
    PDL: x (h) is the previous kernel's output: the wait comes before its loads. EARLY: the
    first k-step's ids and words are loaded before the wait (the ids are the router's, two
    kernels back: complete once the previous kernel's programs, which waited for it, let
    this one launch); else nothing before it.
    """
    HALVES: tl.constexpr = BLOCK_N // 8
    LANES: tl.constexpr = 32 * WARPS
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    TWO: tl.constexpr = WPG < 4
    KWE: tl.constexpr = KE // EPW  # words an expert row
    KW: tl.constexpr = TOP_K * KWE  # words the joined row
    KGE: tl.constexpr = KE // G
    KGV: tl.constexpr = TOP_K * KGE
    KSTEPS: tl.constexpr = (KW + 4 * LANES - 1) // (4 * LANES)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PDL and not EARLY:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    ids_t = IDS + t * TOP_K
    rw_t = RW + t * TOP_K
    rn = pid_n * BLOCK_N + tl.arange(0, 8)
    rn_h = rn + 8
    n_mask = rn < N
    n_mask_h = rn_h < N
    rkw = tl.arange(0, 4 * LANES)
    lane = tl.arange(0, LANES)
    s_row = (rn // 8) * (KGE * 8) + (rn % 8)
    s_row_h = (rn_h // 8) * (KGE * 8) + (rn_h % 8)
    x_pair0, g_pair, g_a, g_b = _gemv_lanes(lane, G, WPG, TWO)
    x_base = X + t.to(tl.int64) * (TOP_K * KE)
    acc = tl.zeros([8, LANES], dtype=tl.float32)
    acc_h = tl.zeros([8, LANES], dtype=tl.float32)
    # as _gemv_ksteps' PREFETCH: two k-steps a trip, each step's words loaded one step
    # ahead (two register buffers, no copies; a fully unrolled loop let ptxas hoist every
    # step's loads: 255 registers and spills at qwen3's 6 one-warp steps)
    wa = _joined_words(W, ids_t, rn, n_mask, rkw, 0, N, KWE, KW, EVEN, LANES)
    wa_h = wa
    if HALVES == 2:
        wa_h = _joined_words(W, ids_t, rn_h, n_mask_h, rkw, 0, N, KWE, KW, EVEN, LANES)
    if PDL and EARLY:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    for i in range(0, KSTEPS // 2):
        kb = 2 * i
        wb = _joined_words(W, ids_t, rn, n_mask, rkw, kb + 1, N, KWE, KW, EVEN, LANES)
        wb_h = wb
        if HALVES == 2:
            wb_h = _joined_words(W, ids_t, rn_h, n_mask_h, rkw, kb + 1, N, KWE, KW, EVEN, LANES)
        acc, acc_h = _joined_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, g_b,
                                  s_row, s_row_h, n_mask, n_mask_h, S, B, ids_t, rw_t, N, KGE,
                                  KGV, MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
        kn = tl.minimum(kb + 2, KSTEPS - 1)  # past the last step: reloaded, never used
        wa = _joined_words(W, ids_t, rn, n_mask, rkw, kn, N, KWE, KW, EVEN, LANES)
        wa_h = wa
        if HALVES == 2:
            wa_h = _joined_words(W, ids_t, rn_h, n_mask_h, rkw, kn, N, KWE, KW, EVEN, LANES)
        acc, acc_h = _joined_step(acc, acc_h, wb, wb_h, kb + 1, x_base, x_pair0, g_pair, g_a,
                                  g_b, s_row, s_row_h, n_mask, n_mask_h, S, B, ids_t, rw_t, N,
                                  KGE, KGV, MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
    if KSTEPS % 2 == 1:
        acc, acc_h = _joined_step(acc, acc_h, wa, wa_h, KSTEPS - 1, x_base, x_pair0, g_pair,
                                  g_a, g_b, s_row, s_row_h, n_mask, n_mask_h, S, B, ids_t, rw_t,
                                  N, KGE, KGV, MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
    out = _gemv_sum(acc, MODE)  # [8]
    if HALVES == 2:
        out = tl.reshape(tl.trans(tl.join(out, _gemv_sum(acc_h, MODE))), [16])
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if HAS_BIAS:  # sum_j rw_j * bias[e_j, rows]
        for j in tl.static_range(TOP_K):
            e = tl.load(ids_t + j).to(tl.int64)
            b = tl.load(BIAS + e * N + rows, mask=rmask, other=0.0).to(tl.float32)
            out += tl.load(rw_t + j) * b
    tl.store(OUT + t.to(tl.int64) * N + rows, out.to(OUT.dtype.element_ty), mask=rmask)


def joined_fits(p, top_k: int) -> bool:
    """Whether _moe_down runs PackedExperts p (down): not E4M3 (its k-step decodes bytes by
    another path), and a lane's 4 words in one slot's row (words a row a multiple of 4)."""
    w = p.w
    return w.mode != "mxfp8" and (p.k * w.bits // 32) % 4 == 0 and top_k > 0


def joined_launch(h, ids, rw, out, p, bias, top_k: int, warps: int, block_n: int, early: bool,
                  pdl: dict):  # fmt: skip
    """_moe_down: out (T, N) = each token's top_k slots of h (T*top_k, K) through expert
    ids (T*top_k,) int32 of PackedExperts p (down), weighted by rw (T*top_k,) float32;
    early: the first weights loaded before the PDL wait (_moe_down's EARLY)."""
    from mlxrun.quant.triton_layout import _MODE_ID  # noqa: PLC0415

    w = p.w
    T = out.shape[0]
    kw = top_k * p.k * w.bits // 32
    even = p.n % block_n == 0 and kw % (128 * warps) == 0
    _moe_down[(T, triton.cdiv(p.n, block_n))](
        h, ids, rw, out, w.weight, w.scales, w.biases if w.biases is not None else w.scales,
        bias if bias is not None else out, p.n, MODE=_MODE_ID[w.mode], BITS=w.bits,
        G=w.group_size, KE=p.k, TOP_K=top_k, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        WARPS=warps, EVEN=even, EARLY=early, num_warps=warps, **pdl,
    )  # fmt: skip


_DOWN_SPEC = re.compile(r"w(1|2|4|8)n(8|16)(e?)")


def parse_down(spec: str) -> tuple[int, int, bool] | bool:
    """MLXRUN_MOE_DOWN -> False (per slot), True (joined, choose_down) or (warps, rows,
    early)."""
    spec = spec.strip()
    if spec in ("0", "1"):
        return spec == "1"
    m = _DOWN_SPEC.fullmatch(spec)
    if m is None:
        raise MlxrunError(
            f"MLXRUN_MOE_DOWN: cannot read {spec!r}: write 0 (per-slot down kernel), 1 (joined)"
            " or w<warps>n<rows>[e], e.g. w2n16 (warps 1/2/4/8, rows 8/16; e: weights before"
            " the PDL wait)"
        )
    return int(m.group(1)), int(m.group(2)), m.group(3) == "e"


def choose_down(p, top_k: int) -> tuple[int, int, bool]:
    """The joined down kernel's (warps, rows a program, early): 8 rows; 2 warps where their
    k-step of 256 words divides the joined row, else 4; the first weights before the PDL
    wait. One H200, a layer's experts at batch 1 (moe_kernels.py --down, us; per-slot down
    first): qwen3-30b-a3b int4 (768 words) 17.2 / w1 18.3, w2 14.7, w4 14.8, w8 14.3, 16
    rows w2 17.9 (128 programs: under one an SM), w2 early 14.0; gpt-oss-20b mxfp4 (1440)
    32.6 / w1 41.1, w2 36.4, w4 31.4, w8 31.8, w4 early 30.8."""
    kw = top_k * p.k * p.w.bits // 32
    return (2 if kw % 256 == 0 else 4), 8, True
