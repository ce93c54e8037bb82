"""Fused Triton kernels of the PyTorch CUDA backend's attention step at decode.

`rope_qkv` (cuda_rope.py, re-exported here) rotates q and k and stores k and v in the KV
cache; decode attention can do that work itself. `decode_attention` replaces SDPA for one new
token per sequence: split over the keys so that batch 1 fills the GPU, skipping unfilled
blocks. They round where the PyTorch ops (and transformers) round, so the CUDA backend
computes what the CPU backend computes, to float rounding. The other per-layer kernels are in
cuda_ops.py.

Without a GPU they run under TRITON_INTERPRET=1, which is how the tests check them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from mlxrun.backends.cuda_launch import AttnLaunch as AttnLaunch
from mlxrun.backends.cuda_rope import (
    _QUANT_ID,
    _new_slot,
    _rope_args,
    _rope_new_token,
    _rope_tables,
    _rotate_rows,
)
from mlxrun.backends.cuda_rope import _rope_qkv_kernel as _rope_qkv_kernel
from mlxrun.backends.cuda_rope import rope_qkv as rope_qkv
from mlxrun.backends.torch_kv import QuantKV
from mlxrun.errors import MlxrunError
from mlxrun.quant.triton_gemm import _l2_prefetch
from mlxrun.quant.triton_kernels import _l2_bytes, _num_sms, pdl_args, tlc

# With programmatic dependent launch (triton_kernels.pdl) each kernel below waits for the
# previous one before it reads anything (decode attention's cache prefetch aside), then lets
# the next one launch.


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
    EARLY_KV: tl.constexpr = False,
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
    if EARLY_KV:
        # (ROPE, a plain cache) every key this program reads but the step's new one was
        # stored kernels before, so its first block's keys and values are loaded before the
        # PDL wait; the new key and value, rotated after it as _rope_new_token stores them,
        # replace their row in registers: no load round trip between q and the first
        # block's dots
        keys0 = lo + rl
        ok0 = keys0 < hi
        kt0 = tl.load(kbase + keys0[:, None] * sks + rd[None, :], mask=ok0[:, None], other=0)
        vt0 = tl.load(vbase + keys0[:, None] * svs + rd[None, :], mask=ok0[:, None], other=0)
        if HAS_MASK:
            ok0 = ok0 & (tl.load(mask_ptr + b * smb + keys0, mask=ok0, other=0) != 0)
        new0 = (keys0 == _new_slot(slot_ptr, b, ring, key0, ROWS))[:, None]
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
    if EARLY_KV:
        kn = kn_ptr + b * sknb + kh * sknh
        x = tl.load(kn + rd).to(tl.float32)
        part = tl.load(kn + (rd + D // 2) % D).to(tl.float32)
        kn = _rotate_rows(x, part, c, s, rd, q_ptr.dtype.element_ty, D, RN)
        vn = tl.load(vn_ptr + b * svnb + kh * svnh + rd)
        kt0 = tl.where(new0, kn.to(kt0.dtype)[None, :], kt0)
        vt0 = tl.where(new0, vn.to(vt0.dtype)[None, :], vt0)
        zero = tl.zeros([BL], tl.float32)  # (no scales: a plain cache)
        m_i, l_i, acc = _attn_block(q, kt0, vt0, zero, zero, ok0, m_i, l_i, acc, scale, F32_DOT,
                                    QUANT)  # fmt: skip
        lo += BL
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
                         PDL: tl.constexpr = False, SC: tl.constexpr = 16,
                         ONCE: tl.constexpr = False):  # fmt: skip
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
    if ONCE:  # (SP <= SC) the partials loaded with the stats: one round trip, not two
        acc = tl.load(part_ptr + row[:, None] * D + rd[None, :], mask=smask[:, None], other=0.0)
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
    if ONCE:
        o += tl.sum(acc * w[:, None], axis=0)  # (what the loop's one chunk adds, bit for bit)
    else:
        for c0 in range(0, SPLITS, SC):
            rc = c0 + tl.arange(0, SC)
            cm = rc < SPLITS
            rowc = (bkv * SPLITS + rc) * G + g
            wc = tl.exp(tl.load(stat_ptr + rowc * 2, mask=cm, other=-1.0e30) - top)
            acc = tl.load(part_ptr + rowc[:, None] * D + rd[None, :], mask=cm[:, None],
                          other=0.0)  # fmt: skip
            o += tl.sum(acc * wc[:, None], axis=0)
    tl.store(out_ptr + bq * D + rd, (o / den).to(out_ptr.dtype.element_ty))


# Decode attention brings its keys and values into L2 before its PDL wait (H100, int4 batch-1
# step at context 1024: 2.402 -> 2.382 ms, two A/B pairs); MLXRUN_L2PF_KV=0 turns it off.
L2_PREFETCH_KV = os.environ.get("MLXRUN_L2PF_KV", "1") == "1"


@functools.cache
def _env_launch() -> AttnLaunch:
    """The model's launch: the default, or MLXRUN_ATTN_LAUNCH's fields (AttnLaunch.from_spec,
    e.g. "per_sm=1": one split at batch 32 and the 8B shape's 8 kv heads, so no combine),
    read at the first call (for A/B timing in the model)."""
    spec = os.environ.get("MLXRUN_ATTN_LAUNCH", "")
    try:
        return AttnLaunch.from_spec(spec)
    except (ValueError, TypeError):
        raise MlxrunError(
            f"MLXRUN_ATTN_LAUNCH={spec!r} is not NAME=INT fields of AttnLaunch joined by ',' "
            "(e.g. per_sm=1,stages=4); unset it for the default"
        ) from None


def decode_attention(q, k, v, scale: float, mask, sinks=None, rows=None,
                     launch: AttnLaunch | None = None, rope=None) -> torch.Tensor:  # fmt: skip
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
    kernel does what rope_qkv would have done first, bit for bit, in the same launch, and
    (a plain cache, a grid resident at once) loads its first key block before the PDL wait,
    the new key put in its row in registers (AttnLaunch.early_kv)."""
    launch = launch or _env_launch()
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
    if not quant:
        want = max(want, min(blocks, launch.min_splits))
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
    # the first block before the PDL wait: with the rope folded in (the only new key is this
    # kernel's own) and only where the whole grid is resident at once (two programs a SM,
    # 204 registers each, against 88): a larger grid's later programs gain nothing from an
    # early start and fewer fit a SM (one layer at batch 32, H200: 28.3 -> 31.2 us)
    resident = B * NKV * splits <= launch.early_waves * _num_sms(q.device)
    early = rope is not None and launch.early_kv and not quant and resident
    # the key loop after an early block runs a split's other blocks: a pipeline deeper than
    # them only takes shared memory (at context 512 there are none: 3 stages against 1,
    # 68 against 37 KB, cost 0.8% of the step above)
    stages = max(1, min(launch.stages, per // BL - 1)) if early else launch.stages
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
        EPL=128 // k.element_size(), NSTAGES=stages, F16=quant == 2 and f16,
        DIRECT=direct, ROPE_EARLY=rope is not None and launch.rope_early,
        EARLY_KV=early,
        **_rope_args(rope, rows, k),
    )  # fmt: skip
    if direct:
        return out
    _decode_attn_combine[(B * NH,)](
        part, stat, sinks if sinks is not None else part, out, splits, NH, G=G, D=D,
        SP=triton.next_power_of_2(splits), HAS_SINK=sinks is not None,
        num_warps=launch.combine_warps,
        SC=min(launch.combine_chunk, triton.next_power_of_2(splits)),
        ONCE=launch.combine_once and triton.next_power_of_2(splits) <= launch.combine_chunk,
        **pdl_args(q.device),
    )  # fmt: skip
    return out
