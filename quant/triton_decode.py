"""What the quantized kernels share about their codes and outputs: a format's scale and
code decode (_scale_code, _group_scale, _decode_pos, _gemv_x4, _gemv_xsum, _gemv_scale,
_e4m3_scales), the fp4 GEMV's x and scale loads (_gemv_xq, _gemv_x4v, _gemv_scale_quads) and
the split-K and SiLU epilogues (_split_sum, _splitk_epilogue, _silu_store,
_silu_epilogue). Used by the GEMV (triton_gemv.py), the GEMM (triton_gemm.py), the K-quant
and MoE kernels and backends/cuda_ops.py; the decoding tricks are described in
triton_kernels.py's docstring.

Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

import os

from .triton_launch import E2M1_PAIR_ON, GEMV4, GEMV4_LOADS, tl, triton

# nvfp4's E4M3 scales decoded by the hardware (cvt.rn.f16x2.e4m3x2, then f16 -> f32) where
# the GEMV is compiled (not the interpreter), and nvfp4's E2M1 positions 3 and 7 from one
# shared mask: the fp4 GEMV loads' defaults (MLXRUN_GEMV4_LOADS=0 keeps the bit decodes; the
# same values). H100 decode step, same process: nvfp4 2.4491 ms (x a k-step at a time, no
# cvt) -> 2.3748 (cvt) -> 2.2602 (cvt + shared mask). mxfp4 with the shared mask: +3.3%, so
# only MLXRUN_E2M1_PAIR=1 (with MLXRUN_GEMV4=new) gives it there
E2M1_PAIR = tl.constexpr(GEMV4 != "old" and E2M1_PAIR_ON)  # mxfp4 (MODE 1)
E2M1_PAIR_NV = tl.constexpr(GEMV4_LOADS or (GEMV4 != "old" and E2M1_PAIR_ON))  # nvfp4
E4M3_CVT = tl.constexpr(
    (GEMV4_LOADS or GEMV4 != "old") and os.environ.get("TRITON_INTERPRET", "0") != "1"
)


@triton.jit
def _scale_code(e, MODE: tl.constexpr):
    """An 8-bit scale code (uint32) as its fp32 value."""
    if MODE == 2:  # E4M3 code -> its value times 2^-120 as float bits, then exact
        bits = ((e & 0x7F) << 20) | ((e & 0x80) << 24)
        s = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36
    else:  # E8M0 code e -> 2^(e-127); e == 0 is the denormal 2^-127
        bits = tl.where(e == 0, 0x00400000, e << 23)
        s = bits.to(tl.float32, bitcast=True)
    return s


@triton.jit
def _group_scale(s_ptr, b_ptr, offs, mask, MODE: tl.constexpr):
    """Per-group scale and bias as fp32 [.., ..] (bias only in affine mode)."""
    if MODE == 0:
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        e = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.uint32)
        s = _scale_code(e, MODE)
        b = s  # unused outside affine mode
    return s, b


@triton.jit
def _decode_pos(w, I: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr):
    """Position I of the packed words w (uint32) -> fp32 f = value * 2^(SH-149) (affine),
    value * 2^-120 (E4M3) or value * 2^-126 (E2M1); SH = _pos_shift(I, MODE, BITS).

    Affine: a float bit pattern below 2^24 reads as pattern * 2^-149 (denormals and the
    exponent-1 binade are linear), so a code masked in place at bits SH..SH+BITS-1 <= 23
    *is* q * 2^(SH-149): one LOP3. A code that reaches bit 24 is read by a shift alone:
    w >> BITS*I (SH = 0) leaves the code plus the codes above it times 2^BITS: for the top
    position nothing is above; for 4-bit position 6 (w >> 24 = q6 + 16*q7) the kernel
    gives position 7 the input x7 - 16*x6, which cancels the 16*q7 term.
    """
    if MODE == 0:
        if BITS * I + BITS <= 24:
            f = (w & (((1 << BITS) - 1) << (BITS * I))).to(tl.float32, bitcast=True)
        else:
            f = (w >> (BITS * I)).to(tl.float32, bitcast=True)
    elif MODE == 3:  # E4M3: magnitude bits -> 20..26, sign -> 31: value * 2^-120
        t = w >> (8 * I)
        f = (((t << 20) & 0x07F00000) | ((t << 24) & 0x80000000)).to(tl.float32, bitcast=True)
    else:  # E2M1 in prepare's layout (_E2M1_BITS): magnitude -> 22..24, sign -> 31
        PAIR: tl.constexpr = E2M1_PAIR_NV if MODE == 2 else E2M1_PAIR
        if I == 3 and PAIR:  # m, e0 at 13, 14, e1 at 10, sign at 11: one multiply
            # adds three copies of the isolated bits (shifted by 9, 14, 20; no carries); the
            # mask is position 7's too (computed once): its bits 26-30 go past bit 31
            v = (w & 0x6C006C00) * ((1 << 9) + (1 << 14) + (1 << 20))
        elif I == 7 and PAIR:  # the same 16 bits higher, moved down to 19, 20, 22, 23:
            # position 3's bits land at 3..18 (distinct, so no carries), below the mask
            v = ((w & 0x6C006C00) >> 7) * (1 + (1 << 5) + (1 << 11))
        elif I == 3:  # a mask each (the default; MLXRUN_E2M1_PAIR=1 shares it)
            v = (w & 0x6C00) * ((1 << 9) + (1 << 14) + (1 << 20))
        elif I == 7:
            v = ((w >> 7) & 0x00D80000) * (1 + (1 << 5) + (1 << 11))
        elif I == 6:  # m, e0, e1 at 22..24, sign at 31: in place
            v = w
        else:  # positions 0-2 at 3*I, 4-5 at 16 + 3*(I-4): m, e0, e1 then sign 9 above
            v = w << (22 - 3 * I if I < 3 else 6 - 3 * (I - 4))
        f = (v & 0x81C00000).to(tl.float32, bitcast=True)
    return f


@triton.jit
def _gemv_x4(x_ptr, offs, mask, I: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
             EVEN: tl.constexpr):  # fmt: skip
    """Inputs of position I for a lane's 4 words: offs [32, 2] are the offsets, in pairs
    of inputs, of the lane's two word pairs. Returns x0..x3 [32] fp32, each x * 2^(100-SH)
    (the power of two that keeps x * decoded code normal; SH as in _decode_pos).

    bf16 inputs are loaded as uint32 pairs; bf16 -> fp32 * 2^(100-SH) is then one integer
    op per input: (v << 16) + E (one LEA) and (v & 0xFFFF0000) + E, E = (100-SH) << 23
    added to the exponent field (x == 0 becomes 2^(-27-SH): its products underflow to 0).
    """
    if MODE == 0 and BITS * I + BITS <= 24:
        SH: tl.constexpr = BITS * I
    else:
        SH: tl.constexpr = 0
    if x_ptr.dtype.element_ty == tl.bfloat16:
        p32 = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
        if EVEN:
            v = tl.load(p32 + offs)
        else:
            v = tl.load(p32 + offs, mask=mask, other=0)
        va, vb = tl.split(v)
        E: tl.constexpr = 0 if MODE == 3 else (100 - SH) << 23
        x0 = ((va << 16) + E).to(tl.float32, bitcast=True)
        x1 = ((va & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
        x2 = ((vb << 16) + E).to(tl.float32, bitcast=True)
        x3 = ((vb & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
    else:
        eo = offs[:, :, None] * 2 + tl.arange(0, 2)[None, None, :]  # [32, 2, 2] inputs
        if EVEN:
            xv = tl.load(x_ptr + eo)
        else:
            xv = tl.load(x_ptr + eo, mask=mask[:, :, None], other=0.0)
        if MODE != 3:
            xv = xv.to(tl.float32) * (1.2676506002282294e30 / (1 << SH))
        else:
            xv = xv.to(tl.float32)
        lo, hi = tl.split(xv)  # [32, 2]: first / second input of each pair
        x0, x2 = tl.split(lo)
        x1, x3 = tl.split(hi)
    return x0, x1, x2, x3


@triton.jit
def _gemv_xsum(x0, x1, x2, x3, I: tl.constexpr, BITS: tl.constexpr):
    """sum of 4 affine inputs of position I from _gemv_x4, times 2^-49 (undoes 2^(100-SH))."""
    if BITS * I + BITS <= 24:
        C: tl.constexpr = 1.401298464324817e-45 * (1 << (BITS * I))
    else:
        C: tl.constexpr = 1.401298464324817e-45
    return (x0 + x1 + x2 + x3) * C


@triton.jit
def _gemv_scale(s_ptr, b_ptr, offs, mask, MODE: tl.constexpr, EVEN: tl.constexpr):
    """Per-group scale and bias [8, 32] as fp32 (bias only in affine mode); GEMV copy of
    _group_scale without masks when EVEN (one vector of a scale tile's 8 rows a lane)."""
    if MODE == 0:
        if EVEN:
            s = tl.load(s_ptr + offs)
            b = tl.load(b_ptr + offs)
        else:
            s = tl.load(s_ptr + offs, mask=mask, other=0.0)
            b = tl.load(b_ptr + offs, mask=mask, other=0.0)
        if s_ptr.dtype.element_ty == tl.bfloat16:  # one shift or mask per value
            s = (s.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            b = (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            s = s.to(tl.float32)
            b = b.to(tl.float32)
    else:
        if EVEN:
            e8 = tl.load(s_ptr + offs)
        else:
            e8 = tl.load(s_ptr + offs, mask=mask, other=0)
        if MODE == 2 and E4M3_CVT:
            s = _e4m3_scales(e8)
        else:
            s = _scale_code(e8.to(tl.uint32), MODE)
        b = s  # unused outside affine mode
    return s, b


@triton.jit
def _gemv_xq(x_base, xo, xmask, Q: tl.constexpr, EVEN: tl.constexpr):
    """Pairs 4Q..4Q+3 of this lane's k-step of bf16 x (fp4: 32 inputs, 16 uint32 pairs from
    xo's first column on): one 16-byte load a lane, [LANES, 4] uint32. Not EVEN: a lane's
    32 inputs are all in K or all past it (K % 32 == 0, _gemv_constexprs), so its first
    group's mask (xmask [LANES, 2]) is the lane's: 0 past K."""
    base, _ = tl.split(xo)  # [LANES]: 16 * lane + the k-step's, for both fp4 formats
    offs = tl.multiple_of(base, 16)[:, None] + 4 * Q + tl.arange(0, 4)[None, :]
    ptrs = x_base.to(tl.pointer_type(tl.uint32), bitcast=True) + offs
    if EVEN:
        v = tl.load(ptrs)
    else:
        mk, _ = tl.split(xmask)
        v = tl.load(ptrs, mask=mk[:, None], other=0)
    return v


@triton.jit
def _gemv_xpick(v0, v1, v2, v3, J: tl.constexpr):
    """Pair J (0-15) of the lane's k-step from _gemv_xq's four loads: [LANES] uint32."""
    if J // 4 == 0:
        v = v0
    elif J // 4 == 1:
        v = v1
    elif J // 4 == 2:
        v = v2
    else:
        v = v3
    lo, hi = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))  # pairs 2e / 2e + 1 of the four
    t = hi if J % 2 == 1 else lo
    a, b = tl.split(t)
    return b if (J // 2) % 2 == 1 else a


@triton.jit
def _gemv_x4v(xv0, xv1, xv2, xv3, x_base, xo, xmask, I: tl.constexpr, MODE: tl.constexpr,
              BITS: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
              XVEC: tl.constexpr):  # fmt: skip
    """_gemv_x4 for position I: with XVEC (fp4, bf16 x) from the k-step's pairs
    loaded at once by _gemv_xq (pair c of the lane at J = c*G/2 (nvfp4) or c (mxfp4), plus
    I*WPG/2: 4 16-byte loads a lane a k-step, against 1 or 2 of 8 or 4 bytes a position at a
    64-byte lane stride, nvfp4's 16 loads a k-step), else loaded here."""
    if XVEC:
        WPG: tl.constexpr = G // 8
        C1: tl.constexpr = G // 2 if WPG < 4 else 1
        va = _gemv_xpick(xv0, xv1, xv2, xv3, I * (WPG // 2))
        vb = _gemv_xpick(xv0, xv1, xv2, xv3, C1 + I * (WPG // 2))
        E: tl.constexpr = 100 << 23  # x * 2^100 (SH = 0 for E2M1)
        x0 = ((va << 16) + E).to(tl.float32, bitcast=True)
        x1 = ((va & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
        x2 = ((vb << 16) + E).to(tl.float32, bitcast=True)
        x3 = ((vb & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
    else:
        WPG2: tl.constexpr = G // (32 // BITS)
        x0, x1, x2, x3 = _gemv_x4(x_base, xo + I * (WPG2 // 2), xmask, I, MODE, BITS, EVEN)
    return x0, x1, x2, x3


@triton.jit
def _gemv_scale_quads(s_ptr, s_row, g_idx, MODE: tl.constexpr, LANES: tl.constexpr):
    """The E8M0 / E4M3 scales [8, LANES] (fp32) of a SiLU 8-row tile (s_row: 4 gate rows,
    then their 4 up rows: two runs of 4 contiguous, 4-aligned scale bytes) for groups g_idx,
    loaded as two [4, LANES] runs a lane and joined: the 8 rows land in each lane's registers,
    as the partial sums are. One [8, LANES] load put 8 threads along the rows (the compiler
    cannot see the runs through the row arithmetic), and p, pb went through shared memory
    (2 barriers each) to meet it every k-step."""
    sg, su = tl.split(tl.trans(tl.reshape(s_row, [2, 4])))  # [4] gate rows, [4] up rows
    sg = tl.max_contiguous(tl.multiple_of(sg, 4), 4)
    su = tl.max_contiguous(tl.multiple_of(su, 4), 4)
    eg = tl.load(s_ptr + sg[:, None] + g_idx[None, :] * 8)  # [4, LANES] uint8
    eu = tl.load(s_ptr + su[:, None] + g_idx[None, :] * 8)
    e8 = tl.reshape(tl.permute(tl.join(eg, eu), [2, 0, 1]), [8, LANES])
    if MODE == 2 and E4M3_CVT:
        s = _e4m3_scales(e8)
    else:
        s = _scale_code(e8.to(tl.uint32), MODE)
    return s


# The 4 E4M3 bytes of a 32-bit register ($4) as 4 fp32 ($0-$3): two cvt.rn.f16x2.e4m3x2 and
# four exact f16 -> f32 conversions (sm_89+); the scale decode here and the 8-bit stream's
# weight decode (triton_gemv_stream._e4m3x4) both run it
E4M3X4_PTX = tl.constexpr("""{
        .reg .b16 lo, hi, h0, h1, h2, h3;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {h0, h1}, a;
        mov.b32 {h2, h3}, b;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $1, h1;
        cvt.f32.f16 $2, h2;
        cvt.f32.f16 $3, h3;
        }""")


@triton.jit
def _e4m3_scales(e):
    """E4M3 codes e (uint8) as fp32, four a call: two cvt.rn.f16x2.e4m3x2 and four exact
    f16 -> f32 conversions (every E4M3 value is an f16), against a shift, two masks and a
    multiply by 2^120 a code in _scale_code (nvfp4: 16 scales a lane a k-step)."""
    return tl.inline_asm_elementwise(
        asm=E4M3X4_PTX,
        constraints="=r,=r,=r,=r,r",
        args=[e],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _split_sum(acc, p_ptrs, mask, cnt_ptr, tile_id, pid_k, stride_split,
               SPLIT_K: tl.constexpr):  # fmt: skip
    """Split-K through the partials buffer: store this split's acc at p_ptrs (split s at
    + s*stride_split) and take the tile's atomic ticket. Returns (last, total): the last
    program of the tile gets the sum of every split's partial and resets the ticket to 0
    for the next launch (one launch, no memset); the others get (False, zeros)."""
    tl.store(p_ptrs + pid_k * stride_split, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is issued before the ticket is taken
    ticket = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(SPLIT_K):
            total += tl.load(p_ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")
    return last, total


@triton.jit
def _splitk_epilogue(
    acc,
    y_ptr,
    part_ptr,
    cnt_ptr,
    rm,
    rn,
    M,
    N,
    stride_ym,
    stride_split,
    tile_id,
    pid_k,
    SPLIT_K: tl.constexpr,
):
    """Write acc [BM, BN] to y, or, with split-K, through the partials buffer [S, M, N]
    (split s at part_ptr + s*stride_split), the last program of a tile writing the sum
    (_split_sum)."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = part_ptr + rm[:, None] * N + rn[None, :]
        last, total = _split_sum(acc, p_ptrs, mask, cnt_ptr, tile_id, pid_k, stride_split,
                                 SPLIT_K)  # fmt: skip
        if last:
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_store(g, u, y_ptrs, mask=None):
    """y = silu(g) * u, each product rounded to y's dtype first (as the GEMV's output is,
    and as F.silu rounds before the multiply)."""
    dt = y_ptrs.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptrs, (silu * u.to(dt).to(tl.float32)).to(dt), mask=mask)


@triton.jit
def _silu_epilogue(g, u, y_ptr, part_ptr, cnt_ptr, rn, rn_h, N, stride_split, tile_id,
                   pid_k, SPLIT_K: tl.constexpr):  # fmt: skip
    """_splitk_epilogue for SILU: gate rows rn and up rows rn_h of the partials; y's
    columns are the gate rows."""
    if SPLIT_K == 1:
        _silu_store(g, u, y_ptr + rn)
    else:
        rows = tl.join(rn, rn_h)  # [8 or 4, 2]
        last, total = _split_sum(tl.join(g, u), part_ptr + rows, rows < N, cnt_ptr,
                                 tile_id, pid_k, stride_split, SPLIT_K)  # fmt: skip
        if last:
            gt, ut = tl.split(total)
            _silu_store(gt, ut, y_ptr + rn)
