"""The fp4 GEMVs (mxfp4, nvfp4) at batch 1 on tensor cores: y = x @ W^T for one row of x.

The CUDA-core GEMV (triton_gemv.py) spends ~4.4 SASS instructions a weight on fp4 (2.25 of
them the E2M1 decode to fp32, one FFMA) against int4's ~3: issue-bound. Here the codes are
decoded two a register to bf16 pairs (prepare's E2M1 layout: a prmt, then a shift and one
LOP3 give two k-adjacent codes as value * 2^-126, one packed multiply the values: ~1.75
instructions a weight), and the multiplies go to the tensor cores: the W tile [BLOCK_N, BK]
is the register operand of tl.dot (wgmma at 64 rows on 4 warps), x the other, in BM = 16
columns. SASS (sm_90, 64 rows, 4 warps, 128 inputs a k-step): 2.77 instructions a weight in
the loop for mxfp4, 2.84 for nvfp4. The decoded tile still takes a trip through shared
memory to the operand's register layout (8 STS.128 + 8 LDSM a k-step a thread).

x's columns carry the groups: column c of the x tile holds x only where an input's group g
has g % BM == c (zero elsewhere), so the dot's accumulator [BLOCK_N, BM] keeps BM groups'
partial sums apart, and the scales are applied once per BM groups (one FMA an accumulator
element: 1/G of an instruction a weight) instead of once per group on every weight.
Products and sums are exact fp32 as the tensor core forms them (bf16 x, E2M1 values, fp32
accumulation); only the summation order differs from the CUDA-core GEMV.

Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

from .triton_decode import _e4m3_scales, _scale_code, _silu_epilogue, _splitk_epilogue
from .triton_gemm import _gq_fma2, _gq_prmt, _gq_unpair
from .triton_launch import tl, tlc, triton


@triton.jit
def _tc_e2m1(r, B: tl.constexpr):
    """Position B (0-3) of the E2M1 codes in each half of r -> bf16 pairs = value * 2^-126
    (_gq_e2m1 with B a constant)."""
    if B == 3:  # m, e0 at 13, 14 -> 6, 7; e1 10 -> 8, s 11 -> 15
        v = ((r >> 7) & 0x00D800D8) * 0x821
    else:
        v = r << (6 - 3 * B)
    return v & -2118090304  # 0x81C081C0


@triton.jit
def _tc_decode(words, BLOCK_N: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr,
               ASM: tl.constexpr):  # fmt: skip
    """E2M1 words [BN, NG, WPG] (prepare's layout) -> the W tile [BN, NG*G] of the values in
    natural k order: bf16 (ASM) or fp32 holding the same values (interpreter). Two words 2j,
    2j+1 hold inputs i*WPG + 2j + {0, 1} at position i: one prmt puts positions 0-3 of both
    in one register (0x7632: 4-7), then a shift and a mask give a bf16 pair of k-adjacent
    inputs (the tensor-core operand's pairs)."""
    HW: tl.constexpr = WPG // 2
    wa, wb = tl.split(tl.reshape(words.to(tl.int32, bitcast=True), [BLOCK_N, NG, HW, 2]))
    r = tl.join(_gq_prmt(wa, wb, "0x5410", ASM), _gq_prmt(wa, wb, "0x7632", ASM))
    r = tl.permute(r, [0, 1, 3, 2])  # [BN, NG, 2 (positions 0-3 | 4-7), HW]
    # positions 0-3 of each half, each its own constexpr shift (a position index in a
    # tensor dimension leaves the shift and the select of position 3 to run time)
    p0 = _tc_e2m1(r, 0)
    p1 = _tc_e2m1(r, 1)
    p2 = _tc_e2m1(r, 2)
    p3 = _tc_e2m1(r, 3)
    m = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [BN, NG, 2, HW, 2 (c), 2 (d)]
    m = tl.permute(m, [0, 1, 2, 4, 5, 3])  # [BN, NG, 2, 2, 2 (position 2c + d), HW]
    m = tl.reshape(m, [BLOCK_N, NG, 2, 4, HW])
    # times 2^126 (bf16 0x7E80 a half) plus -0: the values, exact (codes +-0.5 are bf16
    # subnormals until then). Without it, and x * 2^100 instead, ptxas spends as many
    # moves as it saves multiplies (the tile's registers for its shared-memory stores)
    c1 = tl.full([BLOCK_N, NG, 2, 4, HW], 0x7E807E80, tl.int32)
    c0 = tl.full([BLOCK_N, NG, 2, 4, HW], -2147450880, tl.int32)  # 0x80008000
    m = _gq_fma2(m, c1, c0, ASM)
    v = tl.reshape(m, [BLOCK_N, NG, 8, HW])
    lo, hi = _gq_unpair(v, ASM)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, NG * WPG * 8])


@triton.jit
def _tc_words(w_ptr, rn, kb, KW: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr):
    """k-step kb's words [BN, NG, WPG] of rows rn (KW words a row; whole tiles, no masks)."""
    rw = tl.arange(0, NG * WPG)
    ptrs = w_ptr + rn[:, None] * KW + (kb * (NG * WPG) + rw)[None, :]
    return tl.reshape(tl.load(ptrs), [rn.shape[0], NG, WPG]).to(tl.uint32, bitcast=True)


@triton.jit
def _gemv_tc_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    N,
    MODE: tl.constexpr,
    G: tl.constexpr,
    KW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NG: tl.constexpr,
    SPLIT_K: tl.constexpr,
    KB_PER_SPLIT: tl.constexpr,
    SILU: tl.constexpr = False,
    DEPTH: tl.constexpr = 1,
    ASM: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    """y[N] (or silu(gate) * up [N/2] with SILU) = x[K] @ W^T for fp4 W (MODE 1 mxfp4, 2
    nvfp4; KW = K/8 words a row), BLOCK_N rows a program, k-steps of NG groups, KB_PER_SPLIT
    of them a program (a multiple of BM/NG: whole windows of BM groups), the splits summed
    by the last program of a tile (_splitk_epilogue). N % BLOCK_N == 0, K/G % BM == 0.
    SILU: a tile's rows are BLOCK_N/2 gate rows and their up rows N/2 further on.
    PDL: the first k-step's words are loaded before waiting for the previous kernel.
    DEPTH: k-steps of words in flight ahead of the one decoded (1 or 2)."""
    BM: tl.constexpr = 16
    WPG: tl.constexpr = G // 8
    BK: tl.constexpr = NG * G
    PERIOD: tl.constexpr = BM // NG  # k-steps a window of BM groups
    KG: tl.constexpr = KW * 8 // G
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, BLOCK_N)
    if SILU:
        HALF: tl.constexpr = BLOCK_N // 2
        rn = pid_n * HALF + r % HALF + (r // HALF) * (N // 2)
    else:
        rn = pid_n * BLOCK_N + r
    s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
    col = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    kb0 = pid_k * KB_PER_SPLIT
    words = _tc_words(w_ptr, rn, kb0, KW, NG, WPG)
    ahead = words  # DEPTH 2: the k-step after `words`
    if DEPTH == 2:
        ahead = _tc_words(w_ptr, rn, kb0 + (1 if KB_PER_SPLIT > 1 else 0), KW, NG, WPG)
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    out = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    for j in range(0, KB_PER_SPLIT // PERIOD):
        # the window's scales first: their DRAM round trip overlaps its k-steps
        g0 = (kb0 + j * PERIOD) * NG  # the window's first group (a multiple of BM)
        codes = tl.load(s_ptr + s_row[:, None] + (g0 + col)[None, :] * 8)  # [BN, BM] uint8
        acc = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
        for i in tl.static_range(PERIOD):
            kb = kb0 + j * PERIOD + i
            # the next k-step's words (DEPTH 2: the one after) in flight while this one is
            # decoded (past the split's last step: its first again, in bounds, never used)
            kn = tl.where(j * PERIOD + i + DEPTH < KB_PER_SPLIT, kb + DEPTH, kb0)
            nxt = _tc_words(w_ptr, rn, kn, KW, NG, WPG)
            # input k of group kb*NG + k // G goes to column (kb*NG + k // G) % BM (the
            # window starts at a multiple of BM): a masked load, 8 inputs a vector
            grp = (i * NG + rk // G)[None, :]
            x_t = tl.load(x_ptr + kb * BK + rk[None, :] + 0 * col[:, None],
                          mask=col[:, None] == grp, other=0.0)  # fmt: skip
            w_t = _tc_decode(words, BLOCK_N, NG, WPG, ASM)  # [BN, BK]
            if ASM:
                acc = tl.dot(w_t, tl.trans(x_t), acc)
            else:  # the interpreter multiplies bf16 tiles as raw integers: fp32 (exact)
                acc = tl.dot(w_t.to(tl.float32), tl.trans(x_t.to(tl.float32)), acc)
            if DEPTH == 2:
                words = ahead
                ahead = nxt
            else:
                words = nxt
        if MODE == 2 and ASM:  # E4M3 by the hardware conversion, four a call
            out += acc * _e4m3_scales(codes)
        else:
            out += acc * _scale_code(codes.to(tl.uint32), MODE)
    res = tl.sum(out, axis=1)
    if SILU:
        HALF2: tl.constexpr = BLOCK_N // 2
        g, u = tl.split(tl.trans(tl.reshape(res, [2, HALF2])))
        rg = pid_n * HALF2 + tl.arange(0, HALF2)
        _silu_epilogue(g, u, y_ptr, part_ptr, cnt_ptr, rg, rg + N // 2, N, N, pid_n, pid_k,
                       SPLIT_K)  # fmt: skip
    else:
        _splitk_epilogue(res[None, :], y_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), rn, 1, N, 0,
                         N, pid_n, pid_k, SPLIT_K)  # fmt: skip


def gemv_tc(x2, w, cfg, y, silu: bool, part_fn, pdl_kw: dict) -> None:
    """Launch _gemv_tc_kernel for x2 [1, K] bf16 into y ([1, N] or [1, N/2] with silu);
    cfg: a "tc" KernelConfig (block_n rows, ng groups a k-step, split_k splits,
    num_warps); part_fn(split) -> (partials [split, 1, N] fp32, tickets) for split > 1."""
    ksteps = w.k // (cfg.ng * w.group_size)
    split = cfg.split_k
    part, cnt = part_fn(split) if split > 1 else (y, y)
    grid = (w.n // cfg.block_n, split)
    _gemv_tc_kernel[grid](
        x2, w.weight, w.scales, y, part, cnt, w.n, MODE=2 if w.mode == "nvfp4" else 1,
        G=w.group_size, KW=w.k // 8, BLOCK_N=cfg.block_n, NG=cfg.ng, SPLIT_K=split,
        KB_PER_SPLIT=ksteps // split, SILU=silu, DEPTH=cfg.depth,
        ASM=x2.device.type == "cuda", num_warps=cfg.num_warps, num_stages=1, **pdl_kw,
    )  # fmt: skip
