"""A persistent form of the CUDA-core GEMV (triton_gemv.py) for the 8-bit formats: each
program streams row tiles pid, pid + P, ... (P programs, a few a SM) through the same
per-k-step code (_gemv_step), and the next tile's first words are loaded while the current
tile's last k-step computes, so a program always has weights in flight.

Why: with K = 4096 and 4 warps a program, the one-shot GEMV program is a single tile of two
k-steps: it issues its loads, waits, computes, and ends, and while it computes it has
nothing in flight. Its SM then relies on the other resident programs being in their load
phase. The 8-bit formats (1 byte a weight) reach ~82% of the copy bandwidth that way where
the bf16 GEMV (2 bytes a weight, half the compute a byte) reaches ~95%; a program that keeps
its next tile in flight overlaps the compute of one tile with the loads of the next.

Only whole tiles and k-steps (EVEN, no split-K); qmatmul falls back to the one-shot kernel
otherwise. Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

from .triton_decode import E4M3X4_PTX, _gemv_x4, _silu_store
from .triton_gemv import _gemv_lanes, _gemv_sum
from .triton_gemv_step import _gemv_apply, _gemv_step, _gemv_words, _load_step
from .triton_launch import tl, tlc, triton


@triton.jit
def _e4m3x4(w, ASM: tl.constexpr):
    """The 4 E4M3 codes of words w (uint32, code i at bits 8i..8i+7) as fp32. ASM (sm_89+):
    two cvt.rn.f16x2.e4m3x2 and four f16 -> f32 conversions a word, in PTX, so only the
    word's 4 values are live (the tile-wide conversion of _gemv_fp8 holds every decoded
    value of the k-step: 255 registers and spills at 16 rows on Triton 3.6); else (the
    interpreter) the same values through Triton's fp8 type."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            asm=E4M3X4_PTX,
            constraints="=r,=r,=r,=r,r",
            args=[w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        f0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f3 = (w >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return f0, f1, f2, f3


@triton.jit
def _fp8_words_fma(p, w, x0, x1, x2, x3, ASM: tl.constexpr):
    """p [8, LANES] += a word's 4 positions (w [8, LANES]) times their inputs x0..x3 [LANES]."""
    f0, f1, f2, f3 = _e4m3x4(w, ASM)
    return p + f0 * x0[None, :] + f1 * x1[None, :] + f2 * x2[None, :] + f3 * x3[None, :]


@triton.jit
def _fp8_half(acc, wa, xb0, xb1, xb2, xb3, kb, s_ptr, s_row, n_mask, g_a, KG,
              LANES: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """acc [8, LANES] += one k-step of 8 rows of mxfp8 words wa [8, 4*LANES], decoded a word
    at a time; xbP = position P's inputs of words 0..3."""
    w0, w1, w2, w3 = _gemv_words(wa, LANES)
    a0, a1, a2, a3 = xb0
    b0, b1, b2, b3 = xb1
    c0, c1, c2, c3 = xb2
    d0, d1, d2, d3 = xb3
    p = tl.zeros([8, LANES], dtype=tl.float32)
    p = _fp8_words_fma(p, w0, a0, b0, c0, d0, ASM)
    p = _fp8_words_fma(p, w1, a1, b1, c1, d1, ASM)
    p = _fp8_words_fma(p, w2, a2, b2, c2, d2, ASM)
    p = _fp8_words_fma(p, w3, a3, b3, c3, d3, ASM)
    xsum = tl.zeros([LANES], dtype=tl.float32)  # affine only
    return _gemv_apply(acc, p, p, xsum, s_ptr, s_ptr, s_row, n_mask, g_a, g_a, kb, KG, 3, 32,
                       8, True, LANES)  # fmt: skip


@triton.jit
def _fp8_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, s_row, s_row_h, n_mask,
              n_mask_h, s_ptr, KG, HALVES: tl.constexpr, LANES: tl.constexpr,
              ASM: tl.constexpr):  # fmt: skip
    """_gemv_step for mxfp8 with the words decoded one at a time (_e4m3x4)."""
    NG: tl.constexpr = 4 * LANES // 8  # groups of 32 (8 words) a k-step
    xo = x_pair0 + kb * (NG * 16)
    xmask = (kb * NG + g_pair) < KG
    xb0 = _gemv_x4(x_base, xo, xmask, 0, 3, 8, True)
    xb1 = _gemv_x4(x_base, xo + 4, xmask, 1, 3, 8, True)
    xb2 = _gemv_x4(x_base, xo + 8, xmask, 2, 3, 8, True)
    xb3 = _gemv_x4(x_base, xo + 12, xmask, 3, 3, 8, True)
    acc = _fp8_half(acc, wa, xb0, xb1, xb2, xb3, kb, s_ptr, s_row, n_mask, g_a, KG, LANES, ASM)
    if HALVES == 2:
        acc_h = _fp8_half(acc_h, wa_h, xb0, xb1, xb2, xb3, kb, s_ptr, s_row_h, n_mask_h, g_a,
                          KG, LANES, ASM)  # fmt: skip
    return acc, acc_h


@triton.jit
def _stream_rows(t, N, BLOCK_N: tl.constexpr, SILU: tl.constexpr):
    """Rows (rn, rn_h) [8] of tile t, as _gemv_kernel lays out its tile pid_n."""
    if SILU and BLOCK_N == 16:  # 8 gate rows and their 8 up rows
        rn = t * 8 + tl.arange(0, 8)
        rn_h = rn + N // 2
    elif SILU:  # 4 gate rows, then their 4 up rows
        r8 = tl.arange(0, 8)
        rn = t * 4 + r8 % 4 + (r8 // 4) * (N // 2)
        rn_h = rn
    else:
        rn = t * BLOCK_N + tl.arange(0, 8)
        rn_h = rn + 8
    return rn, rn_h


@triton.jit
def _gemv_stream_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_ym,
    MODE: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KSTEPS: tl.constexpr,
    KW: tl.constexpr,
    PDL: tl.constexpr = False,
    SILU: tl.constexpr = False,
    WARPS: tl.constexpr = 4,
    CVT: tl.constexpr = 0,
    AHEAD: tl.constexpr = False,
):
    """y[m, N] = x[m, K] @ W^T: program (m, pid) computes row tiles pid, pid + P, ...
    (P = programs along axis 1) of BLOCK_N = 8 or 16 rows, KSTEPS k-steps of 4*32*WARPS
    words each (KW words a row, all of it: no split-K), the lanes laid out as in
    _gemv_kernel. One step's words are in flight while the previous one computes, across
    tiles too: the last k-step of a tile computes while the first of the program's next
    tile loads (past the last tile, the last one again: in bounds, never used).
    SILU: W = [gate; up] and y[m, N/2] = silu(gate) * up, as _gemv_kernel's epilogue.
    CVT (mxfp8): 0 decodes a k-step's tile at once (_gemv_step); 1 a word at a time through
    Triton's fp8 type (the interpreter), 2 a word at a time in PTX (_e4m3x4).
    AHEAD: the next tile's loads in a branch (see there): issued before the last k-step's
    FMAs, as written. The same sums either way."""
    tl.static_assert(BLOCK_N == 8 or BLOCK_N == 16)
    HALVES: tl.constexpr = BLOCK_N // 8
    LANES: tl.constexpr = 32 * WARPS
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    TWO: tl.constexpr = WPG < 4
    LMODE: tl.constexpr = 0 if CVT > 0 else MODE  # words, or E4M3 bytes for _gemv_step
    m = tl.program_id(0)
    pid = tl.program_id(1)
    P = tl.num_programs(1)
    KG = K // G
    if SILU:
        tiles = (N // 2) // (BLOCK_N // 2)
    else:
        tiles = N // BLOCK_N
    rkw = tl.arange(0, 4 * LANES)
    lane = tl.arange(0, LANES)
    x_pair0, g_pair, g_a, g_b = _gemv_lanes(lane, G, WPG, TWO)
    x_base = x_ptr + m * stride_xm
    y_base = y_ptr + m * stride_ym
    rn, rn_h = _stream_rows(pid, N, BLOCK_N, SILU)
    n_mask = rn < N  # all true (whole tiles): _gemv_step takes them
    n_mask_h = rn_h < N
    wa = _load_step(w_ptr, rn, n_mask, rkw, 0, KW, True, LMODE, LANES)
    wa_h = wa
    if HALVES == 2:
        wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, 0, KW, True, LMODE, LANES)
    if PDL:  # the weights depend on no kernel; x does
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    for t in range(pid, tiles, P):
        rn, rn_h = _stream_rows(t, N, BLOCK_N, SILU)
        s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
        s_row_h = (rn_h // 8) * (KG * 8) + (rn_h % 8)
        rn_n, rn_hn = _stream_rows(tl.minimum(t + P, tiles - 1), N, BLOCK_N, SILU)
        acc = tl.zeros([8, LANES], dtype=tl.float32)
        acc_h = tl.zeros([8, LANES], dtype=tl.float32)
        for s in tl.static_range(KSTEPS):
            if s + 1 < KSTEPS:
                wb = _load_step(w_ptr, rn, n_mask, rkw, s + 1, KW, True, LMODE, LANES)
                wb_h = wb
                if HALVES == 2:
                    wb_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, s + 1, KW, True, LMODE, LANES)
            elif AHEAD:
                # The same loads under a run-time branch: ptxas (Triton 3.6, sm_90) sinks the
                # unconditional ones below the last k-step's FMAs and the scales' round trip,
                # so the next tile's words were only in flight during the reduction; in a
                # branch they stay where they are issued (SASS: int8 8 rows, K=4096, LDGs at
                # 751 of 838 -> 398 of 884, 80 -> 123 registers). 16 rows: 250 registers.
                # The H100 decode step was 10% slower with it (KERNEL_NOTES.md): off.
                if t + P < tiles:
                    wb = _load_step(w_ptr, rn_n, n_mask, rkw, 0, KW, True, LMODE, LANES)
                    wb_h = wb
                    if HALVES == 2:
                        wb_h = _load_step(w_ptr, rn_hn, n_mask_h, rkw, 0, KW, True, LMODE,
                                          LANES)  # fmt: skip
                else:  # no next tile: nothing to load
                    wb = wa
                    wb_h = wa_h
            else:
                wb = _load_step(w_ptr, rn_n, n_mask, rkw, 0, KW, True, LMODE, LANES)
                wb_h = wb
                if HALVES == 2:
                    wb_h = _load_step(w_ptr, rn_hn, n_mask_h, rkw, 0, KW, True, LMODE, LANES)
            if CVT > 0:
                acc, acc_h = _fp8_step(acc, acc_h, wa, wa_h, s, x_base, x_pair0, g_pair, g_a,
                                       s_row, s_row_h, n_mask, n_mask_h, s_ptr, KG, HALVES,
                                       LANES, CVT == 2)  # fmt: skip
            else:
                acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, s, x_base, x_pair0, g_pair, g_a,
                                        g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG,
                                        MODE, BITS, G, HALVES, True, LANES)  # fmt: skip
            wa = wb
            wa_h = wb_h
        out = _gemv_sum(acc, MODE)  # [8]
        if SILU and HALVES == 2:
            _silu_store(out, _gemv_sum(acc_h, MODE), y_base + rn)
        elif SILU:
            g, u = tl.split(tl.trans(tl.reshape(out, [2, 4])))  # rows 0-3 gate, 4-7 up
            _silu_store(g, u, y_base + t * 4 + tl.arange(0, 4))
        else:
            if HALVES == 2:
                out = tl.reshape(tl.trans(tl.join(out, _gemv_sum(acc_h, MODE))), [16])
            rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_base + rows, out.to(y_ptr.dtype.element_ty))
