"""Fused Triton kernels of the PyTorch CUDA backend's attention step at decode.

`rope_qkv` rotates q and k and stores k and v in the KV cache (plain or quantized to int8 /
fp8 codes with a scale a row) in one launch. `decode_attention` replaces SDPA for one new
token per sequence: split over the keys so that batch 1 fills the GPU, skipping unfilled
blocks. They round where the PyTorch ops (and transformers) round, so the CUDA backend
computes what the CPU backend computes, to float rounding. The other per-layer kernels are in
cuda_ops.py.

Without a GPU they run under TRITON_INTERPRET=1, which is how the tests check them.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from mlxrun.backends.torch_kv import QuantKV, RopeStep
from mlxrun.quant.triton_gemm import _l2_prefetch
from mlxrun.quant.triton_kernels import _l2_bytes, _num_sms, pdl_args, tlc

_QUANT_ID = {"int8": 1, "fp8": 2}  # a quantized KV cache's codes (mlxrun/kvquant.py)

# With programmatic dependent launch (triton_kernels.pdl) each kernel below waits for the
# previous one before it reads anything (decode attention's cache prefetch aside), then lets
# the next one launch.


@triton.jit
def _rope_qkv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    inv_ptr,
    qo_ptr,
    ko_ptr,
    vo_ptr,
    slot_ptr,
    rows_ptr,
    NH,
    NKV,
    T,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    spb,
    sob,
    soh,
    sot,
    RING,
    ks_ptr,
    vs_ptr,
    ssb,
    ssh,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr = False,
    PDL: tl.constexpr = False,
    QUANT: tl.constexpr = 0,
    RN: tl.constexpr = False,
):
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    # program (b * T + t, head): heads [0, NH) rotate q into qo (contiguous (B, NH, T, D));
    # [NH, NH + NKV) rotate k and [NH + NKV, NH + 2 NKV) copy v into the caches at slot + t
    # (with ROWS, into cache row rows[b] at slot[b] + t: each sequence at its own length).
    # QUANT 1 (int8) / 2 (fp8): k and v are stored as codes with a scale each (ks, vs:
    # (rows, NKV, S) float32), quantized here from the model-dtype values (mlxrun/kvquant.py)
    bt = tl.program_id(0).to(tl.int64)  # offsets pass 2^31 at large batch prefills
    hh = tl.program_id(1)
    t = bt % T
    b = bt // T
    i = tl.arange(0, BLOCK)
    m = i < HALF
    if ROWS:
        cb = tl.load(rows_ptr + b).to(tl.int64)
        slot = (tl.load(slot_ptr + b).to(tl.int64) + t) % RING  # RING: a window layer's ring
    else:
        cb = b
        slot = (tl.load(slot_ptr) + t) % RING  # wraps in a sliding-window layer's ring
    if hh >= NH + NKV:
        h = hh - NH - NKV
        src = v_ptr + b * svb + h * svh + t * svt
        dst = vo_ptr + cb * sob + h * soh + slot * sot
        _store_v(src, dst, vs_ptr + cb * ssb + h * ssh + slot, i, m, HALF, QUANT)
    else:
        # (the destinations stay in their branches below: a quantized cache's pointer type
        # differs from q's, and Triton cannot merge the two after an if)
        if hh < NH:
            src = q_ptr + b * sqb + hh * sqh + t * sqt
        else:
            src = k_ptr + b * skb + (hh - NH) * skh + t * skt
        ang = tl.load(pos_ptr + b * spb + t).to(tl.float32) * tl.load(inv_ptr + i, mask=m)
        dt = qo_ptr.dtype.element_ty
        if hh < NH:
            x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
            c, s = _cos_sin(ang, dt)
            y1, y2 = _rotate(x1, x2, c, s, dt, RN)
            qdst = qo_ptr + ((b * NH + hh) * T + t) * (2 * HALF)
            tl.store(qdst + i, y1.to(dt), mask=m)
            tl.store(qdst + HALF + i, y2.to(dt), mask=m)
        else:
            kdst = ko_ptr + cb * sob + (hh - NH) * soh + slot * sot
            sdst = ks_ptr + cb * ssb + (hh - NH) * ssh + slot
            c, s = _cos_sin(ang, dt)
            _store_k(src, kdst, sdst, c, s, i, m, dt, HALF, QUANT, RN)


@triton.jit
def _mul_rn(a, b, RN: tl.constexpr):
    """a * b (float32), a product the compiler cannot fuse into an add after it. RN (CUDA):
    PTX mul.rn, which is never contracted. Without it, Triton 3.6 on sm_90 compiled
    `((x * c).to(bf16).to(f32) + y).to(bf16)` as fma.rn.bf16x2(x, c, y), skipping the
    product's rounding, and only where the code's shape allowed it: rope_qkv and the
    attention kernel's rope rounded the same source differently. (The interpreter has no
    inline asm; numpy does not contract.)"""
    if RN:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    else:
        return a * b


@triton.jit
def _cos_sin(ang, dt):
    """cos and sin of the angles rounded to the model dtype (as float32), as the PyTorch ops
    round their table."""
    return tl.cos(ang).to(dt).to(tl.float32), tl.sin(ang).to(dt).to(tl.float32)


@triton.jit
def _rotate(x1, x2, c, s, dt, RN: tl.constexpr):
    """The rotated halves (float32 sums of rounded products) of a head vector's halves x1,
    x2 by _cos_sin's c, s: each product rounded, as the PyTorch ops do."""
    a1 = _mul_rn(x1, c, RN).to(dt).to(tl.float32)
    b1 = _mul_rn(-x2, s, RN).to(dt).to(tl.float32)
    a2 = _mul_rn(x2, c, RN).to(dt).to(tl.float32)
    b2 = _mul_rn(x1, s, RN).to(dt).to(tl.float32)
    return a1 + b1, a2 + b2


@triton.jit
def _store_k(src, kdst, sdst, c, s, i, m, dt, HALF: tl.constexpr, QUANT: tl.constexpr,
             RN: tl.constexpr):  # fmt: skip
    """A new key from src, rotated by _cos_sin's c, s, into the cache at kdst (plain, or
    codes and the scale at sdst)."""
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    y1, y2 = _rotate(x1, x2, c, s, dt, RN)
    if QUANT == 0:
        tl.store(kdst + i, y1.to(dt), mask=m)
        tl.store(kdst + HALF + i, y2.to(dt), mask=m)
    else:  # a rotated key, quantized as the model dtype holds it
        y1 = y1.to(dt).to(tl.float32)
        y2 = y2.to(dt).to(tl.float32)
        _store_codes(kdst, sdst, i, m, y1, y2, HALF, QUANT)


@triton.jit
def _store_v(src, dst, sdst, i, m, HALF: tl.constexpr, QUANT: tl.constexpr):
    """A new value from src into the cache at dst (plain, or codes and the scale at sdst)."""
    if QUANT == 0:
        tl.store(dst + i, tl.load(src + i, mask=m), mask=m)
        tl.store(dst + HALF + i, tl.load(src + HALF + i, mask=m), mask=m)
    else:
        x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
        _store_codes(dst, sdst, i, m, x1, x2, HALF, QUANT)


@triton.jit
def _store_codes(dst, sdst, i, m, x1, x2, HALF: tl.constexpr, QUANT: tl.constexpr):
    """One head vector (halves x1, x2, float32) as one-byte codes at dst and its scale at
    sdst, as kvquant.torch_quantize: s = max|x| / top, code = x * (top / max|x|), int8
    rounded half to even (what torch.round does), fp8 converted to E4M3 (its byte)."""
    amax = tl.maximum(
        tl.max(tl.where(m, tl.abs(x1), 0.0), axis=0), tl.max(tl.where(m, tl.abs(x2), 0.0), axis=0)
    )
    if QUANT == 1:
        top = 127.0
    else:
        top = 448.0
    inv = tl.where(amax > 0, top / tl.maximum(amax, 1e-30), 0.0)
    tl.store(sdst, amax / top)
    y1 = x1 * inv
    y2 = x2 * inv
    if QUANT == 1:
        tl.store(dst + i, _rint(y1).to(tl.int8), mask=m)
        tl.store(dst + HALF + i, _rint(y2).to(tl.int8), mask=m)
    else:
        tl.store(dst + i, y1.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)
        tl.store(dst + HALF + i, y2.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)


@triton.jit
def _rint(x):
    """x rounded to the nearest integer, ties to even (|x| <= 127 here, so x + 0.5 is exact;
    libdevice's rint has no interpreter version)."""
    r = tl.floor(x + 0.5)
    return tl.where((r - x == 0.5) & (r % 2 != 0), r - 1, r)


def rope_qkv(q, k, v, positions, inv_freq, k_cache, v_cache, slot, rows=None) -> torch.Tensor:
    """Rotate q (B, NH, T, D) and k (B, NKV, T, D), and store k and v (B, NKV, T, D) in
    k_cache, v_cache (B, NKV, S, D, same strides) at (slot[0] + t) mod S along S, in one
    launch (it was five per layer: two ropes, two cache writes and a q copy). q, k, v may be
    strided views of the joint q/k/v product. Returns the rotated q, contiguous.

    With `rows` (B,) int64, sequence b goes to cache row rows[b] (the caches may hold more
    rows than B) at positions slot[b] + t: a slot cache's rows, each at its own length."""
    B, NH, T, D = q.shape
    NKV = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    quant, ks, vs = 0, q, q  # (the scale pointers are unused unquantized)
    if isinstance(k_cache, QuantKV):  # codes and scales (backends/torch_kv.py)
        quant, ks, vs = _QUANT_ID[k_cache.kind], k_cache.scales, v_cache.scales
        assert ks.stride() == vs.stride() and ks.stride(-1) == 1
        k_cache, v_cache = k_cache.codes, v_cache.codes
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    pos = positions.reshape(positions.shape[0], T)
    if pos.stride(-1) != 1:
        pos = pos.contiguous()
    out = torch.empty((B, NH, T, D), dtype=q.dtype, device=q.device)
    _rope_qkv_kernel[(B * T, NH + 2 * NKV)](
        q, k, v, pos, inv_freq, out, k_cache, v_cache, slot, slot if rows is None else rows,
        NH, NKV, T,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        pos.stride(0) if pos.shape[0] > 1 else 0, *k_cache.stride()[:3], k_cache.shape[2],
        ks, vs, ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2), ROWS=rows is not None, num_warps=1,
        QUANT=quant, RN=q.device.type == "cuda", **pdl_args(q.device),
    )  # fmt: skip
    return out


@triton.jit
def _attn_block(q, kt, vt, ksc, vsc, ok, m_i, l_i, acc, scale, F32_DOT: tl.constexpr,
                QUANT: tl.constexpr):  # fmt: skip
    """One block of BL keys into the online softmax of GP query rows: kt, vt [BL, D] keys and
    values (q's dtype, or int8 / E4M3 codes, exact in it), ksc, vsc [BL] the codes' scales
    (per key row: on the scores, on the softmax weights), ok [BL] which keys count.
    Returns the new m, l, acc."""
    if QUANT == 2:
        kt = kt.to(tl.float8e4nv, bitcast=True)
        vt = vt.to(tl.float8e4nv, bitcast=True)
    if QUANT > 0:
        kt = kt.to(q.dtype)
        vt = vt.to(q.dtype)
    if F32_DOT:
        sc = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(kt))
    if QUANT > 0:
        sc = sc * ksc[None, :]
    sc = tl.where(ok[None, :], sc * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    p = tl.exp(sc - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    pw = p
    if QUANT > 0:
        pw = p * vsc[None, :]
    if F32_DOT:
        pv = tl.dot(pw, vt.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(pw.to(vt.dtype), vt)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _attn_block_f16(q16, qinv, kt, vt, ksc, vsc, ok, m_i, l_i, acc, scale,
                    F32_DOT: tl.constexpr):  # fmt: skip
    """_attn_block over E4M3 codes with float16 dots: E4M3 converts to float16 two values an
    instruction on sm_90 (cvt f16x2.e4m3x2), to bf16 through float32 (a quarter-rate F2F a
    value). q16 is q x 2^e (qinv = 2^-e), its largest value in [2^14, 2^15); the weights
    p x vscale are divided by the block's largest value scale (into [0, 1]) and the
    block's p.v multiplied back."""
    k16 = kt.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    v16 = vt.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    if F32_DOT:
        sc = tl.dot(q16.to(tl.float32), tl.trans(k16.to(tl.float32)), input_precision="ieee")
    else:
        sc = tl.dot(q16, tl.trans(k16))
    sc = sc * (ksc * qinv)[None, :]
    sc = tl.where(ok[None, :], sc * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    p = tl.exp(sc - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    c = tl.max(vsc, axis=0)
    c = tl.where(c > 0, c, 1.0)
    pw = p * (vsc * (1.0 / c))[None, :]
    if F32_DOT:
        pv = tl.dot(pw, v16.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(pw.to(tl.float16), v16)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv * c


@triton.jit
def _rope_tables(pos_ptr, inv_ptr, b, spb, rd, dt, D: tl.constexpr):
    """cos, sin of sequence b's angles as _rope_qkv_kernel rounds them: [D] (column j's is
    that of j mod D/2, for q) and [D/2] (for k)."""
    HALF: tl.constexpr = D // 2
    ang = tl.load(pos_ptr + b * spb).to(tl.float32)
    c, s = _cos_sin(ang * tl.load(inv_ptr + rd % HALF), dt)
    ck, sk = _cos_sin(ang * tl.load(inv_ptr + tl.arange(0, HALF)), dt)
    return c, s, ck, sk


@triton.jit
def _rope_new_token(q, c, s, ck, sk, q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                    slot_ptr, b, kb, kh, rg, rd, gmask, start, end, ring, key0, sqb, sqh, sknb,
                    sknh, svnb, svnh, skb, skh, sks, svb, svh, svs, ssb, ssh, G: tl.constexpr,
                    D: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr,
                    RN: tl.constexpr):  # fmt: skip
    """q [GP, D] rotated by _rope_tables' c, s as _rope_qkv_kernel rotates it (each
    element's partner, the other half's, loaded with it), and this step's k (rotated by ck,
    sk) and v into the cache at their slot by the program whose keys [start, end) hold it,
    then a barrier: its loads after it read them. rope_qkv's cache may be a view of the
    attention's from key `key0` on (StaticCache's eager decode); its slot wraps at `ring`."""
    HALF: tl.constexpr = D // 2
    dt = q_ptr.dtype.element_ty
    part = tl.load(q_ptr + b * sqb + (kh * G + rg)[:, None] * sqh + ((rd + HALF) % D)[None, :],
                   mask=gmask[:, None], other=0.0).to(tl.float32)  # fmt: skip
    c = c[None, :]
    s = s[None, :]
    sign = tl.where(rd < HALF, -1.0, 1.0)[None, :]
    q = (_mul_rn(q.to(tl.float32), c, RN).to(dt).to(tl.float32)
         + _mul_rn(sign * part, s, RN).to(dt).to(tl.float32))  # fmt: skip
    if ROWS:  # wraps in a sliding-window layer's ring (of `ring` keys), as rope_qkv's does
        slot = key0 + tl.load(slot_ptr + b).to(tl.int64) % ring
    else:
        slot = key0 + tl.load(slot_ptr).to(tl.int64) % ring
    if (slot >= start) & (slot < end):
        i = tl.arange(0, HALF)
        m = i < HALF
        sbase = kb * ssb + kh * ssh + slot
        kdst = k_ptr + kb * skb + kh * skh + slot * sks
        vdst = v_ptr + kb * svb + kh * svh + slot * svs
        _store_k(kn_ptr + b * sknb + kh * sknh, kdst, ks_ptr + sbase, ck, sk, i, m, dt, HALF,
                 QUANT, RN)  # fmt: skip
        _store_v(vn_ptr + b * svnb + kh * svnh, vdst, vs_ptr + sbase, i, m, HALF, QUANT)
        tl.debug_barrier()
    return q.to(dt)


@triton.jit
def _decode_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    rows_ptr,
    part_ptr,
    stat_ptr,
    S,
    KEYS_PER_SPLIT,
    scale,
    sqb,
    sqh,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    smb,
    ks_ptr,
    vs_ptr,
    ssb,
    ssh,
    NKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    F32_DOT: tl.constexpr,
    ROWS: tl.constexpr = False,
    PDL: tl.constexpr = False,
    LINES: tl.constexpr = 0,
    EPL: tl.constexpr = 64,
    QUANT: tl.constexpr = 0,
    NSTAGES: tl.constexpr = 3,
    MB: tl.constexpr = 1024,
    F16: tl.constexpr = False,
    DIRECT: tl.constexpr = False,
    kn_ptr=None,  # ROPE: this step's k and v (B, NKV, 1, D), un-rotated, and where they go
    vn_ptr=None,
    sknb=0,
    sknh=0,
    svnb=0,
    svnh=0,
    pos_ptr=None,
    spb=0,
    inv_ptr=None,
    slot_ptr=None,
    ring=1,
    key0=0,
    ROPE: tl.constexpr = False,
    RN: tl.constexpr = False,
    ROPE_EARLY: tl.constexpr = False,
):
    # program (b * NKV + kv head, split): the G query heads of one kv head against keys
    # [split * KEYS_PER_SPLIT, +KEYS_PER_SPLIT), an online softmax over blocks of BL keys;
    # writes the unnormalised output and (max, sum) of each query head for the combine.
    # With ROWS, sequence b's keys and values are row rows[b] of the caches. With QUANT 1
    # (int8) / 2 (fp8 bytes) they are one-byte codes, scaled per key row by ks, vs (rows,
    # NKV, S): the codes convert exactly to the dot's dtype, and the scales apply to the
    # scores (keys) and to the softmax weights (values), so the cache is read at 1 byte a
    # value. F16: fp8 codes into float16 dots (_attn_block_f16). ROPE: the rope_qkv of this
    # step done here (q rotated as loaded; the new k and v stored into the cache by the one
    # program whose keys hold their slot, before it reads them), one launch less a layer.
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = bh // NKV
    kh = bh % NKV
    if ROWS:
        kb = tl.load(rows_ptr + b).to(tl.int64)
    else:
        kb = b
    rg = tl.arange(0, GP)
    rd = tl.arange(0, D)
    rl = tl.arange(0, BL)
    gmask = rg < G
    start = sp * KEYS_PER_SPLIT
    end = tl.minimum(start + KEYS_PER_SPLIT, S)
    kbase = k_ptr + kb * skb + kh * skh
    vbase = v_ptr + kb * svb + kh * svh
    sbase = kb * ssb + kh * ssh
    if LINES > 0:
        # While the previous kernel (rope + cache store) runs, bring this split's visible
        # keys and values into L2 (LINES lines of EPL elements a row): the cache and the
        # mask were written kernels before; the one new key the previous kernel stores
        # lands in L2 too, so the loads after the wait read it.
        for s0 in range(start, end, BL):
            keys = s0 + rl
            ok = keys < S
            if HAS_MASK:
                ok = ok & (tl.load(mask_ptr + b * smb + keys, mask=keys < S, other=0) != 0)
            if tl.max(ok.to(tl.int32), axis=0) > 0:
                kc = tl.minimum(keys, S - 1)[:, None]
                col = (tl.arange(0, LINES) * EPL)[None, :]
                _l2_prefetch(kbase + kc * sks + col)
                _l2_prefetch(vbase + kc * svs + col)
    lo = start
    hi = end
    if HAS_MASK:
        # The split's visible keys lie in [lo, hi): the loop reads that range whole (keys
        # the mask hides inside it are read and weighted 0) with no branch, so Triton's
        # pipeliner keeps NSTAGES blocks' loads in flight (cp.async) while a block's dots
        # run; unfilled blocks past the prefix are not read. The mask was written kernels
        # before, so this scan runs before the PDL wait too.
        first = end
        last = start - 1
        for s0 in range(start, end, MB):
            keys = s0 + tl.arange(0, MB)
            vis = tl.load(mask_ptr + b * smb + keys, mask=keys < end, other=0) != 0
            first = tl.minimum(first, tl.min(tl.where(vis, keys, end), axis=0))
            last = tl.maximum(last, tl.max(tl.where(vis, keys, start - 1), axis=0))
        lo = start + (first - start) // BL * BL
        hi = last + 1
    if ROPE_EARLY:
        # The step's positions were written kernels before (as the mask): their cos and sin
        # (libdevice's, ~100 instructions) are computed before the PDL wait, off the path
        # from the qkv projection's end to the first key block
        c, s, ck, sk = _rope_tables(pos_ptr, inv_ptr, b, spb, rd, q_ptr.dtype.element_ty, D)
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    q = tl.load(q_ptr + b * sqb + (kh * G + rg)[:, None] * sqh + rd[None, :],
                mask=gmask[:, None], other=0.0)  # fmt: skip
    if ROPE:
        if not ROPE_EARLY:
            c, s, ck, sk = _rope_tables(pos_ptr, inv_ptr, b, spb, rd, q_ptr.dtype.element_ty, D)
        q = _rope_new_token(q, c, s, ck, sk, q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                            slot_ptr, b, kb, kh, rg, rd, gmask, start, end, ring, key0, sqb, sqh,
                            sknb, sknh, svnb, svnh, skb, skh, sks, svb, svh, svs, ssb, ssh, G, D,
                            ROWS, QUANT, RN)  # fmt: skip
    q16 = q
    qinv = 1.0
    if F16:
        # q x 2^e in float16 with its largest |value| in [2^14, 2^15): exact (bf16's and
        # float16's significands fit), 2^e and 2^-e built from the exponent bits
        qa = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
        ex = (qa.to(tl.int32, bitcast=True) >> 23) & 0xFF  # 127 + floor(log2 max|q|)
        e = tl.minimum(tl.maximum(141 - ex, -100), 100)
        qinv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        q16 = (q.to(tl.float32) * ((127 + e) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
    m_i = tl.full([GP], -1.0e30, tl.float32)  # finite: a fully masked block leaves it
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s0 in tl.range(lo, hi, BL, num_stages=NSTAGES):
        keys = s0 + rl
        ok = keys < hi
        kt = tl.load(kbase + keys[:, None] * sks + rd[None, :], mask=ok[:, None], other=0)
        vt = tl.load(vbase + keys[:, None] * svs + rd[None, :], mask=ok[:, None], other=0)
        if HAS_MASK:
            ok = ok & (tl.load(mask_ptr + b * smb + keys, mask=ok, other=0) != 0)
        ksc = tl.zeros([BL], tl.float32)
        vsc = tl.zeros([BL], tl.float32)
        if QUANT > 0:
            ksc = tl.load(ks_ptr + sbase + keys, mask=ok, other=0.0)
            vsc = tl.load(vs_ptr + sbase + keys, mask=ok, other=0.0)
        if F16:
            m_i, l_i, acc = _attn_block_f16(
                q16, qinv, kt, vt, ksc, vsc, ok, m_i, l_i, acc, scale, F32_DOT
            )
        else:
            m_i, l_i, acc = _attn_block(q, kt, vt, ksc, vsc, ok, m_i, l_i, acc, scale, F32_DOT,
                                        QUANT)  # fmt: skip
    row = (bh * tl.num_programs(1) + sp) * G + rg  # [GP] rows of (B, NKV, SPLITS, G)
    if DIRECT:
        # one split and no sink: the output itself (part_ptr is out, (B, NH, 1, D), whose
        # rows b * NH + kh * G + g are these), what the combine computes from one split:
        # its weight e^(m - m) is 1, so o / den is acc / l
        out = acc / l_i[:, None]
        tl.store(part_ptr + row[:, None] * D + rd[None, :],
                 out.to(part_ptr.dtype.element_ty), mask=gmask[:, None])  # fmt: skip
    else:
        tl.store(part_ptr + row[:, None] * D + rd[None, :], acc, mask=gmask[:, None])
        tl.store(stat_ptr + row * 2, m_i, mask=gmask)
        tl.store(stat_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _decode_attn_combine(part_ptr, stat_ptr, sink_ptr, out_ptr, SPLITS, NH, G: tl.constexpr,
                         D: tl.constexpr, SP: tl.constexpr, HAS_SINK: tl.constexpr,
                         PDL: tl.constexpr = False, SC: tl.constexpr = 16):  # fmt: skip
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    # program (b * NH + head): out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), and
    # with a sink logit z (gpt-oss) e^(z - M) joins the denominator (M then covers z too)
    bq = tl.program_id(0).to(tl.int64)
    bkv = bq // G  # = b * NKV + head // G
    g = bq % G
    rs = tl.arange(0, SP)
    rd = tl.arange(0, D)
    smask = rs < SPLITS
    row = (bkv * SPLITS + rs) * G + g  # [SP]
    m = tl.load(stat_ptr + row * 2, mask=smask, other=-1.0e30)
    l_s = tl.load(stat_ptr + row * 2 + 1, mask=smask, other=0.0)
    top = tl.max(m, axis=0)
    if HAS_SINK:
        z = tl.load(sink_ptr + bq % NH).to(tl.float32)
        top = tl.maximum(top, z)
    w = tl.exp(m - top)
    den = tl.sum(l_s * w, axis=0)
    if HAS_SINK:
        den += tl.exp(z - top)
    # the partial outputs SC splits at a time (all SP at once spilled past 64 x 128 floats)
    o = tl.zeros([D], tl.float32)
    for c0 in range(0, SPLITS, SC):
        rc = c0 + tl.arange(0, SC)
        cm = rc < SPLITS
        rowc = (bkv * SPLITS + rc) * G + g
        wc = tl.exp(tl.load(stat_ptr + rowc * 2, mask=cm, other=-1.0e30) - top)
        acc = tl.load(part_ptr + rowc[:, None] * D + rd[None, :], mask=cm[:, None], other=0.0)
        o += tl.sum(acc * wc[:, None], axis=0)
    tl.store(out_ptr + bq * D + rd, (o / den).to(out_ptr.dtype.element_ty))


def _rope_args(rope: RopeStep | None, rows, k) -> dict:
    """The attention kernel's arguments for doing a RopeStep's rope_qkv itself (k: the
    attention's keys, plain or codes)."""
    if rope is None:
        return {}
    kd = rope.k_cache.codes if isinstance(rope.k_cache, QuantKV) else rope.k_cache
    # rope_qkv's cache is the attention's, or a view of it from a later key on
    step = k.stride(2) * k.element_size()
    key0, off = divmod(kd.data_ptr() - k.data_ptr(), step)
    assert kd.stride() == k.stride() and off == 0 and 0 <= key0 < k.shape[2], (key0, off)
    k, v = rope.k, rope.v
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape[2] == 1
    assert (rope.rows is None) == (rows is None)
    pos = rope.positions.reshape(rope.positions.shape[0], 1)
    return dict(
        kn_ptr=k, vn_ptr=v, sknb=k.stride(0), sknh=k.stride(1), svnb=v.stride(0),
        svnh=v.stride(1), pos_ptr=pos, spb=pos.stride(0) if pos.shape[0] > 1 else 0,
        inv_ptr=rope.inv_freq, slot_ptr=rope.slot, ROPE=True, RN=rope.q.device.type == "cuda",
        ring=kd.shape[2], key0=key0,
    )  # fmt: skip


# Decode attention brings its keys and values into L2 before its PDL wait (H100, int4 batch-1
# step at context 1024: 2.402 -> 2.382 ms, two A/B pairs); MLXRUN_L2PF_KV=0 turns it off.
L2_PREFETCH_KV = os.environ.get("MLXRUN_L2PF_KV", "1") == "1"


@dataclasses.dataclass(frozen=True)
class AttnLaunch:
    """Launch choices of decode_attention (benchmarks/kv_attention.py times others)."""

    # (H100, one layer of Llama-3.1-8B's attention at 4k and 32k, batch 1 and 8; the numbers
    # in docs/long-context.md): 128-key blocks and more programs suit the one-byte caches,
    # whose blocks take twice bf16's instructions per value read
    block: int = 64  # keys a block of a bf16 / float16 / float32 cache (a power of 2, >= 16)
    block_quant: int = 128  # of an int8 / fp8 cache
    per_sm: int = 2  # splits over the keys: about this many programs per SM (bf16)
    per_sm_quant: int = 4  # (int8, fp8)
    stages: int = 3  # blocks whose loads are in flight (Triton's pipeliner)
    # the combine's program (b, head) reads the splits' partials this many at a time: all
    # 128 at once spilled (32k, batch 1, 4 programs per SM); 4 warps over chunks of 16 were
    # slower at 4k (int8 15.6 against 10.9 us)
    combine_warps: int = 1
    combine_chunk: int = 64
    fp8_f16: bool | None = None  # fp8 dots in float16; None: where q is bf16 / float16
    # one split and no sinks: the attention kernel writes the output, no combine launch
    # (which at batch 64, context 1024, 8B shape, took 0.73 ms a step: one split already);
    # MLXRUN_ATTN_DIRECT=0 keeps the combine (for A/B timing)
    direct: bool = os.environ.get("MLXRUN_ATTN_DIRECT", "1") == "1"
    # with the rope folded in (RopeStep): its cos/sin before the PDL wait, not after;
    # MLXRUN_ROPE_EARLY=0 after it (for A/B timing)
    rope_early: bool = os.environ.get("MLXRUN_ROPE_EARLY", "1") == "1"

    @classmethod
    def from_spec(cls, spec: str) -> AttnLaunch:
        """'per_sm=8,fp8_f16=0' -> AttnLaunch(per_sm=8, fp8_f16=False); '' -> the default."""
        kw = {}
        for item in filter(None, spec.split(",")):
            key, val = item.split("=")
            kw[key] = bool(int(val)) if key in ("fp8_f16", "direct", "rope_early") else int(val)
        return cls(**kw)


def decode_attention(q, k, v, scale: float, mask, sinks=None, rows=None,
                     launch: AttnLaunch = AttnLaunch(), rope=None) -> torch.Tensor:  # fmt: skip
    """Attention of one new token per sequence: q (B, NH, 1, D) against k, v (B, NKV, S, D)
    (GQA: query head h reads kv head h // (NH / NKV)); mask None or bool (B or 1, 1, 1, S),
    True = may attend; sinks None or (NH,), a logit per head joining the softmax (gpt-oss).
    k, v may be a quantized cache's torch_kv.QuantKV (codes and scales, read as they are).
    Returns (B, NH, 1, D). With `rows` (B,) int64, k and v are the whole caches of a slot
    cache (any number of rows) and sequence b reads row rows[b], in place.

    The keys are split across programs so that a batch of one still spreads over the GPU
    (split-K over the sequence, "flash decoding"), and keys past a split's last visible
    one are not read: in graph decode the cache is masked to its filled prefix. (The
    combine as the last split's epilogue, by an atomic ticket, was slower on an H100: 0.35
    ms a step for the 32 layers against 0.21 for both kernels; its loop over the splits
    runs in one program.) Where the keys take one split (and there are no sinks) the
    attention kernel writes the output itself and the combine is not launched.

    rope (a RopeStep): q is not rotated yet and this step's k, v are not in the cache: the
    kernel does what rope_qkv would have done first, bit for bit, in the same launch."""
    B, NH, _, D = q.shape
    NKV, S = k.shape[1], k.shape[2]
    G = NH // NKV
    quant, ks, vs = 0, q, q  # (the scale pointers are unused unquantized)
    if isinstance(k, QuantKV):  # codes and per-row scales (backends/torch_kv.py)
        quant, ks, vs = _QUANT_ID[k.kind], k.scales, v.scales
        assert ks.stride() == vs.stride() and ks.stride(-1) == 1
        k, v = k.codes, v.codes
    BL = launch.block_quant if quant else launch.block
    blocks = triton.cdiv(S, BL)
    per_sm = launch.per_sm_quant if quant else launch.per_sm
    want = max(1, min(blocks, triton.cdiv(per_sm * _num_sms(q.device), B * NKV)))
    per = triton.cdiv(blocks, want) * BL
    splits = triton.cdiv(S, per)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    direct = launch.direct and splits == 1 and sinks is None
    out = torch.empty((B, NH, 1, D), dtype=q.dtype, device=q.device)
    if direct:
        part, stat = out, out
    else:
        part = torch.empty((B, NKV, splits, G, D), dtype=torch.float32, device=q.device)
        stat = torch.empty((B, NKV, splits, G, 2), dtype=torch.float32, device=q.device)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], S)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    pd = pdl_args(q.device)
    f16 = launch.fp8_f16 if launch.fp8_f16 is not None else q.dtype != torch.float32
    row = D * k.element_size()  # bytes of a key; prefetched as whole 128-byte lines
    lines = 0
    # Only where the layer's keys and values take a small share of L2: at batch 32 (128 MB a
    # layer) the early copies evicted each other and decode fell 5070 -> 4680 tok/s (H100).
    if pd["PDL"] and L2_PREFETCH_KV and row % 128 == 0:
        lines = row // 128 if 2 * B * NKV * S * row <= _l2_bytes(q.device) // 4 else 0
    _decode_attn_kernel[(B * NKV, splits)](
        q, k, v, mask if mask is not None else q, rows if rows is not None else q, part, stat,
        S, per, scale,
        q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3],
        mask.stride(0) if mask is not None and mask.shape[0] > 1 else 0,
        ks, vs, ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        NKV=NKV, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BL=BL, QUANT=quant,
        HAS_MASK=mask is not None, ROWS=rows is not None, num_warps=4,
        # float32 models get float32 dots (not TF32); the interpreter's bf16 dot is wrong
        F32_DOT=q.dtype == torch.float32 or q.device.type != "cuda", **pd,
        LINES=lines if lines & (lines - 1) == 0 else 0,  # tl.arange takes powers of two
        EPL=128 // k.element_size(), NSTAGES=launch.stages, F16=quant == 2 and f16,
        DIRECT=direct, ROPE_EARLY=rope is not None and launch.rope_early,
        **_rope_args(rope, rows, k),
    )  # fmt: skip
    if direct:
        return out
    _decode_attn_combine[(B * NH,)](
        part, stat, sinks if sinks is not None else part, out, splits, NH, G=G, D=D,
        SP=triton.next_power_of_2(splits), HAS_SINK=sinks is not None,
        num_warps=launch.combine_warps,
        SC=min(launch.combine_chunk, triton.next_power_of_2(splits)),
        **pdl_args(q.device),
    )  # fmt: skip
    return out
