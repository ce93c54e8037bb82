"""One k-step of the CUDA-core GEMV (triton_gemv.py): a step's word loads (_load_step;
_load_early with its scales), the words split into lanes (_gemv_words), the decode-and-FMA
chains over a step's positions (_gemv_positions for 8 or 16 rows, _gemv_half for 8; a
position by _gemv_fma; E4M3 by _gemv_fp8), the scales applied per lane (_gemv_scales,
_gemv_scaled, _gemv_apply), and the step itself (_gemv_step; _gemv_kstep with SEQ;
_gemv_one_step with EARLY's scales). triton_gemv.py runs them in its k-loop; the packed MoE,
joined down, 8-bit stream and K-quant lane GEMVs take them too. The code decode and x loads
they use are in triton_decode.py.

Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

from .triton_decode import (
    _decode_pos,
    _gemv_scale,
    _gemv_scale_quads,
    _gemv_x4,
    _gemv_x4v,
    _gemv_xq,
    _gemv_xsum,
)
from .triton_launch import tl, triton


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
def _gemv_scales_of(kb, s_ptr, b_ptr, s_row, n_mask, g_a, KG, MODE: tl.constexpr,
                    G: tl.constexpr, BITS: tl.constexpr, EVEN: tl.constexpr,
                    LANES: tl.constexpr):  # fmt: skip
    """The scales and biases [8, LANES] of k-step kb's groups g_a of this lane."""
    NG: tl.constexpr = 4 * LANES // (G // (32 // BITS))  # groups per k-step
    g_idx = kb * NG + g_a
    smask = n_mask[:, None] & (g_idx < KG)[None, :]
    return _gemv_scale(s_ptr, b_ptr, s_row[:, None] + g_idx[None, :] * 8, smask, MODE, EVEN)


@triton.jit
def _gemv_scales(kb, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, KG, MODE: tl.constexpr,
                 G: tl.constexpr, BITS: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr,
                 QUADS: tl.constexpr = False):  # fmt: skip
    """(scale, bias) [8, LANES] of k-step kb for this lane's words of rows s_row. nvfp4 (a
    lane's words 0, 1 and 2, 3 in two groups, g_a and g_b): the bias slot holds the scale of
    words 2, 3. QUADS (fp4, EVEN): s_row is a SiLU tile's (_gemv_scale_quads)."""
    TWO: tl.constexpr = G // (32 // BITS) < 4
    if QUADS:
        NG: tl.constexpr = 4 * LANES // (G // (32 // BITS))  # groups per k-step
        scale = _gemv_scale_quads(s_ptr, s_row, kb * NG + g_a, MODE, LANES)
        bias = scale
        if TWO:
            bias = _gemv_scale_quads(s_ptr, s_row, kb * NG + g_b, MODE, LANES)
    else:
        scale, bias = _gemv_scales_of(kb, s_ptr, b_ptr, s_row, n_mask, g_a, KG, MODE, G, BITS,
                                      EVEN, LANES)  # fmt: skip
        if TWO:
            bias, _ = _gemv_scales_of(kb, s_ptr, b_ptr, s_row, n_mask, g_b, KG, MODE, G, BITS,
                                      EVEN, LANES)  # fmt: skip
    return scale, bias


@triton.jit
def _gemv_scaled(acc, p, pb, xsum, scale, bias, MODE: tl.constexpr, G: tl.constexpr,
                 BITS: tl.constexpr):  # fmt: skip
    """acc [8, LANES] + p * scale (+ bias * xsum; nvfp4: + pb * bias, words 2, 3 times their
    own group's scale, _gemv_scales)."""
    if MODE == 0:
        acc = acc + p * scale + bias * xsum[None, :]
    elif G // (32 // BITS) < 4:
        acc = acc + p * scale + pb * bias
    else:
        acc = acc + p * scale
    return acc


@triton.jit
def _gemv_apply(acc, p, pb, xsum, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, kb, KG,
                MODE: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                EVEN: tl.constexpr, LANES: tl.constexpr,
                QUADS: tl.constexpr = False):  # fmt: skip
    """acc [8, LANES] += p * scale (+ bias * xsum) with the scales of this lane's groups.
    QUADS (fp4, EVEN): s_row is a SiLU tile's (_gemv_scale_quads)."""
    scale, bias = _gemv_scales(kb, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, KG, MODE, G, BITS,
                               EVEN, LANES, QUADS)  # fmt: skip
    return _gemv_scaled(acc, p, pb, xsum, scale, bias, MODE, G, BITS)


@triton.jit
def _step_x(kb, x_pair0, g_pair, KG, G: tl.constexpr, BITS: tl.constexpr, LANES: tl.constexpr):
    """k-step kb's x offsets xo (in input pairs) and masks xmask [LANES, 2] of this lane's
    pairs at position 0 (x_pair0, g_pair: _gemv_lanes'; KG: the groups of a row of x)."""
    NG: tl.constexpr = 4 * LANES // (G // (32 // BITS))  # groups per k-step
    xo = x_pair0 + kb * (NG * G // 2)
    xmask = (kb * NG + g_pair) < KG
    return xo, xmask


@triton.jit
def _gemv_xqs(x_base, xo, xmask, EVEN: tl.constexpr, XVEC: tl.constexpr):
    """XVEC: the k-step's x, 4 16-byte loads a lane (_gemv_xq); else xo, for _gemv_x4v to
    load x a position at a time."""
    xv0, xv1, xv2, xv3 = xo, xo, xo, xo
    if XVEC:
        xv0, xv1, xv2, xv3 = (_gemv_xq(x_base, xo, xmask, 0, EVEN),
                              _gemv_xq(x_base, xo, xmask, 1, EVEN),
                              _gemv_xq(x_base, xo, xmask, 2, EVEN),
                              _gemv_xq(x_base, xo, xmask, 3, EVEN))  # fmt: skip
    return xv0, xv1, xv2, xv3


@triton.jit
def _gemv_x67(x_base, xo, xmask, MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
              EVEN: tl.constexpr):  # fmt: skip
    """Affine int4's inputs for positions 6 and 7 read by shifts alone (w >> 24 = q6 + 16*q7,
    w >> 28 = q7): y = x6, z = x7 - 16*x6, and their part of the lane's input sum (* 2^-49)."""
    WPG: tl.constexpr = G // (32 // BITS)
    y0, y1, y2, y3 = _gemv_x4(x_base, xo + 6 * (WPG // 2), xmask, 6, MODE, BITS, EVEN)
    z0, z1, z2, z3 = _gemv_x4(x_base, xo + 7 * (WPG // 2), xmask, 7, MODE, BITS, EVEN)
    ysum = (y0 + y1 + y2 + y3 + z0 + z1 + z2 + z3) * 1.401298464324817e-45
    z0 = z0 - 16.0 * y0
    z1 = z1 - 16.0 * y1
    z2 = z2 - 16.0 * y2
    z3 = z3 - 16.0 * y3
    return y0, y1, y2, y3, z0, z1, z2, z3, ysum


@triton.jit
def _gemv_positions(w0, w1, w2, w3, v0, v1, v2, v3, x_base, xo, xmask, MODE: tl.constexpr,
                    BITS: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                    LANES: tl.constexpr, HALVES: tl.constexpr,
                    XVEC: tl.constexpr = False):  # fmt: skip
    """(p, pb, q, qb, xsum): every position of the words w0..w3 [8, LANES] of 8 rows (and of
    v0..v3, the next 8 rows' sharing the x inputs, when HALVES == 2: both halves a position
    at a time) times this lane's x (xo, xmask: _step_x); nvfp4: words 2, 3 in pb, qb. Not
    for E4M3 (_gemv_fp8)."""
    EPW: tl.constexpr = 32 // BITS
    TWO: tl.constexpr = G // EPW < 4  # nvfp4: a lane's words 0,1 and 2,3 are in two groups
    TRICK: tl.constexpr = MODE == 0 and BITS == 4  # positions 6, 7 by shifts alone
    NPOS: tl.constexpr = EPW - 2 if TRICK else EPW
    p = tl.zeros([8, LANES], dtype=tl.float32)
    pb = tl.zeros([8, LANES], dtype=tl.float32)
    q = tl.zeros([8, LANES], dtype=tl.float32)
    qb = tl.zeros([8, LANES], dtype=tl.float32)
    xsum = tl.zeros([LANES], dtype=tl.float32)  # sum of the lane's inputs * 2^-49
    xv0, xv1, xv2, xv3 = _gemv_xqs(x_base, xo, xmask, EVEN, XVEC)
    for i in tl.static_range(NPOS):
        x0, x1, x2, x3 = _gemv_x4v(xv0, xv1, xv2, xv3, x_base, xo, xmask, i, MODE, BITS, G,
                                   EVEN, XVEC)  # fmt: skip
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, x0, x1, x2, x3, i, MODE, BITS, TWO)
        if HALVES == 2:
            q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, x0, x1, x2, x3, i, MODE, BITS, TWO)
        if MODE == 0:
            xsum += _gemv_xsum(x0, x1, x2, x3, i, BITS)
    if TRICK:
        y0, y1, y2, y3, z0, z1, z2, z3, ysum = _gemv_x67(x_base, xo, xmask, MODE, BITS, G, EVEN)
        xsum += ysum
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, y0, y1, y2, y3, 6, MODE, BITS, TWO)
        p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, z0, z1, z2, z3, 7, MODE, BITS, TWO)
        if HALVES == 2:
            q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, y0, y1, y2, y3, 6, MODE, BITS, TWO)
            q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, z0, z1, z2, z3, 7, MODE, BITS, TWO)
    return p, pb, q, qb, xsum


@triton.jit
def _gemv_half(w0, w1, w2, w3, x_base, xo, xmask, MODE: tl.constexpr, BITS: tl.constexpr,
               G: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr,
               XVEC: tl.constexpr = False):  # fmt: skip
    """(p, pb, xsum): _gemv_positions of one 8-row half (the same FFMA chains as both halves
    a position at a time, so the same sums); not for E4M3."""
    p, pb, _, _, xsum = _gemv_positions(w0, w1, w2, w3, w0, w1, w2, w3, x_base, xo, xmask,
                                        MODE, BITS, G, EVEN, LANES, 1, XVEC)  # fmt: skip
    return p, pb, xsum


@triton.jit
def _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, g_b, s_row, s_row_h,
               n_mask, n_mask_h, s_ptr, b_ptr, KG, MODE: tl.constexpr, BITS: tl.constexpr,
               G: tl.constexpr, HALVES: tl.constexpr, EVEN: tl.constexpr,
               LANES: tl.constexpr, XVEC: tl.constexpr = False,
               QUADS: tl.constexpr = False):  # fmt: skip
    """One k-step of _gemv_kernel for 8 rows (HALVES == 1) or 16 (wa_h, acc_h: rows 8..15,
    sharing the x inputs): acc [8, LANES] += this lane's 4 words of each row (wa [8,
    4*LANES]) times x, with the scales (and biases) of their groups."""
    xo, xmask = _step_x(kb, x_pair0, g_pair, KG, G, BITS, LANES)
    if MODE == 3:  # E4M3 bytes -> fp32 values by cvt (2 an instruction), x unscaled
        zero = tl.zeros([8, LANES], dtype=tl.float32)
        p = _gemv_fp8(zero, wa, x_base, xo, xmask, G, BITS, EVEN, LANES)
        q = zero
        if HALVES == 2:
            q = _gemv_fp8(zero, wa_h, x_base, xo, xmask, G, BITS, EVEN, LANES)
        pb, qb, xsum = zero, zero, tl.zeros([LANES], dtype=tl.float32)  # unused by E4M3
    else:
        w0, w1, w2, w3 = _gemv_words(wa, LANES)
        v0, v1, v2, v3 = w0, w1, w2, w3
        if HALVES == 2:
            v0, v1, v2, v3 = _gemv_words(wa_h, LANES)
        p, pb, q, qb, xsum = _gemv_positions(w0, w1, w2, w3, v0, v1, v2, v3, x_base, xo, xmask,
                                             MODE, BITS, G, EVEN, LANES, HALVES,
                                             XVEC)  # fmt: skip
    acc = _gemv_apply(acc, p, pb, xsum, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, kb, KG,
                      MODE, G, BITS, EVEN, LANES, QUADS)  # fmt: skip
    if HALVES == 2:
        acc_h = _gemv_apply(acc_h, q, qb, xsum, s_ptr, b_ptr, s_row_h, n_mask_h, g_a, g_b,
                            kb, KG, MODE, G, BITS, EVEN, LANES)  # fmt: skip
    return acc, acc_h


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
        xo, xmask = _step_x(kb, x_pair0, g_pair, KG, G, BITS, LANES)
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
def _load_early(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw, kb, swn, s_ptr, b_ptr, s_row, s_row_h,
                g_a, g_b, KG, MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                HALVES: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """k-step kb's words, scales and biases of both halves (the second half's = the first's
    when HALVES == 1), for EARLY; nvfp4: the bias slots hold the scales of words 2, 3
    (_gemv_scales)."""
    wa = _load_step(w_ptr, rn, n_mask, rkw, kb, swn, EVEN, MODE, LANES)
    sa, ba = _gemv_scales(kb, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, KG, MODE, G, BITS, EVEN,
                          LANES)  # fmt: skip
    wa_h = wa
    sh = sa
    bh = ba
    if HALVES == 2:
        wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb, swn, EVEN, MODE, LANES)
        sh, bh = _gemv_scales(kb, s_ptr, b_ptr, s_row_h, n_mask_h, g_a, g_b, KG, MODE, G, BITS,
                              EVEN, LANES)  # fmt: skip
    return wa, wa_h, sa, ba, sh, bh


@triton.jit
def _gemv_one_step(acc, acc_h, wa, wa_h, sa, ba, sh, bh, kb, x_base, x_pair0, g_pair, KG,
                   MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                   HALVES: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr,
                   XVEC: tl.constexpr = False):  # fmt: skip
    """_gemv_step with the scales sa, sh and biases ba, bh already loaded (nvfp4: ba, bh the
    scales of words 2, 3): the same sums (each half as _gemv_kstep's SEQ); not for E4M3."""
    xo, xmask = _step_x(kb, x_pair0, g_pair, KG, G, BITS, LANES)
    w0, w1, w2, w3 = _gemv_words(wa, LANES)
    p, pb, xsum = _gemv_half(w0, w1, w2, w3, x_base, xo, xmask, MODE, BITS, G, EVEN, LANES,
                             XVEC)  # fmt: skip
    acc = _gemv_scaled(acc, p, pb, xsum, sa, ba, MODE, G, BITS)
    if HALVES == 2:
        v0, v1, v2, v3 = _gemv_words(wa_h, LANES)
        q, qb, _ = _gemv_half(v0, v1, v2, v3, x_base, xo, xmask, MODE, BITS, G, EVEN, LANES,
                              XVEC)  # fmt: skip
        acc_h = _gemv_scaled(acc_h, q, qb, xsum, sh, bh, MODE, G, BITS)
    return acc, acc_h
