"""The K-quant lane GEMV's decode (quant/kquant_lane.py's _lane_step calls it): per code
position, x's inputs scaled for the in-place masks (_lane_xpos; Q6_K's by _lane_x4) and the
high bits' FFMAs (_lane_hi_fma, Q5_K and Q6_K); and Q6_K's codes as 6-bit byte fields
(_q6_step_bytes: _q6_bytes from the stored high words, _q6_bytes_spread from the spread ones
of quant/kquant_layout.py's hi_shifts). Apart from the loads and the loop because it is
arithmetic on words already in registers, one function a position or a code format.
"""

from __future__ import annotations

import os

from mlxrun.quant import triton_gemv as tg
from mlxrun.quant import triton_kernels as tk

triton = tk.triton
tl = tk.tl

if triton is not None:
    # inline PTX (_opaque) on the GPU only: the interpreter runs no PTX
    OPAQUE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

    @triton.jit
    def _lane_hi_fma(p, pb, h0, h1, h2, h3, x0, x1, x2, x3, I: tl.constexpr, KIND: tl.constexpr):
        """p (pb: words 2, 3 for Q6_K) += the high bits of position I times 16 * x: the bits
        masked in place are the float h * 2^(HB*I - 149); x (from _gemv_x4, times
        2^(100-SH)) is scaled to 16 * x * 2^(100 - HB*I), so the products carry 2^-49 as the
        low nibbles' do."""
        HB: tl.constexpr = KIND
        if I < 6:
            SH: tl.constexpr = 4 * I
        else:
            SH: tl.constexpr = 0
        C: tl.constexpr = float(2 ** (4 + SH - HB * I))
        M: tl.constexpr = ((1 << HB) - 1) << (HB * I)
        f0 = (h0 & M).to(tl.float32, bitcast=True)
        f1 = (h1 & M).to(tl.float32, bitcast=True)
        f2 = (h2 & M).to(tl.float32, bitcast=True)
        f3 = (h3 & M).to(tl.float32, bitcast=True)
        if KIND == 2:
            p = p + f0 * (x0 * C)[None, :] + f1 * (x1 * C)[None, :]
            pb = pb + f2 * (x2 * C)[None, :] + f3 * (x3 * C)[None, :]
        else:
            p = p + f0 * (x0 * C)[None, :] + f1 * (x1 * C)[None, :] + f2 * (x2 * C)[None, :]
            p = p + f3 * (x3 * C)[None, :]
        return p, pb

    @triton.jit
    def _lane_x4(x_ptr, xo, mask, I: tl.constexpr, EVEN: tl.constexpr, SH: tl.constexpr):
        """Q6_K's inputs of position I for a lane's 4 words, as tg._gemv_x4 returns them
        (x0..x3 [LANES] fp32, times 2^(100-SH)): xo [LANES] is the offset, in input pairs, of
        the pair of words 0, 1 (sub-block 2l); words 2, 3 read the pair 8 further (sub-block
        2l+1). Two 1-D loads instead of one [LANES, 2]: the two pairs are not adjacent, so
        Triton gives a [LANES, 2] offset tensor a layout of 2 threads a lane and converts
        every load to the lane layout (8 conversions a k-step: shuffles on one warp, shared
        memory and 2 barriers each on several). SH: the caller's (4I for positions 0-5,
        0 for 6, 7; _q6_step_bytes: its byte field's)."""
        if x_ptr.dtype.element_ty == tl.bfloat16:
            p32 = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
            if EVEN:
                va = tl.load(p32 + xo)
                vb = tl.load(p32 + xo + 8)
            else:
                va = tl.load(p32 + xo, mask=mask, other=0)
                vb = tl.load(p32 + xo + 8, mask=mask, other=0)
            E: tl.constexpr = (100 - SH) << 23  # added to the exponent field (tg._gemv_x4)
            x0 = ((va << 16) + E).to(tl.float32, bitcast=True)
            x1 = ((va & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
            x2 = ((vb << 16) + E).to(tl.float32, bitcast=True)
            x3 = ((vb & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
        else:
            C: tl.constexpr = 1.2676506002282294e30 / (1 << SH)
            e = x_ptr + 2 * xo
            if EVEN:
                x0 = tl.load(e).to(tl.float32) * C
                x1 = tl.load(e + 1).to(tl.float32) * C
                x2 = tl.load(e + 16).to(tl.float32) * C
                x3 = tl.load(e + 17).to(tl.float32) * C
            else:
                x0 = tl.load(e, mask=mask, other=0.0).to(tl.float32) * C
                x1 = tl.load(e + 1, mask=mask, other=0.0).to(tl.float32) * C
                x2 = tl.load(e + 16, mask=mask, other=0.0).to(tl.float32) * C
                x3 = tl.load(e + 17, mask=mask, other=0.0).to(tl.float32) * C
        return x0, x1, x2, x3

    @triton.jit
    def _q6_bytes(w, h):
        """Q6_K's 8 codes of low word w (nibble i at bits 4i) and its high bits h (field i at
        bits 2i; bits 16+ ignored) as byte fields: e holds position 2j's 6-bit code at bits
        8j..8j+5, o position 2j+1's. The high fields are spread to 4-bit spacing (field i at
        4i) in three shift-or-mask steps, then each half is one select against the nibbles."""
        x = h & 0xFFFF
        x = (x | (x << 8)) & 0x00FF00FF
        x = (x | (x << 4)) & 0x0F0F0F0F
        x = (x | (x << 2)) & 0x33333333
        e = (w & 0x0F0F0F0F) | ((x << 4) & 0xF0F0F0F0)
        o = ((w >> 4) & 0x0F0F0F0F) | (x & 0xF0F0F0F0)
        return e, o

    @triton.jit
    def _q6_bytes_spread(wa, wb, h):
        """_q6_bytes of a sub-block's two low words wa, wb from its high word h laid out
        spread (kquant_layout.hi_shifts): byte j of h holds wb's fields 2j+1, 2j at bits
        0-1, 2-3 and wa's at 4-5, 6-7, so each half's high bits are one shift and one mask
        away from their place (bits 4-5 of byte j): 3 instructions a half against
        _q6_bytes' 6 (the spreading) + 3."""
        e_a = _opaque((wa & 0x0F0F0F0F) | ((h >> 2) & 0x30303030))
        o_a = _opaque(((wa >> 4) & 0x0F0F0F0F) | (h & 0x30303030))
        e_b = _opaque((wb & 0x0F0F0F0F) | ((h << 2) & 0x30303030))
        o_b = _opaque(((wb >> 4) & 0x0F0F0F0F) | ((h << 4) & 0x30303030))
        return e_a, o_a, e_b, o_b

    @triton.jit
    def _opaque(v):
        """v through a move the compiler cannot see into (not under the interpreter): the
        byte fields stay whole words (sm_90 SASS under Triton 3.6, Q6_K one warp: 4.10 ->
        4.04 instructions a weight, sass_kquant.py --variant 3)."""
        if OPAQUE:
            v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.uint32,
                                          is_pure=True, pack=1)  # fmt: skip
        return v

    @triton.jit
    def _q6_field(e, o, I: tl.constexpr):
        """Position I's code from _q6_bytes as a float: code * 2^(8*(I//2) - 149) for the
        fields inside the mantissa (masked in place), code * 2^-149 for the top byte."""
        J: tl.constexpr = I // 2
        if I % 2 == 0:
            src = e
        else:
            src = o
        if J < 3:
            return (src & (0x3F << (8 * J))).to(tl.float32, bitcast=True)
        return (src >> 24).to(tl.float32, bitcast=True)

    @triton.jit
    def _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, I: tl.constexpr, EVEN: tl.constexpr):
        """_q6_step_bytes' position I: its 4 codes a row times their inputs (scaled by
        2^(100 - the field's shift)), and the inputs' sums times 2^-49."""
        if I // 2 < 3:
            SH: tl.constexpr = 8 * (I // 2)
        else:
            SH: tl.constexpr = 0
        C: tl.constexpr = 1.401298464324817e-45 * (1 << SH)  # undoes 2^(100-SH)
        e0, e1, e2, e3, o0, o1, o2, o3 = es
        x0, x1, x2, x3 = _lane_x4(x_base, xo + I, xmask, I, EVEN, SH)
        p = p + _q6_field(e0, o0, I) * x0[None, :] + _q6_field(e1, o1, I) * x1[None, :]
        pb = pb + _q6_field(e2, o2, I) * x2[None, :] + _q6_field(e3, o3, I) * x3[None, :]
        xs_a += (x0 + x1) * C
        xs_b += (x2 + x3) * C
        return p, pb, xs_a, xs_b

    @triton.jit
    def _q6_step_bytes(w0, w1, w2, w3, h0, h1, h2, h3, x_base, xo, xmask, EVEN: tl.constexpr,
                       LANES: tl.constexpr, SPREAD: tl.constexpr = False):  # fmt: skip
        """Q6_K's dots of a k-step with the codes decoded as byte fields (_q6_bytes): one mask
        (or shift) and one FFMA a code and row, against two of each for the nibble and the
        high bits apart. Returns p (words 0, 1), pb (words 2, 3) and the sums of their inputs,
        all times 2^-49 as kquant_lane._lane_step's. SPREAD: the high words laid out spread,
        h0 and h2 the two sub-blocks' (_q6_bytes_spread; h1, h3 unused)."""
        if SPREAD:
            e0, o0, e1, o1 = _q6_bytes_spread(w0, w1, h0)
            e2, o2, e3, o3 = _q6_bytes_spread(w2, w3, h2)
        else:
            e0, o0 = _q6_bytes(w0, h0)
            e1, o1 = _q6_bytes(w1, h1)
            e2, o2 = _q6_bytes(w2, h2)
            e3, o3 = _q6_bytes(w3, h3)
        p = tl.zeros([8, LANES], dtype=tl.float32)
        pb = tl.zeros([8, LANES], dtype=tl.float32)
        xs_a = tl.zeros([LANES], dtype=tl.float32)
        xs_b = tl.zeros([LANES], dtype=tl.float32)
        # one call a position: its shift is then a constant of the call (assigned in a
        # static_range loop it was not, and Triton 3.6 computed the sums' scale in fp64)
        es = (e0, e1, e2, e3, o0, o1, o2, o3)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 0, EVEN)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 1, EVEN)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 2, EVEN)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 3, EVEN)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 4, EVEN)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 5, EVEN)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 6, EVEN)
        p, pb, xs_a, xs_b = _q6_pos(p, pb, xs_a, xs_b, es, x_base, xo, xmask, 7, EVEN)
        return p, pb, xs_a, xs_b

    @triton.jit
    def _lane_xpos(x_base, xo, xmask, I: tl.constexpr, KIND: tl.constexpr,
                   EVEN: tl.constexpr):  # fmt: skip
        """x0..x3 of position I: _lane_x4 (Q6_K; xo [LANES]) or tg._gemv_x4 (xo [LANES, 2])."""
        if I < 6:
            SH: tl.constexpr = 4 * I
        else:
            SH: tl.constexpr = 0
        if KIND == 2:
            x0, x1, x2, x3 = _lane_x4(x_base, xo + I, xmask, I, EVEN, SH)
        else:
            x0, x1, x2, x3 = tg._gemv_x4(x_base, xo + I * 2, xmask, I, 0, 4, EVEN)
        return x0, x1, x2, x3
