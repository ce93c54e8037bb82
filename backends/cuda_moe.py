"""Triton kernels for mixture-of-experts decode on CUDA: every token slot's expert in one
launch per projection, reading only the selected experts' bytes.

Slots are (token, j) pairs, j < top_k. One program computes BLOCK_N output rows of one slot:
it reads its expert id, streams that expert's rows of the stacked weight (E, N, K) --
dense, or packed in the canonical format (uint32 words along K, scales/biases per group of
G inputs; every mode the loader keeps: affine 4/8-bit, mxfp4, nvfp4, mxfp8) -- and dots
them with the slot's input row. Two launches a layer:
- gate and up together, the gate's activation (SiLU, or gpt-oss's clamped SwiGLU) in the
  epilogue: h (S, I);
- down, scaled by the slot's routing weight in the epilogue: (S, H), summed over j by torch.
No host sync, so the decode step stays capturable in a CUDA graph at any batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlxrun.backends.base import QuantizedWeight

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


def moe_experts(x, ids, weights, e, o):
    """x (T, H), ids (T, k) int, routing weights (T, k) -> (T, H): the top-k experts of
    every token, weighted and summed, in two launches."""
    T, H = x.shape
    k = ids.shape[1]
    x = x.contiguous()
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty((T * k, o.intermediate_size), dtype=x.dtype, device=x.device)
    _launch(x, flat, h, rw, e.gate, e.gate_bias, e.up, e.up_bias, k, o, True, False)
    y = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    _launch(h, flat, y, rw, e.down, e.down_bias, None, None, 1, o, False, True)
    return y.view(T, k, H).sum(dim=1).to(x.dtype)
