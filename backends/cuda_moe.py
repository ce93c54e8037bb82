"""Triton kernels for mixture-of-experts decode on CUDA: every token slot's expert in one
launch per projection, reading only the selected experts' bytes.

Slots are (token, j) pairs, j < top_k. One program computes a block of output rows of one
slot: it reads its expert id, streams that expert's rows of the stacked weight and dots them
with the slot's input row. Two launches a layer:
- gate and up together, the gate's activation (SiLU, or gpt-oss's clamped SwiGLU) in the
  epilogue: h (S, I);
- down, scaled by the slot's routing weight in the epilogue: (S, H), summed over j by torch.
No host sync, so the decode step stays capturable in a CUDA graph at any batch.

Packed experts (affine 4/8-bit, mxfp4, nvfp4, mxfp8) run `_moe_qgemv`: the dense GEMV's
k-step (quant/triton_kernels.py: its load-time repack, float-bit decoding, lanes along K,
next step's words in flight) on the expert's rows, found from the slot's id inside the
kernel. The repack is made once per layer on first use (`prepared`): gate and up of each
expert joined, [gate_e; up_e], so a program's rows are gate rows and the matching up rows.
Dense experts (bf16/fp32) run `_moe_gemv`, which reads the stored (E, N, K) arrays.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from mlxrun.backends.base import QuantizedWeight
from mlxrun.quant.triton_kernels import (
    _MODE_ID,
    GEMV_WARPS,
    SCALE_ROWS,
    QLinear,
    _decode_tile,
    _gemv_step,
    _group_scale,
    _load_step,
    pdl_args,
    prepare,
    qmatmul,
    tlc,
)

_MODE = {"dense": 0, "affine": 1, "mxfp4": 2, "nvfp4": 3, "mxfp8": 4}


@triton.jit
def _e4m3(b):
    """E4M3 byte codes (int32) -> float32 (NaN codes not expected: the loader refuses them)."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _e2m1(q):
    """E2M1 nibbles (int32) -> float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    mag = q & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((q & 8) != 0, -v, v)


@triton.jit
def _tile(W, S, B, e, rows, rmask, w0, N, KW, KG, MODE: tl.constexpr, BITS: tl.constexpr,
          G: tl.constexpr, BW: tl.constexpr):  # fmt: skip
    """Weights (BLOCK_N, BW, PER) float32 of expert e, rows `rows`: words w0..w0+BW of each
    row (PER = 32 // BITS values a word; dense: BW values, PER 1). Each word is loaded once
    and its values taken by shifts, so a k-step is BW loads a row, not BW * PER."""
    PER: tl.constexpr = 32 // BITS
    wi = w0 + tl.arange(0, BW)
    m2 = rmask[:, None] & (wi < KW)[None, :]
    base = (e * N + rows[:, None]).to(tl.int64)
    if MODE == 0:
        w = tl.load(W + base * KW + wi[None, :], mask=m2, other=0.0)
        return w.to(tl.float32)[:, :, None]
    word = tl.load(W + base * KW + wi[None, :], mask=m2, other=0)
    q = (word[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
    WPG: tl.constexpr = G // PER  # words a group
    gi = base * KG + (wi // WPG)[None, :]
    if MODE == 1:  # affine: scale * q + bias
        sc = tl.load(S + gi, mask=m2, other=0.0).to(tl.float32)[:, :, None]
        b = tl.load(B + gi, mask=m2, other=0.0).to(tl.float32)[:, :, None]
        return q.to(tl.float32) * sc + b
    code = tl.load(S + gi, mask=m2, other=0).to(tl.int32)
    if MODE == 3:  # nvfp4: E4M3 scale
        scale = _e4m3(code)
    else:  # E8M0: a power of two
        scale = tl.exp2((code - 127).to(tl.float32))
    if MODE == 4:
        return _e4m3(q) * scale[:, :, None]
    return _e2m1(q) * scale[:, :, None]


@triton.jit
def _moe_gemv(X, IDS, OUT, RW, W1, S1, B1, BIAS1, W2, S2, B2, BIAS2, N, K, X_DIV, limit, alpha,
              MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, GATED: tl.constexpr,
              ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
              BLOCK_N: tl.constexpr, BW: tl.constexpr):  # fmt: skip
    """OUT[s, rows] for slot s = program 0: x = X[s // X_DIV] (K,), expert IDS[s].
    GATED: act(x @ W1[e]^T + b1) * (x @ W2[e]^T + b2); else x @ W1[e]^T + b1, times RW[s]
    when SCALED. A k-step covers BW words (BW * PER inputs) of each of BLOCK_N rows."""
    PER: tl.constexpr = 32 // BITS
    s = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    e = tl.load(IDS + s).to(tl.int64)
    xrow = X + (s // X_DIV).to(tl.int64) * K
    KW = K // PER
    KG = K // G
    acc1 = tl.zeros((BLOCK_N,), tl.float32)
    acc2 = tl.zeros((BLOCK_N,), tl.float32)
    for w0 in range(0, KW, BW):
        k = w0 * PER + tl.arange(0, BW * PER)
        x = tl.load(xrow + k, mask=k < K, other=0.0).to(tl.float32)
        x = tl.reshape(x, (BW, PER))[None, :, :]  # input k = word * PER + position
        w = _tile(W1, S1, B1, e, rows, rmask, w0, N, KW, KG, MODE, BITS, G, BW)
        acc1 += tl.sum(tl.sum(w * x, axis=2), axis=1)
        if GATED:
            w = _tile(W2, S2, B2, e, rows, rmask, w0, N, KW, KG, MODE, BITS, G, BW)
            acc2 += tl.sum(tl.sum(w * x, axis=2), axis=1)
    if HAS_BIAS:
        acc1 += tl.load(BIAS1 + e * N + rows, mask=rmask, other=0.0).to(tl.float32)
        if GATED:
            acc2 += tl.load(BIAS2 + e * N + rows, mask=rmask, other=0.0).to(tl.float32)
    y = acc1
    if GATED:
        if ACT == 0:  # SiLU(gate) * up
            y = acc1 / (1.0 + tl.exp(-acc1)) * acc2
        else:  # gpt-oss: gate clamped above, up both sides, (up + 1) * gate * sigmoid(a*gate)
            g = tl.minimum(acc1, limit)
            u = tl.minimum(tl.maximum(acc2, -limit), limit)
            y = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
    if SCALED:
        y = y * tl.load(RW + s).to(tl.float32)
    tl.store(OUT + s.to(tl.int64) * N + rows, y.to(OUT.dtype.element_ty), mask=rmask)


@triton.jit
def _moe_qgemv(X, IDS, OUT, RW, W, S, B, BIAS1, BIAS2, N, K, X_DIV, limit, alpha,
               MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, GATED: tl.constexpr,
               ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
               BLOCK_N: tl.constexpr, KSTEPS: tl.constexpr, PREFETCH: tl.constexpr,
               EVEN: tl.constexpr, KWC: tl.constexpr, WARPS: tl.constexpr,
               PDL: tl.constexpr = False):  # fmt: skip
    """OUT[s, rows] for slot s = program 0: x = X[s // X_DIV] (K,), expert e = IDS[s].

    W, S, B: a QLinear's repacked words, row-tiled scales and biases of all experts, expert e
    at rows e*R.. (R = 2N when GATED: its N gate rows, then its N up rows; else R = N).
    GATED: act(gate + b1) * (up + b2) for BLOCK_N // 2 outputs (16: 8 gate rows and their 8
    up rows as _gemv_step's two halves; 8: 4 and 4 in one half, as qmatmul's silu tiles);
    else BLOCK_N rows of x @ W[e]^T + b1, times RW[s] when SCALED.
    One k-step is 4 words of each row a lane (lanes along K, WARPS warps), KSTEPS of them
    (no split-K: the slots already give enough programs). EVEN: no row or K masks (whole
    row blocks and k-steps; KWC = the words a row, else 0).
    PDL: the expert id and x come from earlier kernels, so nothing is loaded before the wait.
    """
    HALVES: tl.constexpr = 2 if BLOCK_N == 16 else 1
    LANES: tl.constexpr = 32 * WARPS
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    TWO: tl.constexpr = WPG < 4  # nvfp4: a lane's words 0,1 and 2,3 are in two groups
    s = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    e = tl.load(IDS + s).to(tl.int64)
    KG = K // G
    if KWC > 0:
        KW = KWC
    else:
        KW = K // EPW
    if GATED:
        R = 2 * N
    else:
        R = N
    w_ptr = W + e * R * KW
    s_ptr = S + e * R * KG  # tiles of 8 rows: expert e's start at tile e*R/8 (R % 8 == 0)
    b_ptr = B + e * R * KG
    if GATED and HALVES == 2:
        rn = pid_n * 8 + tl.arange(0, 8)
        rn_h = rn + N
        n_mask = rn < N
        n_mask_h = n_mask
    elif GATED:
        r8 = tl.arange(0, 8)
        r4 = pid_n * 4 + r8 % 4
        rn = r4 + (r8 // 4) * N
        rn_h = rn  # unused
        n_mask = r4 < N
        n_mask_h = n_mask
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, 8)
        rn_h = rn + 8
        n_mask = rn < N
        n_mask_h = rn_h < N
    rkw = tl.arange(0, 4 * LANES)
    lane = tl.arange(0, LANES)
    s_row = (rn // 8) * (KG * 8) + (rn % 8)
    s_row_h = (rn_h // 8) * (KG * 8) + (rn_h % 8)
    # the lanes' x inputs and groups, as _gemv_kernel sets them up
    if TWO:
        x_pair0 = (2 * lane[:, None] + tl.arange(0, 2)[None, :]) * (G // 2)
        g_pair = 2 * lane[:, None] + tl.arange(0, 2)[None, :]
    else:
        xl = (lane // (WPG // 4)) * (G // 2) + (2 * lane) % (WPG // 2)
        x_pair0 = tl.multiple_of(xl, 2)[:, None] + tl.arange(0, 2)[None, :]
        g_pair = (lane // (WPG // 4))[:, None] + 0 * tl.arange(0, 2)[None, :]
    g_a = (4 * lane) // WPG
    g_b = (4 * lane + 2) // WPG
    x_base = X + (s // X_DIV).to(tl.int64) * K
    acc = tl.zeros([8, LANES], dtype=tl.float32)
    acc_h = tl.zeros([8, LANES], dtype=tl.float32)
    if PREFETCH:  # each step's words in flight while the previous step computes
        wa = _load_step(w_ptr, rn, n_mask, rkw, 0, KW, EVEN, MODE, LANES)
        wa_h = wa
        if HALVES == 2:
            wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, 0, KW, EVEN, MODE, LANES)
        for j in range(0, KSTEPS // 2):
            kb = 2 * j
            wb = _load_step(w_ptr, rn, n_mask, rkw, kb + 1, KW, EVEN, MODE, LANES)
            wb_h = wb
            if HALVES == 2:
                wb_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb + 1, KW, EVEN, MODE, LANES)
            acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a,
                                    g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG,
                                    MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
            kn = tl.minimum(kb + 2, KSTEPS - 1)  # past the end: reload the last (unused)
            wa = _load_step(w_ptr, rn, n_mask, rkw, kn, KW, EVEN, MODE, LANES)
            wa_h = wa
            if HALVES == 2:
                wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kn, KW, EVEN, MODE, LANES)
            acc, acc_h = _gemv_step(acc, acc_h, wb, wb_h, kb + 1, x_base, x_pair0, g_pair,
                                    g_a, g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr,
                                    KG, MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
        if KSTEPS % 2 == 1:
            acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, KSTEPS - 1, x_base, x_pair0, g_pair,
                                    g_a, g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr,
                                    KG, MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
    else:
        for kb in range(0, KSTEPS):
            wa = _load_step(w_ptr, rn, n_mask, rkw, kb, KW, EVEN, MODE, LANES)
            wa_h = wa
            if HALVES == 2:
                wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb, KW, EVEN, MODE, LANES)
            acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a,
                                    g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG,
                                    MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
    # decoded products carry 2^-49 (affine), 2^-20 (fp8) or 2^-26 (fp4)
    if MODE == 0:
        C: tl.constexpr = 562949953421312.0
    elif MODE == 3:
        C: tl.constexpr = 1.0
    else:
        C: tl.constexpr = 67108864.0
    out = tl.sum(acc, axis=1) * C  # [8]
    out_row = OUT + s.to(tl.int64) * N
    if GATED:
        if HALVES == 2:
            g = out
            u = tl.sum(acc_h, axis=1) * C
            rg = pid_n * 8 + tl.arange(0, 8)
        else:
            g, u = tl.split(tl.trans(tl.reshape(out, [2, 4])))  # rows 0-3 gate, 4-7 up
            rg = pid_n * 4 + tl.arange(0, 4)
        m = rg < N
        if HAS_BIAS:
            g += tl.load(BIAS1 + e * N + rg, mask=m, other=0.0).to(tl.float32)
            u += tl.load(BIAS2 + e * N + rg, mask=m, other=0.0).to(tl.float32)
        if ACT == 0:  # SiLU(gate) * up
            y = g / (1.0 + tl.exp(-g)) * u
        else:  # gpt-oss: gate clamped above, up both sides, (up + 1) * gate * sigmoid(a*gate)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            y = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
        tl.store(out_row + rg, y.to(OUT.dtype.element_ty), mask=m)
    else:
        if HAS_BIAS:
            out += tl.load(BIAS1 + e * N + rn, mask=n_mask, other=0.0).to(tl.float32)
        if SCALED:
            out = out * tl.load(RW + s).to(tl.float32)
        tl.store(out_row + rn, out.to(OUT.dtype.element_ty), mask=n_mask)
        if HALVES == 2:
            out_h = tl.sum(acc_h, axis=1) * C
            if HAS_BIAS:
                out_h += tl.load(BIAS1 + e * N + rn_h, mask=n_mask_h, other=0.0).to(tl.float32)
            if SCALED:
                out_h = out_h * tl.load(RW + s).to(tl.float32)
            tl.store(out_row + rn_h, out_h.to(OUT.dtype.element_ty), mask=n_mask_h)


@triton.jit
def _route_kernel(L, WOUT, IDS, E, TOP_K: tl.constexpr, KP: tl.constexpr,
                  BLOCK_E: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                  NORM: tl.constexpr):  # fmt: skip
    """Token t = program 0: its E router logits L[t] -> the top-k experts IDS[t] (int32,
    best first) and their weights WOUT[t] (float32), as torch_moe.route computes them:
    SOFTMAX_FIRST: softmax over all E in fp32, the k largest, renormalised to sum 1 when
    NORM; else the k largest logits, softmax over those k. k rounds of max + the lowest
    index holding it (KP: k rounded up to a power of two)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    z = tl.load(L + t * E + offs, mask=m, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        p = tl.exp(z - tl.max(z, axis=0))
        v = tl.where(m, p / tl.sum(p, axis=0), -1.0)
    else:
        v = z
    slot = tl.arange(0, KP)
    vals = tl.zeros([KP], tl.float32)
    ids = tl.zeros([KP], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(v, axis=0)
        idx = tl.min(tl.where(v == best, offs, BLOCK_E), axis=0)
        vals = tl.where(slot == j, best, vals)
        ids = tl.where(slot == j, idx, ids)
        v = tl.where(offs == idx, float("-inf"), v)
    km = slot < TOP_K
    if SOFTMAX_FIRST:
        w = vals
        if NORM:
            w = w / tl.sum(tl.where(km, w, 0.0), axis=0)
    else:  # vals[0] is the largest
        ex = tl.where(km, tl.exp(vals - tl.max(tl.where(km, vals, float("-inf")), axis=0)), 0.0)
        w = ex / tl.sum(ex, axis=0)
    tl.store(WOUT + t * TOP_K + slot, w, mask=km)
    tl.store(IDS + t * TOP_K + slot, ids, mask=km)


def route(logits: torch.Tensor, o) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (weights (N, k) float32, expert ids (N, k) int32) in one
    launch: torch_moe.route's arithmetic without its topk/softmax/copy kernels (~10 a layer
    at batch 1). Ties go to the lower expert index."""
    n, E = logits.shape
    k = o.top_k
    w = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int32, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits.contiguous(), w, ids, E, TOP_K=k, KP=triton.next_power_of_2(k),
            BLOCK_E=triton.next_power_of_2(E), SOFTMAX_FIRST=o.routing == "softmax_topk",
            NORM=o.norm_topk, num_warps=1 if E <= 128 else 4,
        )  # fmt: skip
    return w, ids


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """One projection of every expert, repacked for `_moe_qgemv`: `w` holds E*R rows, expert
    e's at e*R.. (gate/up: [gate_e; up_e], R = 2n; down: R = n); n outputs an expert, k
    inputs."""

    w: QLinear
    n: int
    k: int
    gated: bool


@dataclasses.dataclass(frozen=True)
class ExpertPart:
    """QuantizedWeight.kernel of one stacked projection (gate, up or down) once its layer is
    repacked: the layer's two PackedExperts, and which part of them this projection is.
    weight/scales/biases/nbytes/n/k as a QLinear reports them, for the byte accounting
    (mlxrun/bench.py, Transformer.weight_bytes, evaluate): gate and up share the joint
    repack's arrays (counted once by identity) and each reports half its bytes."""

    gate_up: PackedExperts
    down: PackedExperts
    part: str  # "gate", "up" or "down"

    @property
    def packed(self) -> PackedExperts:
        return self.down if self.part == "down" else self.gate_up

    @property
    def weight(self):
        return self.packed.w.weight

    @property
    def scales(self):
        return self.packed.w.scales

    @property
    def biases(self):
        return self.packed.w.biases

    @property
    def nbytes(self) -> int:
        w = self.packed.w
        return w.nbytes if self.part == "down" else w.nbytes // 2

    @property
    def n(self) -> int:  # rows of this projection over all experts
        return self.packed.w.n if self.part == "down" else self.packed.w.n // 2

    @property
    def k(self) -> int:
        return self.packed.k

    def dense(self, ids: torch.Tensor, dtype) -> torch.Tensor:
        """Experts `ids` (n,) of this projection as dense (n, out, in) (the torch paths)."""
        from mlxrun.quant.triton_kernels import dequantize_torch  # noqa: PLC0415

        p = self.packed
        rows = slice(p.n, 2 * p.n) if self.part == "up" else slice(0, p.n)
        return torch.stack(
            [dequantize_torch(_expert_rows(p, j), dtype)[rows] for j in ids.tolist()]
        )


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


def _prepare(e) -> tuple[PackedExperts, PackedExperts] | None:
    """(gate/up, down) repacked, or None where _moe_qgemv does not apply: dense experts,
    formats without a GEMV (quant/triton_kernels.py: affine 4/8-bit in groups of 32/64/128,
    mxfp4, nvfp4, mxfp8), or rows that do not fill the 8-row scale tiles."""
    ws = (e.gate, e.up, e.down)
    if not all(isinstance(w, QuantizedWeight) and w.weight is not None for w in ws):
        return None
    g, u, d = ws
    fmt = (g.mode, g.bits, g.group_size)
    if any((w.mode, w.bits, w.group_size) != fmt for w in ws) or g.mode not in _MODE_ID:
        return None
    if g.bits not in (4, 8) or (g.mode == "affine" and g.group_size not in (32, 64, 128)):
        return None
    E, I, H = g.shape
    if I % (SCALE_ROWS // 2) or H % SCALE_ROWS:
        return None

    def joined(parts):  # (E, n_i, c) each -> (E * sum n_i, c)
        if parts[0] is None:
            return None
        t = torch.cat([_words(p) for p in parts], dim=1)
        return t.reshape(-1, t.shape[-1])

    gu = prepare(joined([g.weight, u.weight]), joined([g.scales, u.scales]),
                 joined([g.biases, u.biases]), *fmt)  # fmt: skip
    dn = prepare(joined([d.weight]), joined([d.scales]), joined([d.biases]), *fmt)
    return PackedExperts(gu, I, H, True), PackedExperts(dn, H, I, False)


def prepared(e) -> tuple[PackedExperts, PackedExperts] | None:
    """The layer's (gate/up, down) repack, made on its first use (a warm-up pass, before any
    capture). The layer's stored experts are then replaced by it (QuantizedWeights holding
    only an ExpertPart kernel), as TorchBackend.quantized keeps only the repack of a dense
    linear: the packed experts are never held twice. None (nothing replaced) where the
    packed kernel does not apply."""
    k = getattr(e.gate, "kernel", None)
    if isinstance(k, ExpertPart):
        return k.gate_up, k.down
    pair = _prepare(e)
    if pair is None:
        return None
    for name in ("gate", "up", "down"):
        w = getattr(e, name)
        part = ExpertPart(*pair, name)
        setattr(e, name, QuantizedWeight(None, None, None, w.mode, w.bits, w.group_size, part))
    return pair


@dataclasses.dataclass(frozen=True)
class QConfig:
    """_moe_qgemv's launch: warps a program (lanes along K), rows a program, prefetch."""

    warps: int
    block_n: int
    prefetch: bool


def choose_qconfig(p: PackedExperts) -> QConfig:
    """As choose_config picks for a dense GEMV row of x: up to GEMV_WARPS warps while each
    gets 256 words of a row; 16 rows (two halves sharing x) for affine, 8 for the float
    formats (they spill at 16 with one warp); no prefetch for E4M3 with many 4-warp steps."""
    w = p.w
    kw = p.k * w.bits // 32
    warps = 1
    while warps < GEMV_WARPS and 256 * warps <= kw:
        warps *= 2
    ksteps = math.ceil(kw / (128 * warps))
    bn = 16 if w.mode == "affine" else 8
    prefetch = not (w.mode == "mxfp8" and warps > 1 and ksteps > 2)
    return QConfig(warps, bn, prefetch)


def _qlaunch(x, ids, out, rw, p: PackedExperts, b1, b2, x_div, o, scaled, cfg=None):
    cfg = cfg or choose_qconfig(p)
    w = p.w
    kw = p.k * w.bits // 32
    step = 128 * cfg.warps
    ksteps = math.ceil(kw / step)
    per_prog = cfg.block_n // 2 if p.gated else cfg.block_n
    even = p.n % per_prog == 0 and kw % step == 0
    bias = b1 is not None
    grid = (out.shape[0], triton.cdiv(p.n, per_prog))
    _moe_qgemv[grid](
        x, ids, out, rw, w.weight, w.scales, w.biases if w.biases is not None else w.scales,
        b1 if bias else out, b2 if (bias and p.gated) else out, p.n, p.k, x_div,
        o.swiglu_limit, o.swiglu_alpha, MODE=_MODE_ID[w.mode], BITS=w.bits, G=w.group_size,
        GATED=p.gated, ACT=0 if o.act == "silu" else 1, HAS_BIAS=bias, SCALED=scaled,
        BLOCK_N=cfg.block_n, KSTEPS=ksteps, PREFETCH=cfg.prefetch, EVEN=even,
        KWC=kw if even else 0, WARPS=cfg.warps, num_warps=cfg.warps, **pdl_args(x.device),
    )  # fmt: skip


def _parts(w):
    """(mode name, bits, group, weight, scales, biases) of a stacked expert weight."""
    if isinstance(w, QuantizedWeight):
        words = w.weight.view(torch.int32)
        biases = w.biases if w.biases is not None else w.scales
        return w.mode, w.bits, w.group_size, words, w.scales, biases
    return "dense", 32, 1, w, w, w


def _launch(x, ids, out, rw, w1, b1, w2, b2, x_div, o, gated, scaled):
    mode, bits, g, W1, S1, B1 = _parts(w1)
    _, _, _, W2, S2, B2 = _parts(w2) if gated else (None, 0, 0, W1, S1, B1)
    S, N = out.shape
    K = x.shape[-1]
    bias = b1 is not None
    # a k-step reads 128 bytes of each row (one cache line): 32 words of 4- or 8-bit
    # codes, 64 16-bit values (32 float32 ones)
    BLOCK_N, BW = 16, 32 if bits < 32 else 128 // W1.element_size()
    grid = (S, triton.cdiv(N, BLOCK_N))
    _moe_gemv[grid](
        x, ids, out, rw, W1, S1, B1, b1 if bias else out, W2, S2, B2,
        b2 if (bias and gated) else out, N, K, x_div, o.swiglu_limit, o.swiglu_alpha,
        MODE=_MODE[mode], BITS=bits, G=g, GATED=gated, ACT=0 if o.act == "silu" else 1,
        HAS_BIAS=bias, SCALED=scaled, BLOCK_N=BLOCK_N, BW=BW, num_warps=4,
    )  # fmt: skip


@triton.jit
def _moe_tile_dot(acc, x_tile, w_ptr, s_ptr, b_ptr, rn, n_mask, kb, KW, KG,
                  MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
                  BN: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += x_tile [BM, NG*G] @ (rows rn of W, k-step kb)^T: the weight tile
    decoded in registers (fp32, then x's dtype) as _gemm_kernel's per-element path."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    g_idx = kb * NG + tl.arange(0, NG)
    g_mask = g_idx < KG
    w_ptrs = w_ptr + rn[:, None, None] * KW + g_idx[None, :, None] * WPG
    w_ptrs += tl.arange(0, WPG)[None, None, :]
    words = tl.load(w_ptrs, mask=n_mask[:, None, None] & g_mask[None, :, None], other=0)
    s_offs = ((rn // 8) * (KG * 8) + (rn % 8))[:, None] + g_idx[None, :] * 8
    scale, bias = _group_scale(s_ptr, b_ptr, s_offs, n_mask[:, None] & g_mask[None, :], MODE)
    wv = _decode_tile(words.to(tl.uint32, bitcast=True), scale, bias, MODE, BITS, EPW)
    w_tile = tl.reshape(wv, [BN, NG * G])
    if UPCAST:  # the interpreter multiplies bf16 tiles as raw uint16: go through fp32
        return tl.dot(x_tile.to(tl.float32), tl.trans(w_tile), acc)
    if x_tile.dtype == tl.float32:
        return tl.dot(x_tile, tl.trans(w_tile), acc, input_precision="tf32x3")
    return tl.dot(x_tile, tl.trans(w_tile.to(x_tile.dtype)), acc)


@triton.jit
def _moe_grouped(X, IDS, SLOTS, OUT, RW, W, S, B, BIAS1, BIAS2, N, K, X_DIV, limit, alpha,
                 MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                 GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SCALED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                 UPCAST: tl.constexpr):  # fmt: skip
    """Tile t = program 0 of the padded expert-sorted slot list SLOTS (BM entries a tile,
    every tile one expert's, -1 for padding; a tile starting with -1 is past the end):
    OUT[slot, rows] for those slots and BN rows (program 1), as _moe_qgemv computes them,
    each weight tile decoded once for the tile's slots and multiplied on tensor cores."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slots = tl.load(SLOTS + t * BM + tl.arange(0, BM))
    first = tl.max(tl.where(tl.arange(0, BM) == 0, slots, -1), axis=0)
    if first >= 0:
        valid = slots >= 0
        slot = tl.where(valid, slots, 0).to(tl.int64)
        e = tl.load(IDS + first).to(tl.int64)
        EPW: tl.constexpr = 32 // BITS
        KW = K // EPW
        KG = K // G
        if GATED:
            R = 2 * N
        else:
            R = N
        w_ptr = W + e * R * KW
        s_ptr = S + e * R * KG
        b_ptr = B + e * R * KG
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        BK: tl.constexpr = NG * G
        rk = tl.arange(0, BK)
        x_rows = X + (slot // X_DIV)[:, None] * K
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            k_idx = kb * BK + rk
            x_tile = tl.load(x_rows + k_idx[None, :], mask=valid[:, None] & (k_idx < K)[None, :],
                             other=0.0)  # fmt: skip
            acc = _moe_tile_dot(acc, x_tile, w_ptr, s_ptr, b_ptr, rn, n_mask, kb, KW, KG,
                                MODE, BITS, G, NG, BN, UPCAST)  # fmt: skip
            if GATED:  # the up rows, N further on
                acc_u = _moe_tile_dot(acc_u, x_tile, w_ptr, s_ptr, b_ptr, rn + N, n_mask, kb,
                                      KW, KG, MODE, BITS, G, NG, BN, UPCAST)  # fmt: skip
        m2 = valid[:, None] & n_mask[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS1 + e * N + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(BIAS2 + e * N + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            g = acc
            if ACT == 0:
                y = g / (1.0 + tl.exp(-g)) * acc_u
            else:
                g = tl.minimum(g, limit)
                u = tl.minimum(tl.maximum(acc_u, -limit), limit)
                y = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
        else:
            y = acc
            if SCALED:
                y = y * tl.load(RW + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + slot[:, None] * N + rn[None, :], y.to(OUT.dtype.element_ty), mask=m2)


GROUPED_BM = 16  # slots a tile: the tensor cores' narrowest M


def _slot_tiles(flat: torch.Tensor, num_experts: int, bm: int) -> torch.Tensor:
    """Slots (S,) int32 expert ids -> the padded expert-sorted slot list (P,) int32: each
    expert's slots in order, padded with -1 to a multiple of bm, experts in order, then -1 to
    P = S + E*(bm-1) rounded up to bm (the most any routing needs). Static shapes, no host
    sync: capturable."""
    S = flat.numel()
    dev = flat.device
    e = flat.long()
    order = torch.argsort(e, stable=True)
    se = e[order]
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, e, torch.ones_like(e))
    start = torch.cumsum(counts, 0) - counts
    padded = (counts + bm - 1) // bm * bm
    pstart = torch.cumsum(padded, 0) - padded
    pos = pstart[se] + torch.arange(S, device=dev) - start[se]
    total = (S + num_experts * (bm - 1) + bm - 1) // bm * bm
    out = torch.full((total,), -1, dtype=torch.int32, device=dev)
    out[pos] = order.to(torch.int32)
    return out


def _glaunch(x, ids, tiles, out, rw, p: PackedExperts, b1, b2, x_div, o, scaled):
    w = p.w
    bias = b1 is not None
    bn = 64
    ng = max(1, 64 // w.group_size)
    grid = (tiles.numel() // GROUPED_BM, triton.cdiv(p.n, bn))
    _moe_grouped[grid](
        x, ids, tiles, out, rw, w.weight, w.scales,
        w.biases if w.biases is not None else w.scales, b1 if bias else out,
        b2 if (bias and p.gated) else out, p.n, p.k, x_div, o.swiglu_limit, o.swiglu_alpha,
        MODE=_MODE_ID[w.mode], BITS=w.bits, G=w.group_size, GATED=p.gated,
        ACT=0 if o.act == "silu" else 1, HAS_BIAS=bias, SCALED=scaled, BM=GROUPED_BM, BN=bn,
        NG=ng, UPCAST=x.device.type != "cuda", num_warps=4,
    )  # fmt: skip


def grouped_wins(slots: int, o) -> bool:
    """Whether the grouped kernel runs a decode step: where the experts hit get two or more
    slots each on average (each weight tile then decoded once for several slots, against
    once a slot). A guess, not yet timed (benchmarks/moe_kernels.py --path)."""
    return slots >= 2 * o.num_experts


def _expert_rows(p: PackedExperts, j: int) -> QLinear:
    """Expert j's rows of a PackedExperts as a QLinear of its own (views, no copy)."""
    w = p.w
    r = 2 * p.n if p.gated else p.n
    t = r // SCALE_ROWS
    b = None if w.biases is None else w.biases[j * t : (j + 1) * t]
    return dataclasses.replace(w, weight=w.weight[j * r : (j + 1) * r],
                               scales=w.scales[j * t : (j + 1) * t], biases=b, n=r)  # fmt: skip


def moe_grouped(x, ids, weights, e, o):
    """Many slots (prefill): x (T, H), ids (T, k), routing weights (T, k) -> (T, H).

    Slots sorted by expert; each expert that was hit runs as two quantized matmuls over its
    tokens (qmatmul: the tensor-core GEMM that decodes weight tiles in registers, past 4
    rows), so its packed weights are read once and never expanded to a dense copy. One host
    sync (the counts): for prefill, not for a captured decode step. Needs `prepared(e)`."""
    from .torch_moe import expert_act  # noqa: PLC0415

    gu, dn = prepared(e)
    T, H = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=o.num_experts).tolist()
    xs = x[order // k]
    rw = weights.reshape(-1).float()[order]
    out = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    start = 0
    for j, c in enumerate(counts):
        if not c:
            continue
        sl = slice(start, start + c)
        start += c
        y = qmatmul(xs[sl], _expert_rows(gu, j))  # (c, 2I): gate, then up
        g, u = y[:, : gu.n], y[:, gu.n :]
        if e.gate_bias is not None:
            g, u = g + e.gate_bias[j], u + e.up_bias[j]
        d = qmatmul(expert_act(g, u, o), _expert_rows(dn, j), out_dtype=torch.float32)
        if e.down_bias is not None:
            d = d + e.down_bias[j]
        out[sl] = d * rw[sl, None]
    y = torch.empty_like(out)
    y[order] = out
    return y.view(T, k, H).sum(dim=1).to(x.dtype)


def moe_experts(x, ids, weights, e, o, grouped: bool | None = None):
    """x (T, H), ids (T, k) int, routing weights (T, k) -> (T, H): the top-k experts of
    every token, weighted and summed, in two launches. Packed experts: per slot
    (_moe_qgemv), or grouped by expert (_moe_grouped) where `grouped` (None: grouped_wins)."""
    T, H = x.shape
    k = ids.shape[1]
    x = x.contiguous()
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty((T * k, o.intermediate_size), dtype=x.dtype, device=x.device)
    y = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    packed = prepared(e)
    if packed is None:
        _launch(x, flat, h, rw, e.gate, e.gate_bias, e.up, e.up_bias, k, o, True, False)
        _launch(h, flat, y, rw, e.down, e.down_bias, None, None, 1, o, False, True)
    elif grouped if grouped is not None else grouped_wins(T * k, o):
        gu, dn = packed
        tiles = _slot_tiles(flat, o.num_experts, GROUPED_BM)
        _glaunch(x, flat, tiles, h, rw, gu, e.gate_bias, e.up_bias, k, o, False)
        _glaunch(h, flat, tiles, y, rw, dn, e.down_bias, None, 1, o, True)
    else:
        gu, dn = packed
        _qlaunch(x, flat, h, rw, gu, e.gate_bias, e.up_bias, k, o, False)
        _qlaunch(h, flat, y, rw, dn, e.down_bias, None, 1, o, True)
    return y.view(T, k, H).sum(dim=1).to(x.dtype)
