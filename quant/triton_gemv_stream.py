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

from .triton_gemv import _gemv_lanes, _gemv_step, _gemv_sum, _load_step, _silu_store
from .triton_launch import tl, tlc, triton


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
):
    """y[m, N] = x[m, K] @ W^T: program (m, pid) computes row tiles pid, pid + P, ...
    (P = programs along axis 1) of BLOCK_N = 8 or 16 rows, KSTEPS k-steps of 4*32*WARPS
    words each (KW words a row, all of it: no split-K), the lanes laid out as in
    _gemv_kernel. One step's words are in flight while the previous one computes, across
    tiles too: the last k-step of a tile computes while the first of the program's next
    tile loads (past the last tile, the last one again: in bounds, never used).
    SILU: W = [gate; up] and y[m, N/2] = silu(gate) * up, as _gemv_kernel's epilogue."""
    tl.static_assert(BLOCK_N == 8 or BLOCK_N == 16)
    HALVES: tl.constexpr = BLOCK_N // 8
    LANES: tl.constexpr = 32 * WARPS
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    TWO: tl.constexpr = WPG < 4
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
    wa = _load_step(w_ptr, rn, n_mask, rkw, 0, KW, True, MODE, LANES)
    wa_h = wa
    if HALVES == 2:
        wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, 0, KW, True, MODE, LANES)
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
                wb = _load_step(w_ptr, rn, n_mask, rkw, s + 1, KW, True, MODE, LANES)
                wb_h = wb
                if HALVES == 2:
                    wb_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, s + 1, KW, True, MODE, LANES)
            else:
                wb = _load_step(w_ptr, rn_n, n_mask, rkw, 0, KW, True, MODE, LANES)
                wb_h = wb
                if HALVES == 2:
                    wb_h = _load_step(w_ptr, rn_hn, n_mask_h, rkw, 0, KW, True, MODE, LANES)
            acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, s, x_base, x_pair0, g_pair, g_a, g_b,
                                    s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG, MODE,
                                    BITS, G, HALVES, True, LANES)  # fmt: skip
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
