"""The CUDA-core GEMV for x [M <= GEMV_MAX_M, K] @ W^T over a QLinear (triton_layout.py): its
lane layout and k-loop (_gemv_lanes, _gemv_ksteps, _gemv_sum; also the packed MoE kernel's,
backends/cuda_moe_kernels.py, and the K-quant lane GEMV's) and the kernel. The decode and
epilogue helpers it shares with the other kernels are in triton_decode.py (re-exported here
for the modules that take them with the k-loop's). qmatmul in triton_kernels.py launches
the kernel.

Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

from .triton_decode import (  # noqa: F401 (re-exported)
    E2M1_PAIR,
    E4M3_CVT,
    _decode_pos,
    _e4m3_scales,
    _gemv_scale,
    _gemv_scale_quads,
    _gemv_x4,
    _gemv_x4v,
    _gemv_xq,
    _gemv_xsum,
    _group_scale,
    _scale_code,
    _silu_epilogue,
    _silu_store,
    _split_sum,
    _splitk_epilogue,
)
from .triton_launch import tl, tlc, triton


@triton.jit
def _load_step(w_ptr, rn, n_mask, rkw, kb, stride_wn, EVEN: tl.constexpr, MODE: tl.constexpr,
               LANES: tl.constexpr):  # fmt: skip
    """Words [8, 4*LANES] of k-step kb of rows rn (stride_wn = words/row); E4M3 (MODE 3):
    the same bytes as [8, 16*LANES] uint8 (converted by the hardware).
    EVEN: no row/K masks (stride_wn is then a constexpr: rows at immediate offsets)."""
    if MODE == 3:
        kw = kb * (16 * LANES) + tl.arange(0, 16 * LANES)  # bytes
        base = w_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        row = stride_wn * 4
    else:
        kw = kb * (4 * LANES) + rkw
        base = w_ptr
        row = stride_wn
    ptrs = base + rn[:, None] * row + kw[None, :]
    if EVEN:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=n_mask[:, None] & (kw < row)[None, :], other=0)
    return w


@triton.jit
def _gemv_words(w2, LANES: tl.constexpr):
    """[8, 4*LANES] words -> 4 x [8, LANES] (word 4l+j of each row in lane l, j = 0..3)."""
    w4 = tl.reshape(w2.to(tl.uint32, bitcast=True), [8, LANES, 2, 2])
    w_even, w_odd = tl.split(w4)  # words 4l+2c / 4l+2c+1, [8, LANES, 2]
    w0, w2_ = tl.split(w_even)
    w1, w3 = tl.split(w_odd)
    return w0, w1, w2_, w3


@triton.jit
def _split22(t):
    """t [.., 2, 2] -> t[.., 0, 0], t[.., 0, 1], t[.., 1, 0], t[.., 1, 1]."""
    lo, hi = tl.split(t)  # last index 0 / 1
    a00, a10 = tl.split(lo)
    a01, a11 = tl.split(hi)
    return a00, a01, a10, a11


@triton.jit
def _gemv_fp8(p, wb, x_base, xo, xmask, G: tl.constexpr, BITS: tl.constexpr,
              EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """p [8, LANES] += E4M3 bytes wb [8, 16*LANES] (word 4l+j, position b at byte
    16l+4j+b) x x: the bytes become fp32 by the hardware conversion (E4M3 pairs -> f16x2
    -> f32)."""
    WPG: tl.constexpr = G // 4
    v = tl.reshape(wb.to(tl.float8e4nv, bitcast=True).to(tl.float32), [8, LANES, 4, 2, 2])
    f0, f1, f2, f3 = _split22(v)  # positions b = 0..3: [8, LANES, 4] (word j)
    for b in tl.static_range(4):
        if b == 0:
            fb = f0
        elif b == 1:
            fb = f1
        elif b == 2:
            fb = f2
        else:
            fb = f3
        g0, g1, g2, g3 = _split22(tl.reshape(fb, [8, LANES, 2, 2]))  # words j = 0..3
        x0, x1, x2, x3 = _gemv_x4(x_base, xo + b * (WPG // 2), xmask, b, 3, BITS, EVEN)
        p = p + g0 * x0[None, :] + g1 * x1[None, :] + g2 * x2[None, :] + g3 * x3[None, :]
    return p


@triton.jit
def _gemv_fma(p, pb, w0, w1, w2, w3, x0, x1, x2, x3, I: tl.constexpr, MODE: tl.constexpr,
              BITS: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    """p (+ pb: words 2, 3 when TWO) += decoded position I of 8 rows x this lane's inputs;
    p + a + b + ... left to right: one FFMA chain per row."""
    f0 = _decode_pos(w0, I, MODE, BITS)
    f1 = _decode_pos(w1, I, MODE, BITS)
    f2 = _decode_pos(w2, I, MODE, BITS)
    f3 = _decode_pos(w3, I, MODE, BITS)
    if TWO:
        p = p + f0 * x0[None, :] + f1 * x1[None, :]
        pb = pb + f2 * x2[None, :] + f3 * x3[None, :]
    else:
        p = p + f0 * x0[None, :] + f1 * x1[None, :] + f2 * x2[None, :] + f3 * x3[None, :]
    return p, pb


@triton.jit
def _gemv_apply(acc, p, pb, xsum, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, kb, KG,
                MODE: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                EVEN: tl.constexpr, LANES: tl.constexpr,
                QUADS: tl.constexpr = False):  # fmt: skip
    """acc [8, LANES] += p * scale (+ bias * xsum) with the scales of this lane's groups.
    QUADS (fp4, EVEN): s_row is a SiLU tile's (_gemv_scale_quads)."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    NG: tl.constexpr = 4 * LANES // WPG  # groups per k-step
    g_idx = kb * NG + g_a  # [LANES]
    if QUADS:
        scale = _gemv_scale_quads(s_ptr, s_row, g_idx, MODE, LANES)
        bias = scale
    else:
        smask = n_mask[:, None] & (g_idx < KG)[None, :]
        scale, bias = _gemv_scale(s_ptr, b_ptr, s_row[:, None] + g_idx[None, :] * 8, smask,
                                  MODE, EVEN)  # fmt: skip
    if MODE == 0:
        acc = acc + p * scale + bias * xsum[None, :]
    elif WPG < 4:
        g_idx2 = kb * NG + g_b
        if QUADS:
            scale2 = _gemv_scale_quads(s_ptr, s_row, g_idx2, MODE, LANES)
        else:
            smask2 = n_mask[:, None] & (g_idx2 < KG)[None, :]
            scale2, _ = _gemv_scale(s_ptr, b_ptr, s_row[:, None] + g_idx2[None, :] * 8,
                                    smask2, MODE, EVEN)  # fmt: skip
        acc = acc + p * scale + pb * scale2
    else:
        acc = acc + p * scale
    return acc


@triton.jit
def _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, g_b, s_row, s_row_h,
               n_mask, n_mask_h, s_ptr, b_ptr, KG, MODE: tl.constexpr, BITS: tl.constexpr,
               G: tl.constexpr, HALVES: tl.constexpr, EVEN: tl.constexpr,
               LANES: tl.constexpr, XVEC: tl.constexpr = False,
               QUADS: tl.constexpr = False):  # fmt: skip
    """One k-step of _gemv_kernel for 8 rows (HALVES == 1) or 16 (wa_h, acc_h: rows 8..15,
    sharing the x inputs): acc [8, LANES] += this lane's 4 words of each row (wa [8,
    4*LANES]) times x, with the scales (and biases) of their groups."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    NG: tl.constexpr = 4 * LANES // WPG  # groups per k-step
    TWO: tl.constexpr = WPG < 4  # nvfp4: a lane's words 0,1 and 2,3 are in two groups
    TRICK: tl.constexpr = MODE == 0 and BITS == 4  # positions 6, 7 by shifts alone
    NPOS: tl.constexpr = 0 if MODE == 3 else (EPW - 2 if TRICK else EPW)
    p = tl.zeros([8, LANES], dtype=tl.float32)
    pb = tl.zeros([8, LANES], dtype=tl.float32)
    q = tl.zeros([8, LANES], dtype=tl.float32)
    qb = tl.zeros([8, LANES], dtype=tl.float32)
    xo = x_pair0 + kb * (NG * G // 2)
    xmask = (kb * NG + g_pair) < KG
    if MODE == 3:  # E4M3 bytes -> fp32 values by cvt (2 an instruction), x unscaled
        p = _gemv_fp8(p, wa, x_base, xo, xmask, G, BITS, EVEN, LANES)
        if HALVES == 2:
            q = _gemv_fp8(q, wa_h, x_base, xo, xmask, G, BITS, EVEN, LANES)
    else:
        w0, w1, w2, w3 = _gemv_words(wa, LANES)
        if HALVES == 2:
            v0, v1, v2, v3 = _gemv_words(wa_h, LANES)
    xsum = tl.zeros([LANES], dtype=tl.float32)  # sum of the lane's inputs * 2^-49
    xv0, xv1, xv2, xv3 = xo, xo, xo, xo  # XVEC: the k-step's x, 4 16-byte loads a lane
    if XVEC:
        xv0, xv1, xv2, xv3 = (_gemv_xq(x_base, xo, xmask, 0, EVEN),
                              _gemv_xq(x_base, xo, xmask, 1, EVEN),
                              _gemv_xq(x_base, xo, xmask, 2, EVEN),
                              _gemv_xq(x_base, xo, xmask, 3, EVEN))  # fmt: skip
    for i in tl.static_range(NPOS):
        x0, x1, x2, x3 = _gemv_x4v(xv0, xv1, xv2, xv3, x_base, xo, xmask, i, MODE, BITS, G,
                                   EVEN, XVEC)  # fmt: skip
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, x0, x1, x2, x3, i, MODE, BITS, TWO)
        if HALVES == 2:
            q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, x0, x1, x2, x3, i, MODE, BITS, TWO)
        if MODE == 0:
            xsum += _gemv_xsum(x0, x1, x2, x3, i, BITS)
    if TRICK:  # position 6: w >> 24 = q6 + 16*q7; position 7: w >> 28 = q7, x7 - 16*x6
        y0, y1, y2, y3 = _gemv_x4(x_base, xo + 6 * (WPG // 2), xmask, 6, MODE, BITS, EVEN)
        z0, z1, z2, z3 = _gemv_x4(x_base, xo + 7 * (WPG // 2), xmask, 7, MODE, BITS, EVEN)
        xsum += (y0 + y1 + y2 + y3 + z0 + z1 + z2 + z3) * 1.401298464324817e-45
        z0 = z0 - 16.0 * y0
        z1 = z1 - 16.0 * y1
        z2 = z2 - 16.0 * y2
        z3 = z3 - 16.0 * y3
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, y0, y1, y2, y3, 6, MODE, BITS, TWO)
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, z0, z1, z2, z3, 7, MODE, BITS, TWO)
        if HALVES == 2:
            q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, y0, y1, y2, y3, 6, MODE, BITS, TWO)
            q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, z0, z1, z2, z3, 7, MODE, BITS, TWO)
    acc = _gemv_apply(acc, p, pb, xsum, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, kb, KG,
                      MODE, G, BITS, EVEN, LANES, QUADS)  # fmt: skip
    if HALVES == 2:
        acc_h = _gemv_apply(acc_h, q, qb, xsum, s_ptr, b_ptr, s_row_h, n_mask_h, g_a, g_b,
                            kb, KG, MODE, G, BITS, EVEN, LANES)  # fmt: skip
    return acc, acc_h


@triton.jit
def _gemv_half(w0, w1, w2, w3, x_base, xo, xmask, MODE: tl.constexpr, BITS: tl.constexpr,
               G: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr,
               XVEC: tl.constexpr = False):  # fmt: skip
    """(p, pb, xsum): every position of one 8-row half's words w0..w3 [8, LANES] times x,
    in _gemv_step's order (the same FFMA chains, so the same sums); for _gemv_step_seq."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    TWO: tl.constexpr = WPG < 4
    TRICK: tl.constexpr = MODE == 0 and BITS == 4
    NPOS: tl.constexpr = EPW - 2 if TRICK else EPW
    p = tl.zeros([8, LANES], dtype=tl.float32)
    pb = tl.zeros([8, LANES], dtype=tl.float32)
    xsum = tl.zeros([LANES], dtype=tl.float32)
    xv0, xv1, xv2, xv3 = xo, xo, xo, xo  # XVEC: the k-step's x, 4 16-byte loads a lane
    if XVEC:
        xv0, xv1, xv2, xv3 = (_gemv_xq(x_base, xo, xmask, 0, EVEN),
                              _gemv_xq(x_base, xo, xmask, 1, EVEN),
                              _gemv_xq(x_base, xo, xmask, 2, EVEN),
                              _gemv_xq(x_base, xo, xmask, 3, EVEN))  # fmt: skip
    for i in tl.static_range(NPOS):
        x0, x1, x2, x3 = _gemv_x4v(xv0, xv1, xv2, xv3, x_base, xo, xmask, i, MODE, BITS, G,
                                   EVEN, XVEC)  # fmt: skip
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, x0, x1, x2, x3, i, MODE, BITS, TWO)
        if MODE == 0:
            xsum += _gemv_xsum(x0, x1, x2, x3, i, BITS)
    if TRICK:  # as _gemv_step
        y0, y1, y2, y3 = _gemv_x4(x_base, xo + 6 * (WPG // 2), xmask, 6, MODE, BITS, EVEN)
        z0, z1, z2, z3 = _gemv_x4(x_base, xo + 7 * (WPG // 2), xmask, 7, MODE, BITS, EVEN)
        xsum += (y0 + y1 + y2 + y3 + z0 + z1 + z2 + z3) * 1.401298464324817e-45
        z0 = z0 - 16.0 * y0
        z1 = z1 - 16.0 * y1
        z2 = z2 - 16.0 * y2
        z3 = z3 - 16.0 * y3
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, y0, y1, y2, y3, 6, MODE, BITS, TWO)
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, z0, z1, z2, z3, 7, MODE, BITS, TWO)
    return p, pb, xsum


@triton.jit
def _gemv_kstep(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, g_b, s_row, s_row_h,
                n_mask, n_mask_h, s_ptr, b_ptr, KG, MODE: tl.constexpr, BITS: tl.constexpr,
                G: tl.constexpr, HALVES: tl.constexpr, EVEN: tl.constexpr,
                LANES: tl.constexpr, SEQ: tl.constexpr, XVEC: tl.constexpr = False,
                QUADS: tl.constexpr = False):  # fmt: skip
    """_gemv_step, or with SEQ (16 rows, not E4M3) the first half's every position, then
    the second's, instead of both halves a position at a time: the first half's FMAs then
    need only its own words (loaded first) and may run while the second half's are still
    in flight. The same FFMA chains in the same order: the same sums."""
    if SEQ and HALVES == 2 and MODE != 3:
        EPW: tl.constexpr = 32 // BITS
        NG: tl.constexpr = 4 * LANES // (G // EPW)  # groups per k-step
        xo = x_pair0 + kb * (NG * G // 2)
        xmask = (kb * NG + g_pair) < KG
        w0, w1, w2, w3 = _gemv_words(wa, LANES)
        p, pb, xsum = _gemv_half(w0, w1, w2, w3, x_base, xo, xmask, MODE, BITS, G, EVEN,
                                  LANES, XVEC)  # fmt: skip
        acc = _gemv_apply(acc, p, pb, xsum, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, kb, KG,
                          MODE, G, BITS, EVEN, LANES)  # fmt: skip
        v0, v1, v2, v3 = _gemv_words(wa_h, LANES)
        q, qb, _ = _gemv_half(v0, v1, v2, v3, x_base, xo, xmask, MODE, BITS, G, EVEN,
                                  LANES, XVEC)  # fmt: skip
        acc_h = _gemv_apply(acc_h, q, qb, xsum, s_ptr, b_ptr, s_row_h, n_mask_h, g_a, g_b,
                            kb, KG, MODE, G, BITS, EVEN, LANES)  # fmt: skip
    else:
        acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, g_b,
                                s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG, MODE,
                                BITS, G, HALVES, EVEN, LANES, XVEC, QUADS)  # fmt: skip
    return acc, acc_h


@triton.jit
def _gemv_scales_of(kb, s_ptr, b_ptr, s_row, n_mask, g_a, KG, MODE: tl.constexpr,
                    G: tl.constexpr, BITS: tl.constexpr, EVEN: tl.constexpr,
                    LANES: tl.constexpr):  # fmt: skip
    """The scales and biases [8, LANES] of k-step kb's groups g_a of this lane (as _gemv_apply
    loads them)."""
    NG: tl.constexpr = 4 * LANES // (G // (32 // BITS))  # groups per k-step
    g_idx = kb * NG + g_a
    smask = n_mask[:, None] & (g_idx < KG)[None, :]
    return _gemv_scale(s_ptr, b_ptr, s_row[:, None] + g_idx[None, :] * 8, smask, MODE, EVEN)


@triton.jit
def _load_early(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw, kb, swn, s_ptr, b_ptr, s_row, s_row_h,
                g_a, g_b, KG, MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                HALVES: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """k-step kb's words, scales and biases of both halves (the second half's = the first's
    when HALVES == 1), for EARLY. nvfp4 (a lane's words 0, 1 and 2, 3 in two groups): the
    bias slots hold the scales of words 2, 3 (groups g_b)."""
    TWO: tl.constexpr = G // (32 // BITS) < 4
    wa = _load_step(w_ptr, rn, n_mask, rkw, kb, swn, EVEN, MODE, LANES)
    sa, ba = _gemv_scales_of(kb, s_ptr, b_ptr, s_row, n_mask, g_a, KG, MODE, G, BITS, EVEN,
                             LANES)  # fmt: skip
    if TWO:
        ba, _ = _gemv_scales_of(kb, s_ptr, b_ptr, s_row, n_mask, g_b, KG, MODE, G, BITS, EVEN,
                                LANES)  # fmt: skip
    wa_h = wa
    sh = sa
    bh = ba
    if HALVES == 2:
        wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb, swn, EVEN, MODE, LANES)
        sh, bh = _gemv_scales_of(kb, s_ptr, b_ptr, s_row_h, n_mask_h, g_a, KG, MODE, G, BITS,
                                 EVEN, LANES)  # fmt: skip
        if TWO:
            bh, _ = _gemv_scales_of(kb, s_ptr, b_ptr, s_row_h, n_mask_h, g_b, KG, MODE, G,
                                    BITS, EVEN, LANES)  # fmt: skip
    return wa, wa_h, sa, ba, sh, bh


@triton.jit
def _gemv_one_step(acc, acc_h, wa, wa_h, sa, ba, sh, bh, kb, x_base, x_pair0, g_pair, KG,
                   MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                   HALVES: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr,
                   XVEC: tl.constexpr = False):  # fmt: skip
    """_gemv_step with the scales sa, sh and biases ba, bh already loaded (nvfp4: ba, bh the
    scales of words 2, 3): the same sums (each half as _gemv_kstep's SEQ); not for E4M3."""
    EPW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = 4 * LANES // (G // EPW)  # groups per k-step
    TWO: tl.constexpr = G // EPW < 4
    xo = x_pair0 + kb * (NG * G // 2)
    xmask = (kb * NG + g_pair) < KG
    w0, w1, w2, w3 = _gemv_words(wa, LANES)
    p, pb, xsum = _gemv_half(w0, w1, w2, w3, x_base, xo, xmask, MODE, BITS, G, EVEN, LANES,
                             XVEC)  # fmt: skip
    if MODE == 0:
        acc = acc + p * sa + ba * xsum[None, :]
    elif TWO:
        acc = acc + p * sa + pb * ba
    else:
        acc = acc + p * sa
    if HALVES == 2:
        v0, v1, v2, v3 = _gemv_words(wa_h, LANES)
        q, qb, _ = _gemv_half(v0, v1, v2, v3, x_base, xo, xmask, MODE, BITS, G, EVEN, LANES,
                              XVEC)  # fmt: skip
        if MODE == 0:
            acc_h = acc_h + q * sh + bh * xsum[None, :]
        elif TWO:
            acc_h = acc_h + q * sh + qb * bh
        else:
            acc_h = acc_h + q * sh
    return acc, acc_h


@triton.jit
def _gemv_lanes(lane, G: tl.constexpr, WPG: tl.constexpr, TWO: tl.constexpr):
    """Where lane l (`lane`: [LANES]) reads in a k-step: x_pair0 [LANES, 2], its inputs at
    position 0 in input pairs (pair c: words 4l+2c, 4l+2c+1; uint32 units of 2 inputs: one
    8-byte vector a lane unless TWO, then 2 x 4 bytes); g_pair [LANES, 2], the groups of
    those pairs; g_a, g_b [LANES], the groups of words 0, 1 and of words 2, 3 (== g_a unless
    TWO)."""
    if TWO:
        x_pair0 = (2 * lane[:, None] + tl.arange(0, 2)[None, :]) * (G // 2)
        g_pair = 2 * lane[:, None] + tl.arange(0, 2)[None, :]
    else:
        xl = (lane // (WPG // 4)) * (G // 2) + (2 * lane) % (WPG // 2)
        x_pair0 = tl.multiple_of(xl, 2)[:, None] + tl.arange(0, 2)[None, :]
        g_pair = (lane // (WPG // 4))[:, None] + 0 * tl.arange(0, 2)[None, :]
    g_a = (4 * lane) // WPG
    g_b = (4 * lane + 2) // WPG
    return x_pair0, g_pair, g_a, g_b


@triton.jit
def _gemv_ksteps(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw, kb0, swn, x_base, x_pair0, g_pair,
                 g_a, g_b, s_row, s_row_h, s_ptr, b_ptr, KG, MODE: tl.constexpr,
                 BITS: tl.constexpr, G: tl.constexpr, HALVES: tl.constexpr,
                 EVEN: tl.constexpr, LANES: tl.constexpr, KSTEPS: tl.constexpr,
                 PREFETCH: tl.constexpr, PDL: tl.constexpr,
                 SEQ: tl.constexpr = False, EARLY: tl.constexpr = False,
                 XVEC: tl.constexpr = False, QUADS: tl.constexpr = False):  # fmt: skip
    """(acc, acc_h) [8, LANES]: k-steps kb0 .. kb0 + KSTEPS of rows rn (and rn_h, the second
    half, when HALVES == 2) through _gemv_step, swn words a row. With PREFETCH the loop runs
    two k-steps an iteration, each step's words loaded one step ahead (two register
    buffers, no copies). PDL: wait for the previous kernel (after the first step's loads
    with PREFETCH: the weights depend on no kernel) and let the next one launch."""
    acc = tl.zeros([8, LANES], dtype=tl.float32)
    acc_h = tl.zeros([8, LANES], dtype=tl.float32)
    if EARLY and MODE != 3:
        # each step's scales (and biases) are loaded with its words, one step ahead (the
        # first before the wait), instead of after its FMAs: a split of one k-step otherwise
        # ends on a DRAM round trip for them
        wa, wa_h, sa, ba, sh, bh = _load_early(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw, kb0,
                                               swn, s_ptr, b_ptr, s_row, s_row_h, g_a, g_b, KG,
                                               MODE, BITS, G, HALVES, EVEN,
                                               LANES)  # fmt: skip
        if PDL:
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        kb_last = kb0 + KSTEPS - 1
        for j in range(0, KSTEPS // 2):
            kb = kb0 + 2 * j
            wb, wb_h, sb, bb, sbh, bbh = _load_early(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw,
                                                     kb + 1, swn, s_ptr, b_ptr, s_row,
                                                     s_row_h, g_a, g_b, KG, MODE, BITS, G,
                                                     HALVES, EVEN, LANES)  # fmt: skip
            acc, acc_h = _gemv_one_step(acc, acc_h, wa, wa_h, sa, ba, sh, bh, kb, x_base,
                                        x_pair0, g_pair, KG, MODE, BITS, G, HALVES, EVEN,
                                        LANES, XVEC)  # fmt: skip
            kn = tl.minimum(kb + 2, kb_last)  # past the last step: reloaded, never used
            wa, wa_h, sa, ba, sh, bh = _load_early(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw, kn,
                                                   swn, s_ptr, b_ptr, s_row, s_row_h, g_a, g_b,
                                                   KG, MODE, BITS, G, HALVES, EVEN,
                                                   LANES)  # fmt: skip
            acc, acc_h = _gemv_one_step(acc, acc_h, wb, wb_h, sb, bb, sbh, bbh, kb + 1, x_base,
                                        x_pair0, g_pair, KG, MODE, BITS, G, HALVES, EVEN,
                                        LANES, XVEC)  # fmt: skip
        if KSTEPS % 2 == 1:
            acc, acc_h = _gemv_one_step(acc, acc_h, wa, wa_h, sa, ba, sh, bh, kb_last, x_base,
                                        x_pair0, g_pair, KG, MODE, BITS, G, HALVES, EVEN,
                                        LANES, XVEC)  # fmt: skip
    elif PREFETCH:  # each step's words are in flight while the previous step computes
        # (with PDL the first step's are issued before the wait, while the previous kernel
        # still runs; a second step issued there too made ptxas hold it through the loop:
        # 134 -> 168 registers at 8 rows, 4096x14336 16.4 -> 21.9 us on the H100)
        wa = _load_step(w_ptr, rn, n_mask, rkw, kb0, swn, EVEN, MODE, LANES)
        wa_h = wa
        if HALVES == 2:
            wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb0, swn, EVEN, MODE, LANES)
        if PDL:
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        kb_last = kb0 + KSTEPS - 1
        for j in range(0, KSTEPS // 2):
            kb = kb0 + 2 * j
            wb = _load_step(w_ptr, rn, n_mask, rkw, kb + 1, swn, EVEN, MODE, LANES)
            wb_h = wb
            if HALVES == 2:
                wb_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb + 1, swn, EVEN, MODE, LANES)
            acc, acc_h = _gemv_kstep(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a,
                                     g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG,
                                     MODE, BITS, G, HALVES, EVEN, LANES, SEQ, XVEC, QUADS)  # fmt: skip
            # past the last step: reload it (in bounds, no predicate, never used; peeling
            # the last pair instead makes ptxas spill at 16 rows)
            kn = tl.minimum(kb + 2, kb_last)
            wa = _load_step(w_ptr, rn, n_mask, rkw, kn, swn, EVEN, MODE, LANES)
            wa_h = wa
            if HALVES == 2:
                wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kn, swn, EVEN, MODE, LANES)
            acc, acc_h = _gemv_kstep(acc, acc_h, wb, wb_h, kb + 1, x_base, x_pair0, g_pair,
                                     g_a, g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr,
                                     KG, MODE, BITS, G, HALVES, EVEN, LANES, SEQ, XVEC, QUADS)  # fmt: skip
        if KSTEPS % 2 == 1:
            acc, acc_h = _gemv_kstep(acc, acc_h, wa, wa_h, kb_last, x_base, x_pair0, g_pair,
                                     g_a, g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr,
                                     KG, MODE, BITS, G, HALVES, EVEN, LANES, SEQ, XVEC, QUADS)  # fmt: skip
    else:
        if PDL:
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        for j in range(0, KSTEPS):
            kb = kb0 + j
            wa = _load_step(w_ptr, rn, n_mask, rkw, kb, swn, EVEN, MODE, LANES)
            wa_h = wa
            if HALVES == 2:
                wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb, swn, EVEN, MODE, LANES)
            acc, acc_h = _gemv_kstep(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a,
                                     g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG,
                                     MODE, BITS, G, HALVES, EVEN, LANES, SEQ, XVEC, QUADS)  # fmt: skip
    return acc, acc_h


@triton.jit
def _gemv_sum(acc, MODE: tl.constexpr):
    """acc [8, LANES] -> [8]: the lanes summed (across warps through shared memory), times
    the power of two the decoded products carry: 2^-49 (affine), 2^-20 (fp8) or 2^-26
    (fp4)."""
    if MODE == 0:
        C: tl.constexpr = 562949953421312.0
    elif MODE == 3:
        C: tl.constexpr = 1.0
    else:
        C: tl.constexpr = 67108864.0
    return tl.sum(acc, axis=1) * C


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_wn,
    MODE: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    KB_PER_SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN: tl.constexpr = False,
    KW: tl.constexpr = 0,
    PDL: tl.constexpr = False,
    SILU: tl.constexpr = False,
    WARPS: tl.constexpr = 1,
    SEQ: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    XVEC: tl.constexpr = False,
    QUADS: tl.constexpr = False,
    bias_ptr=None,
    HAS_BIAS: tl.constexpr = False,
):
    """y[m, N] = x[m, K] @ W^T (+ bias[N]) for one row m of x: CUDA-core FMA on decoded codes.

    WARPS warps per program (launch with num_warps=WARPS), BLOCK_N = 8 or 16 rows (two
    halves of 8 sharing each x input). Lane l of the LANES = 32*WARPS loads words
    4l..4l+3 of each row per k-step of 4*LANES words, split into 4 [8, LANES] tensors (one
    word per lane and row), so each row's dot product is one FFMA chain per lane over its
    4 words and all positions, and the x inputs and row-inner scale tiles it needs land in
    the same lanes (no shared memory, no barrier, no shuffle in the loop). Scale and bias
    are applied per lane (acc += p*s + b*sum(x)); the lanes are summed once after the
    loop, across warps through shared memory: WARPS > 1 splits K inside the program,
    without the partials and ticket round trip of SPLIT_K. With PREFETCH the
    loop runs two k-steps per iteration, each step's words loaded one step ahead (two
    register buffers, no copies).
    Program (m, pid_n, pid_k) covers rows [pid_n*BLOCK_N, +BLOCK_N) and k-steps
    [pid_k*KB_PER_SPLIT, +KB_PER_SPLIT); m is the fastest grid axis, so the programs of
    several rows of x read the same weights back to back (from L2).
    EVEN: N % BLOCK_N == 0 and whole k-steps in every split: no masks; KW: the words per
    row (stride_wn) as a constant, or 0.
    PDL (launched with programmatic dependent launch): the first k-step's words are
    loaded before waiting for the previous kernel (weights depend on no kernel); x, the
    partials and y only after. The next kernel is let in after the wait, not before: a
    trigger at entry lets every later kernel of the step launch at once (each one's
    programs trigger on arrival), and their waiting programs and early loads crowd the
    SMs (H100: 4096x4096 7.5 -> 7.8 us, 6144x4096 9.5 -> 12.5 us).
    SILU (W = [gate; up], N/2 a multiple of 8): a tile's rows are gate rows and their up
    rows, N/2 further on (16 rows: 8 and 8; 8 rows: 4 and 4), and y[m, N/2] =
    silu(gate) * up, rounded as cuda_ops.silu_mul rounds the two products: no SiLU
    launch of its own.
    SEQ (16 rows): each k-step's first 8 rows, then its second 8 (_gemv_kstep).
    XVEC (fp4, bf16 x, K % 32 == 0): a k-step's x as 4 16-byte loads a lane (_gemv_xq),
    not 1-2 loads a position. QUADS (fp4, SILU in 8 rows, EVEN): the scales as two runs of 4 rows
    (_gemv_scale_quads).
    EARLY (not E4M3): each k-step's scales and biases are loaded with its words
    (the first step's before the PDL wait), not after its FMAs.
    HAS_BIAS (not SILU): bias_ptr [N] (y's dtype) is added to the fp32 sums before the one
    rounding to y's dtype, by split 0 (split-K sums it with the other partials): no add
    kernel after the GEMV (q/k/v/o biases: gpt-oss, Qwen2).
    """
    tl.static_assert(BLOCK_N == 8 or BLOCK_N == 16)
    HALVES: tl.constexpr = BLOCK_N // 8
    LANES: tl.constexpr = 32 * WARPS
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    TWO: tl.constexpr = WPG < 4  # nvfp4: a lane's words 0,1 and 2,3 are in two groups
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    KG = K // G
    if KW > 0:
        swn = KW
    else:
        swn = stride_wn
    if SILU and HALVES == 2:
        rn = pid_n * 8 + tl.arange(0, 8)
        rn_h = rn + N // 2
    elif SILU:
        r8 = tl.arange(0, 8)
        rn = pid_n * 4 + r8 % 4 + (r8 // 4) * (N // 2)
        rn_h = rn  # unused
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, 8)
        rn_h = rn + 8
    n_mask = rn < N
    n_mask_h = rn_h < N
    rkw = tl.arange(0, 4 * LANES)
    lane = tl.arange(0, LANES)
    s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
    s_row_h = (rn_h // 8) * (KG * 8) + (rn_h % 8)
    x_pair0, g_pair, g_a, g_b = _gemv_lanes(lane, G, WPG, TWO)
    x_base = x_ptr + m * stride_xm
    kb0 = pid_k * KB_PER_SPLIT
    # XVEC: fp4 with bf16 x and no masks
    # QUADS: fp4 SiLU 8-row tiles, no masks (_gemv_scale_quads)
    QD: tl.constexpr = QUADS and SILU and HALVES == 1 and (MODE == 1 or MODE == 2) and EVEN
    XV: tl.constexpr = XVEC and (MODE == 1 or MODE == 2) and x_ptr.dtype.element_ty == tl.bfloat16
    acc, acc_h = _gemv_ksteps(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw, kb0, swn, x_base, x_pair0,
                              g_pair, g_a, g_b, s_row, s_row_h, s_ptr, b_ptr, KG, MODE, BITS, G,
                              HALVES, EVEN, LANES, KB_PER_SPLIT, PREFETCH, PDL,
                              SEQ, EARLY, XV, QD)  # fmt: skip
    out = _gemv_sum(acc, MODE)  # [8]
    tile = m * tl.num_programs(1) + pid_n
    if SILU and HALVES == 2:
        out_h = _gemv_sum(acc_h, MODE)
        _silu_epilogue(out, out_h, y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr, rn,
                       rn_h, N, M * N, tile, pid_k, SPLIT_K)  # fmt: skip
    elif SILU:
        g, u = tl.split(tl.trans(tl.reshape(out, [2, 4])))  # rows 0-3 gate, 4-7 up
        rg = pid_n * 4 + tl.arange(0, 4)
        _silu_epilogue(g, u, y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr, rg,
                       rg + N // 2, N, M * N, tile, pid_k, SPLIT_K)  # fmt: skip
    else:
        if HALVES == 2:
            out_h = _gemv_sum(acc_h, MODE)
            out = tl.reshape(tl.trans(tl.join(out, out_h)), [16])
        rn_all = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:  # split 0's partial only (a mask, not a branch)
            bmask = (rn_all < N) & (tl.full([BLOCK_N], pid_k, tl.int32) == 0)
            out = out + tl.load(bias_ptr + rn_all, mask=bmask, other=0.0).to(tl.float32)
        _splitk_epilogue(out[None, :], y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr,
                         tl.arange(0, 1), rn_all, 1, N, 0, M * N, tile, pid_k,
                         SPLIT_K)  # fmt: skip
