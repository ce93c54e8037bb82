"""The rope step of the PyTorch CUDA backend's attention at decode and prefill: `rope_qkv`
rotates q and k and stores k and v in the KV cache (plain or quantized to int8 / fp8 codes
with a scale a row) in one launch, and the pieces decode attention (cuda_attention.py) takes
to do the same work inside its own kernel (`_rope_new_token`, `_rope_args`). Rounded where
the PyTorch ops round; without a GPU they run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlxrun.backends.torch_kv import QuantKV, RopeStep
from mlxrun.quant.triton_kernels import pdl_args, tlc

_QUANT_ID = {"int8": 1, "fp8": 2}  # a quantized KV cache's codes (mlxrun/kvquant.py)


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
def _rope_tables(pos_ptr, inv_ptr, b, spb, rd, dt, D: tl.constexpr):
    """cos, sin of sequence b's angles as _rope_qkv_kernel rounds them: [D] (column j's is
    that of j mod D/2, for q) and [D/2] (for k)."""
    HALF: tl.constexpr = D // 2
    ang = tl.load(pos_ptr + b * spb).to(tl.float32)
    c, s = _cos_sin(ang * tl.load(inv_ptr + rd % HALF), dt)
    ck, sk = _cos_sin(ang * tl.load(inv_ptr + tl.arange(0, HALF)), dt)
    return c, s, ck, sk


@triton.jit
def _rotate_rows(x, part, c, s, rd, dt, D: tl.constexpr, RN: tl.constexpr):
    """Head vectors x (float32, columns rd) rotated by _rope_tables' c, s (column j's that
    of j mod D/2), part the other half's elements (column j's x[(j + D/2) mod D]): _rotate's
    roundings, each product rounded, on the whole vector at once. Float32."""
    sign = tl.where(rd < D // 2, -1.0, 1.0)
    return (_mul_rn(x, c, RN).to(dt).to(tl.float32)
            + _mul_rn(sign * part, s, RN).to(dt).to(tl.float32))  # fmt: skip


@triton.jit
def _new_slot(slot_ptr, b, ring, key0, ROWS: tl.constexpr):
    """The cache slot of sequence b's new key (in the attention's key numbering)."""
    if ROWS:  # wraps in a sliding-window layer's ring (of `ring` keys), as rope_qkv's does
        slot = tl.load(slot_ptr + b).to(tl.int64)
    else:
        slot = tl.load(slot_ptr).to(tl.int64)
    return key0 + slot % ring


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
    q = _rotate_rows(q.to(tl.float32), part, c[None, :], s[None, :], rd[None, :], dt, D, RN)
    slot = _new_slot(slot_ptr, b, ring, key0, ROWS)
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
