"""The CUDA-core GEMV for x [M <= GEMV_MAX_M, K] @ W^T over a QLinear (triton_layout.py): its
lane layout and k-loop (_gemv_lanes, _gemv_ksteps, _gemv_sum; also the packed MoE kernel's,
backends/cuda_moe_kernels.py, and the K-quant lane GEMV's) and the kernel. One k-step (its
loads, decode, FMA chains and scales) is in triton_gemv_step.py; the decode and epilogue
helpers it shares with the other kernels are in triton_decode.py (both re-exported here for
the modules that take them with the k-loop's). qmatmul in triton_kernels.py launches the
kernel.

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
from .triton_gemv_step import (  # noqa: F401 (_gemv_fma, _gemv_step, _gemv_words re-exported)
    _gemv_fma,
    _gemv_kstep,
    _gemv_one_step,
    _gemv_step,
    _gemv_words,
    _load_early,
    _load_step,
)
from .triton_launch import tl, tlc, triton


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
