"""The tensor-core GEMM for x [M > GEMV_MAX_M, K] @ W^T over a QLinear (triton_layout.py):
each weight tile is dequantized in registers (per element, or two bf16 values at a time from
packed codes) and fed to tl.dot. qmatmul in triton_kernels.py launches it. The K-quant tile
GEMM (kquant_kernels.py) shares its tile order and tensor-core step (_grouped_tile, _tile_dot).

Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

from .triton_decode import _group_scale, _splitk_epilogue
from .triton_launch import tl, tlc, triton


@triton.jit
def _decode_tile(words, scale, bias, MODE: tl.constexpr, BITS: tl.constexpr, EPW: tl.constexpr):
    """words [BN, NG, WPG] -> dequantized fp32 [BN, NG, EPW, WPG] (natural k order)."""
    sh = (tl.arange(0, EPW) * BITS)[None, None, :, None]
    t = words[:, :, None, :] >> sh
    if MODE == 0:
        q = ((t & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        v = q * scale[:, :, None, None] + bias[:, :, None, None]
    elif MODE == 3:
        f = (((t << 20) & 0x07F00000) | ((t << 24) & 0x80000000)).to(tl.float32, bitcast=True)
        v = (f * 1.329227995784916e36) * scale[:, :, None, None]  # 2^120
    else:  # prepare's E2M1 layout: positions 3 and 7 as _decode_pos, the others shifted
        i = tl.arange(0, EPW)[None, None, :, None]
        w = words[:, :, None, :]
        sh = tl.where(i < 3, 22 - 3 * i, tl.maximum(18 - 3 * i, 0))  # m, e0, e1 -> 22..24
        odd = tl.where(i == 3, (w & 0x6C00) * 0x104200, ((w >> 7) & 0x00D80000) * 0x821)
        v = tl.where((i == 3) | (i == 7), odd, w << sh)
        f = (v & 0x81C00000).to(tl.float32, bitcast=True)
        v = (f * 8.507059173023462e37) * scale[:, :, None, None]  # 2^126
    return v


# Packed bf16x2 dequantization for the GEMM (4-bit codes: affine with bf16 scales, mxfp4,
# nvfp4; bf16 x). Each int32 holds two bf16 lanes. ASM: PTX inline assembly (GPU); else
# the same bits in plain Triton (the interpreter has no inline assembly).


@triton.jit
def _gq_prmt(a, b, SEL: tl.constexpr, ASM: tl.constexpr):
    """PTX prmt.b32 with selector 0x5410 (low halves of a, b) or 0x7632 (high halves)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, " + SEL + ";", "=r,r,r", [a, b], dtype=tl.int32,
            is_pure=True, pack=1)  # fmt: skip
    elif SEL == "0x5410":
        return (a & 0xFFFF) | (b << 16)
    else:
        return ((a >> 16) & 0xFFFF) | (b & -65536)


@triton.jit
def _gq_magic(t, ASM: tl.constexpr):
    """(t & 0x000F000F) | 0x43004300: the low nibble q of each half as the bf16 128 + q."""
    if ASM:  # one LOP3 (the compiler emits an AND and an OR for the plain expression)
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [t], dtype=tl.int32,
            is_pure=True, pack=1)  # fmt: skip
    else:
        return (t & 0x000F000F) | 0x43004300


@triton.jit
def _gq_e2m1(r, B):
    """Position B (0-3) of the E2M1 codes in each half of r (prepare's layout, the same
    in both halves) -> bf16 pairs = value * 2^-126: m, e0, e1 -> bits 6..8 of the half,
    sign -> 15, by a shift (B 0-2) or as _decode_pos does position 3 (B == 3), then one
    mask. r: [.., 1, HW]; B: [.., 4, 1]."""
    odd = ((r >> 7) & 0x00D800D8) * 0x821  # m, e0 at 13, 14 -> 6, 7; e1 10 -> 8, s 11 -> 15
    return tl.where(B == 3, odd, r << tl.maximum(6 - 3 * B, 0)) & -2118090304  # 0x81C081C0


@triton.jit
def _gq_scale_pair(s_ptr, b_ptr, offs, mask, MODE: tl.constexpr, ASM: tl.constexpr):
    """Per-group scale and bias (affine; else bias 0) as bf16 pairs (int32) [BN, NG]."""
    if MODE == 0:
        s2 = _gq_pair(tl.load(s_ptr + offs, mask=mask, other=0.0), ASM)
        b2 = _gq_pair(tl.load(b_ptr + offs, mask=mask, other=0.0), ASM)
    else:
        e = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.int32)
        if MODE == 2:  # E4M3 scale: exact in fp32 (value * 2^-120 as bits, times 2^120)
            f = (((e & 0x7F) << 20) | ((e & 0x80) << 24)).to(tl.float32, bitcast=True)
            u = ((f * 1.329227995784916e36).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        else:  # E8M0 2^(e-127) as bf16 bits; e == 0 is the denormal 2^-127
            u = tl.where(e == 0, 0x40, e << 7)
        s2 = u | (u << 16)
        b2 = tl.full(s2.shape, -2147450880, tl.int32)  # 0x80008000: (-0, -0)
    return s2, b2


@triton.jit
def _gq_f32(v, HI: tl.constexpr):
    """bf16 lane (0 low, 1 high) of packed v -> fp32 (exact)."""
    if HI:
        return (v & -65536).to(tl.float32, bitcast=True)
    else:
        return (v << 16).to(tl.float32, bitcast=True)


@triton.jit
def _gq_bf16_bits(f):
    """fp32 -> bf16 bits (round to nearest even) in the low 16 bits of an int32."""
    b = f.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _gq_fma2(a, b, c, ASM: tl.constexpr):
    """Packed bf16x2: round_bf16(a * b + c) in each lane."""
    if ASM:
        return tl.inline_asm_elementwise(
            "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
            is_pure=True, pack=1)  # fmt: skip
    else:
        lo = _gq_f32(a, 0) * _gq_f32(b, 0) + _gq_f32(c, 0)
        hi = _gq_f32(a, 1) * _gq_f32(b, 1) + _gq_f32(c, 1)
        return _gq_bf16_bits(lo) | (_gq_bf16_bits(hi) << 16)


@triton.jit
def _gq_pair(h, ASM: tl.constexpr):
    """bf16 tensor -> int32 holding it in both lanes."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, {$1, $1};", "=r,h", [h], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        u = (h.to(tl.float32).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        return u | (u << 16)


@triton.jit
def _gq_unpair(v, ASM: tl.constexpr):
    """int32 holding a bf16 pair -> (low, high) as bf16 (ASM) or exact fp32 (interpreter):
    the inverse of _gq_pair."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;", "=h,=h,r", [v], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=1)  # fmt: skip
    else:
        lo = _gq_f32(v, 0)
        hi = _gq_f32(v, 1)
    return lo, hi


@triton.jit
def _dequant_4bit_bf16x2(
    words, s2, b2, MODE: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr,
    WPG: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """4-bit words [BN, NG, WPG] (group-transposed, see the module docstring) with the
    scale and bias pairs of _gq_scale_pair [BN, NG] -> the W tile [BN, NG*G] in natural k
    order: bf16 (ASM) or fp32 holding the same bf16 values (interpreter).

    Two words 2j, 2j+1 of a group hold inputs g*G + i*WPG + 2j + {0, 1} at nibble i: one
    prmt puts nibbles 0-3 of both into one register (0x7632: nibbles 4-7), so a shift and
    one LOP3 give positions i of both as the bf16 pair (128 + q), two packed bf16 FMAs
    give q*s + b (q exact, one rounding, as the fp32 path rounded to bf16). The pair is
    two k-adjacent elements: wgmma's register-operand layout (kWidth 2) takes it as is,
    so Triton converts the tile to the dot layout in registers (no shared memory).
    About 2 instructions per weight element. E2M1 (MODE 1, 2): _gq_e2m1 gives the pair
    as value * 2^-126, two packed multiplies by 2^126 and the scale (each exact or one
    rounding, no intermediate overflow)."""
    HW: tl.constexpr = WPG // 2
    wa, wb = tl.split(tl.reshape(words.to(tl.int32, bitcast=True), [BLOCK_N, NG, HW, 2]))
    r = tl.join(_gq_prmt(wa, wb, "0x5410", ASM), _gq_prmt(wa, wb, "0x7632", ASM))
    r = tl.permute(r, [0, 1, 3, 2])  # [BN, NG, 2 (nibbles 0-3 | 4-7), HW]
    b = tl.arange(0, 4)[None, None, None, :, None]
    if MODE == 0:
        t = r[:, :, :, None, :] >> (b * 4)  # [BN, NG, 2, 4, HW]: position i = 4a + b
        m = _gq_magic(t, ASM)
        c1 = tl.full([BLOCK_N, NG, 2, 4, HW], 0x3F803F80, tl.int32)  # bf16 (1, 1)
        c0 = tl.full([BLOCK_N, NG, 2, 4, HW], -1023360256, tl.int32)  # 0xC300C300: -128
    else:
        m = _gq_e2m1(r[:, :, :, None, :], b)
        c1 = tl.full([BLOCK_N, NG, 2, 4, HW], 0x7E807E80, tl.int32)  # bf16 2^126
        c0 = tl.full([BLOCK_N, NG, 2, 4, HW], -2147450880, tl.int32)  # 0x80008000: -0
    s2 = s2[:, :, None, None, None]
    b2 = b2[:, :, None, None, None]
    v = _gq_fma2(_gq_fma2(m, c1, c0, ASM), s2, b2, ASM)  # ptxas: HADD2/HMUL2 + HFMA2
    v = tl.reshape(v, [BLOCK_N, NG, 8, HW])
    lo, hi = _gq_unpair(v, ASM)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, NG * WPG * 8])


@triton.jit
def _gq_e4m3(t):
    """E4M3 code in the low byte of each half of t -> bf16 pair = value * 2^-120
    (magnitude -> bits 4..10, sign -> 15)."""
    return ((t & 0x007F007F) << 4) | ((t & 0x00800080) << 8)


@triton.jit
def _dequant_e4m3_bf16x2(
    words, s2, b2, BLOCK_N: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """mxfp8 words [BN, NG, WPG] -> the W tile [BN, NG*G] as _dequant_4bit_bf16x2 does
    (4 bytes a word: positions 2a + p, a from the prmt, p the byte in the half)."""
    HW: tl.constexpr = WPG // 2
    wa, wb = tl.split(tl.reshape(words.to(tl.int32, bitcast=True), [BLOCK_N, NG, HW, 2]))
    r = tl.join(_gq_prmt(wa, wb, "0x5410", ASM), _gq_prmt(wa, wb, "0x7632", ASM))
    r = tl.permute(r, [0, 1, 3, 2])  # [BN, NG, 2 (bytes 0-1 | 2-3), HW]
    sh = (tl.arange(0, 2) * 8)[None, None, None, :, None]
    m = _gq_e4m3(r[:, :, :, None, :] >> sh)  # [BN, NG, 2, 2, HW]
    c1 = tl.full([BLOCK_N, NG, 2, 2, HW], 0x7B807B80, tl.int32)  # bf16 2^120
    c0 = tl.full([BLOCK_N, NG, 2, 2, HW], -2147450880, tl.int32)  # 0x80008000: -0
    v = _gq_fma2(_gq_fma2(m, c1, c0, ASM), s2[:, :, None, None, None], c0, ASM)
    v = tl.reshape(v, [BLOCK_N, NG, 4, HW])
    lo, hi = _gq_unpair(v, ASM)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, NG * WPG * 4])


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr):  # fmt: skip
    """Program pid's (row tile, column tile) of y in grouped order: GROUP_M row tiles share
    each weight tile while it sits in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    return pid_m, pid_n


@triton.jit
def _tile_dot(acc, x_tile, w_tile, UPCAST: tl.constexpr, SWAP: tl.constexpr):
    """acc [BM, BN] + x_tile [BM, BK] @ w_tile [BN, BK]^T on tensor cores; with SWAP, acc is
    [BN, BM] and gets w_tile @ x_tile^T (the W tile as the register operand). float32 x:
    tf32x3 (about float32 accuracy)."""
    if UPCAST:  # the interpreter multiplies bf16 tiles as raw uint16: go through fp32
        x_tile = x_tile.to(tl.float32)
        w_tile = w_tile.to(tl.float32)
    if SWAP:
        if x_tile.dtype == tl.float32 and not UPCAST:
            acc = tl.dot(w_tile, tl.trans(x_tile), acc, input_precision="tf32x3")
        else:
            acc = tl.dot(w_tile, tl.trans(x_tile), acc)
    elif x_tile.dtype == tl.float32 and not UPCAST:
        acc = tl.dot(x_tile, tl.trans(w_tile), acc, input_precision="tf32x3")
    else:
        acc = tl.dot(x_tile, tl.trans(w_tile), acc)
    return acc


@triton.jit
def _l2_prefetch(ptrs):
    """Bring the lines holding `ptrs` (in bounds) into L2, holding no registers for them
    (the batched GEMM's weights and the decode attention's keys and values, before the PDL
    wait). L2 is coherent for the whole GPU (L1 is not): a line the previous kernel writes
    after this is read back up to date."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs.to(tl.int64, bitcast=True)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_tile(w_ptr, s_ptr, b_ptr, rn, n_mask, s_row, kb0, stride_wn, KG,
                      MODE: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr,
                      STEPS: tl.constexpr):  # fmt: skip
    """Bring k-steps kb0 .. kb0+STEPS-1 of rows rn (their words, scales and biases) into
    L2: one prefetch a row per 32 words (a 128-byte line; a row's k-steps are contiguous
    words), and for the scales and the biases the lines of the first and last group (eight
    rows' groups are contiguous: [N/8, K/G, 8])."""
    LINE: tl.constexpr = 32  # words a line
    WORDS: tl.constexpr = STEPS * NG * WPG
    NL: tl.constexpr = (WORDS + LINE - 1) // LINE + 1  # +1: the span may straddle a line
    i = tl.minimum(tl.arange(0, triton.next_power_of_2(NL)) * LINE, WORDS - 1)
    col = tl.minimum(kb0 * (NG * WPG) + i, KG * WPG - 1)  # (a last split's part k-step)
    rows = tl.where(n_mask, rn, 0)
    _l2_prefetch(w_ptr + rows[:, None] * stride_wn + col[None, :])
    g = tl.minimum(kb0 * NG + tl.arange(0, 2) * (STEPS * NG - 1), KG - 1)  # first, last
    s_offs = tl.where(n_mask, s_row, 0)[:, None] + g[None, :] * 8
    _l2_prefetch(s_ptr + s_offs)
    if MODE == 0:
        _l2_prefetch(b_ptr + s_offs)


@triton.jit
def _gemm_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NG: tl.constexpr,
    SPLIT_K: tl.constexpr,
    KB_PER_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    SWAP: tl.constexpr,
    PACKED: tl.constexpr = False,
    EVEN_N: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
    PDL: tl.constexpr = False,
    L2_PF: tl.constexpr = 0,
):
    """y[M, N] = x[M, K] @ W^T on tensor cores; each W tile is dequantized in registers.

    PACKED (4-bit codes and bf16 x, affine with bf16 scales): packed bf16x2 decode
    straight into the tensor-core register layout (_dequant_4bit_bf16x2); otherwise fp32
    per element.
    EVEN_N: N is a multiple of BLOCK_N; EVEN_K: every split's k-steps lie inside K (no
    masks on the weight, scale and x loads; the loop has fewer instructions).
    L2_PF (with PDL): the first L2_PF k-steps of this program's weight rows, scales and
    biases are brought into L2 before the wait for the previous kernel (they depend on no
    kernel), so their DRAM round trip overlaps that kernel's tail."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    BK: tl.constexpr = NG * G
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    KG = K // G
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = (rn < N) | EVEN_N
    rg = tl.arange(0, NG)
    rw = tl.arange(0, WPG)
    rk = tl.arange(0, BK)
    s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
    kb0 = pid_k * KB_PER_SPLIT
    if PDL:
        if L2_PF > 0:
            _l2_prefetch_tile(w_ptr, s_ptr, b_ptr, rn, n_mask, s_row, kb0, stride_wn, KG,
                              MODE, NG, WPG, L2_PF)  # fmt: skip
        # see _gemv_kernel; the loop waits (it reads x and W together)
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    if SWAP:  # W tile as the first (register) operand: acc holds y^T [BLOCK_N, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in range(0, KB_PER_SPLIT):
        kb = kb0 + j
        g_idx = kb * NG + rg
        g_mask = (g_idx < KG) | EVEN_K
        w_ptrs = (
            w_ptr + rn[:, None, None] * stride_wn + g_idx[None, :, None] * WPG + rw[None, None, :]
        )
        wmask = n_mask[:, None, None] & g_mask[None, :, None]
        words = tl.load(w_ptrs, mask=wmask, other=0).to(tl.uint32, bitcast=True)
        s_offs = s_row[:, None] + g_idx[None, :] * 8
        smask = n_mask[:, None] & g_mask[None, :]
        k_idx = kb * BK + rk
        x_tile = tl.load(
            x_ptr + rm[:, None] * stride_xm + k_idx[None, :],
            mask=m_mask[:, None] & ((k_idx[None, :] < K) | EVEN_K),
            other=0.0,
        )
        if PACKED:
            s2, b2 = _gq_scale_pair(s_ptr, b_ptr, s_offs, smask, MODE, not UPCAST)
            if BITS == 4:
                w_tile = _dequant_4bit_bf16x2(words, s2, b2, MODE, BLOCK_N, NG, WPG, not UPCAST)
            else:
                w_tile = _dequant_e4m3_bf16x2(words, s2, b2, BLOCK_N, NG, WPG, not UPCAST)
        else:
            scale, bias = _group_scale(s_ptr, b_ptr, s_offs, smask, MODE)
            wv = _decode_tile(words, scale, bias, MODE, BITS, EPW)
            w_tile = tl.reshape(wv, [BLOCK_N, BK]).to(x_tile.dtype)
        acc = _tile_dot(acc, x_tile, w_tile, UPCAST, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    _splitk_epilogue(
        acc, y_ptr, part_ptr, cnt_ptr, rm, rn, M, N, stride_ym, M * N, pid, pid_k, SPLIT_K
    )
