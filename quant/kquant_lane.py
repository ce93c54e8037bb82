"""The GGUF K-quant GEMV (Q4_K, Q5_K, Q6_K): _kq_lane_gemv_kernel, its loads and its k-step.

It is the affine int4 GEMV's loop (quant/triton_gemv.py: lanes along K, one FFMA chain per
row and lane, split-K, PDL, the SiLU epilogue of a joint gate/up) reading the planes of
quant/kquant_layout.py's layout, plus the K-quants' high bits and sub-block scales; the
decode of each position's codes and inputs is quant/kquant_decode.py's. Apart from
quant/kquant_kernels.py's tile GEMM because it shares nothing with it but the layout.
"""

from __future__ import annotations

from mlxrun.quant import triton_gemv as tg
from mlxrun.quant import triton_kernels as tk

triton = tk.triton
tl = tk.tl
tlc = tk.tlc

if triton is not None:
    from mlxrun.quant.kquant_decode import _lane_hi_fma, _lane_xpos, _q6_step_bytes

    @triton.jit
    def _lane_hi(w_ptr, rn, n_mask, rkw, lane_s, kb, stride_w, KW, KS, KIND: tl.constexpr,
                 EVEN: tl.constexpr, LANES: tl.constexpr, V: tl.constexpr = 1):  # fmt: skip
        """The high-bit words of lane l's 32 weights of k-step kb, one per low word w, with
        word w's bits at bit HB*i for its position i (Q5_K: one word a sub-block of 32,
        shifted by 8w; Q6_K: one a sub-block of 16, words 0, 1 its two halves): 4 x [8,
        LANES] uint32. KS: sub-blocks a row; lane_s: the lanes, opaque to the contiguity
        analysis. V=1: each high word loaded once, built lanes-first (Q6_K: a lane's two as
        the last axis of a [LANES, 8, 2] tile; Q5_K: [LANES, 8]). V=0 (kept for A/B): loaded as
        _load_step loads the low words, each high word once per low word it serves, so that
        it lands in the low words' layout; Triton 3.6 instead gives that tile a layout of its
        own on 2 and 4 warps and converts it through shared memory every k-step."""
        PER: tl.constexpr = 4 if KIND == 1 else 2  # low words a high word serves
        if V >= 1 and KIND == 2:
            # built as [LANES, 8, 2] and permuted: Triton 3.6's coalescing orders the axes
            # by contiguity, ties to the first, so the lanes (not the rows) get the threads;
            # a [8, 2 * LANES] tile gets 4 words a thread and 16 threads along K, and every
            # FFMA chain is converted to that layout
            hw = kb * (LANES * 2) + (tl.arange(0, LANES) * 2)[:, None] + tl.arange(0, 2)[None, :]
            ptrs = w_ptr + rn[None, :, None] * stride_w + KW + hw[:, None, :]
            if EVEN:
                h = tl.load(ptrs)
            else:
                mask = n_mask[None, :, None] & (hw < KS)[:, None, :]  # one high word a sub-block
                h = tl.load(ptrs, mask=mask, other=0)
            h0, h2 = tl.split(tl.permute(h.to(tl.uint32, bitcast=True), (1, 0, 2)))
        elif V >= 1:
            # Q5_K: one high word a lane, [LANES, 8] at opaque lane offsets (lane_s: not
            # vectorized along the lanes), then transposed
            hw = kb * LANES + lane_s
            ptrs = w_ptr + rn[None, :] * stride_w + KW + hw[:, None]
            if EVEN:
                h = tl.load(ptrs)
            else:
                h = tl.load(ptrs, mask=n_mask[None, :] & (hw < KS)[:, None], other=0)
            h0 = tl.trans(h.to(tl.uint32, bitcast=True))
            h2 = h0
        else:
            hw = kb * (4 * LANES // PER) + rkw // PER
            ptrs = w_ptr + rn[:, None] * stride_w + KW + hw[None, :]
            if EVEN:
                h = tl.load(ptrs)
            else:
                mask = n_mask[:, None] & (hw < KS)[None, :]  # one high word a sub-block
                h = tl.load(ptrs, mask=mask, other=0)
            h0, h1, h2, h3 = tg._gemv_words(h, LANES)  # (copies: the loads of h1, h3 are dead)
        if KIND == 1:
            return h0, h0 >> 8, h0 >> 16, h0 >> 24
        else:
            return h0, h0 >> 16, h2, h2 >> 16

    @triton.jit
    def _lane_words(w_ptr, rn, n_mask, rkw, lane_s, kb, stride_w, KW, KS, KIND: tl.constexpr,
                    EVEN: tl.constexpr, LANES: tl.constexpr, V: tl.constexpr):  # fmt: skip
        """The words of k-step kb of rows rn for _lane_step: the low-nibble words [8, 4*LANES]
        (tg._load_step: its mask, k < row stride, reads the high words past K, never used: x
        is masked to 0 there) and the high words from _lane_hi (Q4_K: the low words again,
        unused)."""
        wa = tg._load_step(w_ptr, rn, n_mask, rkw, kb, stride_w, EVEN, 0, LANES)
        ha = wa
        if KIND != 0:
            ha = _lane_hi(w_ptr, rn, n_mask, rkw, lane_s, kb, stride_w, KW, KS, KIND, EVEN, LANES,
                          V)  # fmt: skip
        return wa, ha

    @triton.jit
    def _lane_scales(kb, lane, lane_s, rn, n_mask, s_ptr, b_ptr, KS, KIND: tl.constexpr,
                     LANES: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr = False):  # fmt: skip
        """The scales of k-step kb, [8, LANES] each: Q6_K the lane's two int8 sc as one
        uint16 (widened) and d of their super-block (fp32); Q4_K/Q5_K (sc, m) of its
        sub-block as one uint16 (widened) and (d, dmin) of its super-block as one word.
        EVEN (whole row tiles and k-steps): unmasked; sm_90 SASS (Triton 3.6), Q6_K spread on 2 warps: 1,034 -> 1,006 instructions a
        k-step, 163 -> 128 registers (the masks' predicates held per row and lane)."""
        if KIND == 2:
            # int8 sc of the lane's two sub-blocks of 16, d of their super-block
            s0 = (kb * LANES + lane) * 2  # the first of the two
            sbk = s0 // 16  # super-block (16 sub-blocks)
            s16 = s_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
            if V >= 1:
                # [LANES, 8] then transposed: the lanes get the threads (see _lane_hi)
                sp = s16 + rn[None, :] * (KS // 2) + (s0 // 2)[:, None]
                dp = b_ptr + rn[None, :] * (KS // 16) + sbk[:, None]
                if EVEN:
                    sab = tl.load(sp)
                    d = tl.load(dp)
                else:
                    smt = n_mask[None, :] & (s0 < KS)[:, None]
                    sab = tl.load(sp, mask=smt, other=0)
                    d = tl.load(dp, mask=smt, other=0.0)
                sab = tl.trans(sab).to(tl.uint32)
                d = tl.trans(d).to(tl.float32)
            else:
                sp = s16 + rn[:, None] * (KS // 2) + (s0 // 2)[None, :]
                dp = b_ptr + rn[:, None] * (KS // 16) + sbk[None, :]
                if EVEN:
                    sab = tl.load(sp)
                    d = tl.load(dp)
                else:
                    smask = n_mask[:, None] & (s0 < KS)[None, :]
                    sab = tl.load(sp, mask=smask, other=0)
                    d = tl.load(dp, mask=smask, other=0.0)
                sab = sab.to(tl.uint32)
                d = d.to(tl.float32)
            return sab, d
        else:
            # (sc, m) of the sub-block as one uint16, (d, dmin) of its super-block as one
            # word: 8 rows x 2 loads a lane per 256 weights
            sub_s = kb * LANES + lane_s
            s16 = s_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
            b32 = b_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
            if V >= 1:  # [LANES, 8] then transposed: the lanes get the threads (_lane_hi)
                sp = s16 + rn[None, :] * KS + sub_s[:, None]
                dp = b32 + rn[None, :] * (KS // 8) + (sub_s // 8)[:, None]
                if EVEN:
                    scm = tl.load(sp)
                    dd = tl.load(dp)
                else:
                    smt = n_mask[None, :] & (sub_s < KS)[:, None]
                    scm = tl.load(sp, mask=smt, other=0)
                    dd = tl.load(dp, mask=smt, other=0)
                scm = tl.trans(scm)
                dd = tl.trans(dd)
            else:
                sp = s16 + rn[:, None] * KS + sub_s[None, :]
                dp = b32 + rn[:, None] * (KS // 8) + (sub_s // 8)[None, :]
                if EVEN:
                    scm = tl.load(sp)
                    dd = tl.load(dp)
                else:
                    smask = n_mask[:, None] & (sub_s < KS)[None, :]
                    scm = tl.load(sp, mask=smask, other=0)
                    dd = tl.load(dp, mask=smask, other=0)
            return scm.to(tl.uint32), dd

    @triton.jit
    def _lane_step(acc, wa, ha, kb, x_base, x_pair0, lane, lane_s, rn, n_mask, s_ptr, b_ptr, KS,
                   KIND: tl.constexpr, EVEN: tl.constexpr, LANES: tl.constexpr,
                   V: tl.constexpr = 1, sc0=0, sc1=0, EARLY: tl.constexpr = False,
                   SCE: tl.constexpr = False):  # fmt: skip
        """One k-step of _kq_lane_gemv_kernel: acc [8, LANES] += lane l's 32 weights of each
        row (low nibbles: 4 words of wa [8, 4*LANES]; high bits: ha from _lane_hi) times x,
        with its sub-blocks' scales. The low-nibble plane is in the affine int4 order of
        groups of 32 (Q6_K: 16), so the decode, x loads and FFMA chains are
        triton_kernels' GEMV functions, unchanged. Q4_K, Q5_K: dot * d*sc - dmin*m * sum(x);
        Q6_K, per sub-block of 16: (dot - 32 sum(x)) * d*sc, x by kquant_decode._lane_x4, its
        two int8 sc as one uint16 load. Q4_K/Q5_K's scale offsets come from lane_s (the
        kernel's opaque copy of lane). EARLY: the scales are sc0, sc1 (_lane_scales), loaded by
        the caller before its PDL wait. SCE: the scales loaded without masks (_lane_scales'
        EVEN)."""
        TWO: tl.constexpr = KIND == 2  # Q6_K: words 0, 1 and 2, 3 are two sub-blocks
        w0, w1, w2, w3 = tg._gemv_words(wa, LANES)
        if KIND != 0:
            h0, h1, h2, h3 = ha
        p = tl.zeros([8, LANES], dtype=tl.float32)
        pb = tl.zeros([8, LANES], dtype=tl.float32)
        xo = x_pair0 + kb * (LANES * 16)  # 16 input pairs a lane
        if KIND == 2:
            xmask = (kb * LANES + lane) * 2 < KS  # sub-blocks 2l, 2l+1: both or neither
        else:
            sub = kb * LANES + lane
            xmask = (sub < KS)[:, None]
        if KIND == 2 and V >= 2:  # Q6_K's codes as byte fields (V 3: from spread high words)
            p, pb, xs_a, xs_b = _q6_step_bytes(w0, w1, w2, w3, h0, h1, h2, h3, x_base, xo, xmask,
                                               EVEN, LANES, V == 3)  # fmt: skip
        else:
            xs_a = tl.zeros([LANES], dtype=tl.float32)  # sums of the lane's inputs * 2^-49
            xs_b = tl.zeros([LANES], dtype=tl.float32)  # (words 2, 3 apart for Q6_K)
            for i in tl.static_range(6):
                x0, x1, x2, x3 = _lane_xpos(x_base, xo, xmask, i, KIND, EVEN)
                p, pb = tg._gemv_fma(p, pb, w0, w1, w2, w3, x0, x1, x2, x3, i, 0, 4, TWO)
                if KIND != 0:
                    p, pb = _lane_hi_fma(p, pb, h0, h1, h2, h3, x0, x1, x2, x3, i, KIND)
                xs_a += (x0 + x1) * (1.401298464324817e-45 * (1 << (4 * i)))  # undoes 2^(100-4i)
                xs_b += (x2 + x3) * (1.401298464324817e-45 * (1 << (4 * i)))
            # positions 6, 7 as the affine kernel reads them: w >> 24 = q6 + 16*q7 with x6, and
            # w >> 28 = q7 with x7 - 16*x6 (cancels the 16*q7 term)
            y0, y1, y2, y3 = _lane_xpos(x_base, xo, xmask, 6, KIND, EVEN)
            z0, z1, z2, z3 = _lane_xpos(x_base, xo, xmask, 7, KIND, EVEN)
            if KIND != 0:
                p, pb = _lane_hi_fma(p, pb, h0, h1, h2, h3, y0, y1, y2, y3, 6, KIND)
                p, pb = _lane_hi_fma(p, pb, h0, h1, h2, h3, z0, z1, z2, z3, 7, KIND)
            xs_a += (y0 + y1 + z0 + z1) * 1.401298464324817e-45
            xs_b += (y2 + y3 + z2 + z3) * 1.401298464324817e-45
            z0 = z0 - 16.0 * y0
            z1 = z1 - 16.0 * y1
            z2 = z2 - 16.0 * y2
            z3 = z3 - 16.0 * y3
            p, pb = tg._gemv_fma(p, pb, w0, w1, w2, w3, y0, y1, y2, y3, 6, 0, 4, TWO)
            p, pb = tg._gemv_fma(p, pb, w0, w1, w2, w3, z0, z1, z2, z3, 7, 0, 4, TWO)
        if not EARLY:  # else sc0, sc1: this step's, loaded by the caller
            sc0, sc1 = _lane_scales(kb, lane, lane_s, rn, n_mask, s_ptr, b_ptr, KS, KIND, LANES, V,
                                    SCE)  # fmt: skip
        if KIND == 2:
            sab = sc0
            d = sc1
            # two int8 sc as one uint16; int8 c + 128 into the mantissa of 2^23: exact
            sa = (((sab & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            sb = (((sab >> 8) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            acc = (
                acc + (p - 32.0 * xs_a[None, :]) * (d * sa) + (pb - 32.0 * xs_b[None, :]) * (d * sb)
            )
        else:
            scm = sc0
            dd = sc1
            d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = (dd >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            # 6-bit integers into the mantissa of 2^23: exact, no int->float conversion
            sc = ((scm & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            mn = ((scm >> 8) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            acc = acc + p * (d * sc) - (dmin * mn) * (xs_a + xs_b)[None, :]
        return acc

    @triton.jit
    def _lane_rows(pid_n, N, H: tl.constexpr, HALVES: tl.constexpr, SILU: tl.constexpr):
        """Rows of half H (8 rows) of tile pid_n of HALVES halves: with SILU (W = [gate; up])
        its rows 0-3 are gate rows, 4-7 their up rows."""
        r8 = tl.arange(0, 8)
        if SILU:
            return pid_n * (4 * HALVES) + 4 * H + r8 % 4 + (r8 // 4) * (N // 2)
        return pid_n * (8 * HALVES) + 8 * H + r8

    @triton.jit
    def _lane_out(acc, y_ptr, part_ptr, cnt_ptr, m, pid_n, pid_k, rn, M, N, stride_ym,
                  H: tl.constexpr, HALVES: tl.constexpr, SPLIT_K: tl.constexpr,
                  SILU: tl.constexpr):  # fmt: skip
        """Half H's rows summed over the lanes, written (split-K: through the partials; its
        ticket is that of 8-row tile HALVES * tile + H)."""
        out = tl.sum(acc, axis=1) * 562949953421312.0  # [8]: undo the decode's 2^-49
        tile = (m * tl.num_programs(1) + pid_n) * HALVES + H
        if SILU:
            g, u = tl.split(tl.trans(tl.reshape(out, [2, 4])))  # rows 0-3 gate, 4-7 up
            rg = pid_n * (4 * HALVES) + 4 * H + tl.arange(0, 4)
            tg._silu_epilogue(g, u, y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr, rg,
                              rg + N // 2, N, M * N, tile, pid_k, SPLIT_K)  # fmt: skip
        else:
            tk._splitk_epilogue(out[None, :], y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr,
                                tl.arange(0, 1), rn, 1, N, 0, M * N, tile, pid_k,
                                SPLIT_K)  # fmt: skip

    @triton.jit
    def _kq_lane_gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, KS, stride_xm, stride_ym,
        stride_w, KIND: tl.constexpr, SPLIT_K: tl.constexpr, KB_PER_SPLIT: tl.constexpr,
        EVEN: tl.constexpr, KW: tl.constexpr, SW: tl.constexpr = 0, PDL: tl.constexpr = False,
        SILU: tl.constexpr = False, WARPS: tl.constexpr = 1, PREFETCH: tl.constexpr = True,
        KSC: tl.constexpr = 0, V: tl.constexpr = 1, HALVES: tl.constexpr = 1,
        EARLY: tl.constexpr = False, SCE: tl.constexpr = False,
    ):  # fmt: skip
        """K-quant GEMV, y[m, N] = x[m, K] @ W^T for one row m of x, laid out as
        triton_kernels._gemv_kernel (read its docstring): 8 rows a program, WARPS warps,
        lane l taking 32 weights (4 low-nibble words, and for Q5_K / Q6_K their high bits)
        of every row per k-step of 128*WARPS words, one FFMA chain per row and lane, lanes
        summed once at the end; split-K programs (axis 2) summed by the last one; PDL;
        SILU (W = [gate; up]): rows 0-3 of a tile are gate rows, 4-7 their up rows, and
        y = silu(gate) * up. KS: sub-blocks a row; KW: low-nibble words a row (K/8);
        SW: the row stride in words as a constant (EVEN), or 0 (stride_w); KSC: KS as a
        constant, or 0. HALVES=2: 16 rows a program, two halves of 8 as above (_lane_rows)
        that share each k-step's x loads and decode (one code path, the compiler merges the
        two halves' identical x work); without PREFETCH only. EARLY (without PREFETCH): the
        first k-step's scales loaded with its words, before the PDL wait, as the int4
        GEMV's (else a program of one k-step ends on their DRAM round trip). SCE (EVEN
        only): the scales loaded without masks.
        The scale products d*sc and dmin*m are exact in fp32 (an 11-bit significand times
        a 6- or 8-bit integer)."""
        LANES: tl.constexpr = 32 * WARPS
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if SW > 0:
            swn = SW
        else:
            swn = stride_w
        if KSC > 0:  # KS as a constant: the scale rows at immediate offsets
            ksn = KSC
        else:
            ksn = KS
        rn = _lane_rows(pid_n, N, 0, HALVES, SILU)
        n_mask = rn < N
        rn1 = _lane_rows(pid_n, N, HALVES - 1, HALVES, SILU)  # rn where HALVES == 1 (unused)
        n_mask1 = rn1 < N
        rkw = tl.arange(0, 4 * LANES)
        lane = tl.arange(0, LANES)
        # Q4_K/Q5_K's scale offsets, opaque to Triton's contiguity analysis (times a runtime
        # 1): else it vectorizes their loads along the lanes, holds acc in that layout and
        # moves p into it through shared memory every k-step (sm_90 SASS, Q4_K on 4 warps: 4
        # BAR, 4 LDS, 3 STSM a k-step)
        lane_s = lane * (N > 0).to(tl.int32)
        if KIND == 2:  # x pairs (uint32 units) of sub-block 2l; 2l+1's are 8 further
            x_pair0 = lane * 16
        else:  # sub-block l of 32 inputs
            x_pair0 = (lane * 16)[:, None] + tl.arange(0, 2)[None, :]
        x_base = x_ptr + m * stride_xm
        acc = tl.zeros([8, LANES], dtype=tl.float32)
        acc1 = tl.zeros([8, LANES], dtype=tl.float32)
        kb0 = pid_k * KB_PER_SPLIT
        kb_last = kb0 + KB_PER_SPLIT - 1
        wa, ha = _lane_words(w_ptr, rn, n_mask, rkw, lane_s, kb0, swn, KW, ksn, KIND, EVEN, LANES,
                             V)  # fmt: skip
        if HALVES == 2:
            wa1, ha1 = _lane_words(w_ptr, rn1, n_mask1, rkw, lane_s, kb0, swn, KW, ksn, KIND, EVEN,
                                   LANES, V)  # fmt: skip
        sc0 = 0
        sc1 = 0
        sd0 = 0
        sd1 = 0
        if EARLY:
            sc0, sc1 = _lane_scales(kb0, lane, lane_s, rn, n_mask, s_ptr, b_ptr, ksn, KIND, LANES,
                                    V, SCE)  # fmt: skip
            if HALVES == 2:
                sd0, sd1 = _lane_scales(kb0, lane, lane_s, rn1, n_mask1, s_ptr, b_ptr, ksn, KIND,
                                        LANES, V, SCE)  # fmt: skip
        if PDL:  # the weights do not depend on the previous kernel; x does
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        if PREFETCH:
            tl.static_assert(HALVES == 1, "16 rows a program: without prefetch only")
            tl.static_assert(not EARLY, "the first step's scales early: without prefetch only")
            # two k-steps an iteration, each one's words loaded a step ahead (no register copies)
            for j in range(0, KB_PER_SPLIT // 2):
                kb = kb0 + 2 * j
                wb, hb = _lane_words(w_ptr, rn, n_mask, rkw, lane_s, kb + 1, swn, KW, ksn, KIND,
                                     EVEN, LANES, V)  # fmt: skip
                acc = _lane_step(acc, wa, ha, kb, x_base, x_pair0, lane, lane_s, rn, n_mask, s_ptr,
                                 b_ptr, ksn, KIND, EVEN, LANES, V, 0, 0, False, SCE)  # fmt: skip
                kn = tl.minimum(kb + 2, kb_last)  # past the last step: reload it, never used
                wa, ha = _lane_words(w_ptr, rn, n_mask, rkw, lane_s, kn, swn, KW, ksn, KIND, EVEN,
                                     LANES, V)  # fmt: skip
                acc = _lane_step(acc, wb, hb, kb + 1, x_base, x_pair0, lane, lane_s, rn, n_mask,
                                 s_ptr, b_ptr, ksn, KIND, EVEN, LANES, V, 0, 0, False, SCE)  # fmt: skip
            if KB_PER_SPLIT % 2 == 1:
                acc = _lane_step(acc, wa, ha, kb_last, x_base, x_pair0, lane, lane_s, rn, n_mask,
                                 s_ptr, b_ptr, ksn, KIND, EVEN, LANES, V, 0, 0, False, SCE)  # fmt: skip
        else:  # each step's words loaded in the step: fewer registers, more resident warps
            acc = _lane_step(acc, wa, ha, kb0, x_base, x_pair0, lane, lane_s, rn, n_mask, s_ptr,
                             b_ptr, ksn, KIND, EVEN, LANES, V, sc0, sc1, EARLY, SCE)  # fmt: skip
            if HALVES == 2:
                acc1 = _lane_step(acc1, wa1, ha1, kb0, x_base, x_pair0, lane, lane_s, rn1,
                                  n_mask1, s_ptr, b_ptr, ksn, KIND, EVEN, LANES, V, sd0, sd1,
                                  EARLY, SCE)  # fmt: skip
            for j in range(1, KB_PER_SPLIT):
                kb = kb0 + j
                wa, ha = _lane_words(w_ptr, rn, n_mask, rkw, lane_s, kb, swn, KW, ksn, KIND, EVEN,
                                     LANES, V)  # fmt: skip
                if HALVES == 2:  # both halves' words in flight before either computes
                    wa1, ha1 = _lane_words(w_ptr, rn1, n_mask1, rkw, lane_s, kb, swn, KW, ksn, KIND,
                                           EVEN, LANES, V)  # fmt: skip
                acc = _lane_step(acc, wa, ha, kb, x_base, x_pair0, lane, lane_s, rn, n_mask, s_ptr,
                                 b_ptr, ksn, KIND, EVEN, LANES, V, 0, 0, False, SCE)  # fmt: skip
                if HALVES == 2:
                    acc1 = _lane_step(acc1, wa1, ha1, kb, x_base, x_pair0, lane, lane_s, rn1,
                                      n_mask1, s_ptr, b_ptr, ksn, KIND, EVEN, LANES, V, 0, 0,
                                      False, SCE)  # fmt: skip
        _lane_out(acc, y_ptr, part_ptr, cnt_ptr, m, pid_n, pid_k, rn, M, N, stride_ym, 0, HALVES,
                  SPLIT_K, SILU)  # fmt: skip
        if HALVES == 2:
            _lane_out(acc1, y_ptr, part_ptr, cnt_ptr, m, pid_n, pid_k, rn1, M, N, stride_ym, 1,
                      HALVES, SPLIT_K, SILU)  # fmt: skip
