"""The Triton kernels of mixture-of-experts on CUDA; backends/cuda_moe.py launches them.

- `_moe_qgemv`: one slot (token, j) a program, packed experts, the dense GEMV's k-step
  (quant/triton_kernels.py) on the expert's rows found from the slot's id;
- `_moe_grouped`: one expert's tile of up to 16 slots a program, its weight tile decoded
  once and multiplied on tensor cores (decode batches);
- `_moe_gemv`: one slot a program, dense (or canonical packed) experts read as stored;
- `_route_kernel`: a token's top-k experts and their weights;
- `_router_kernel`: the router's linear and the routing in one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mlxrun.backends.cuda_ops import _dense_first_block, _dense_k_loop
from mlxrun.quant.triton_decode import _group_scale, _split_sum
from mlxrun.quant.triton_gemm import _decode_tile
from mlxrun.quant.triton_gemv import _gemv_ksteps, _gemv_lanes, _gemv_sum
from mlxrun.quant.triton_launch import tlc


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
    # one return at the end: Triton compiles the code after a constexpr-true `if ...: return`
    # too, and the shifts below do not type-check on a dense (float) W
    if MODE == 0:
        w = tl.load(W + base * KW + wi[None, :], mask=m2, other=0.0)
        out = w.to(tl.float32)[:, :, None]
    else:
        word = tl.load(W + base * KW + wi[None, :], mask=m2, other=0)
        q = (word[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        WPG: tl.constexpr = G // PER  # words a group
        gi = base * KG + (wi // WPG)[None, :]
        if MODE == 1:  # affine: scale * q + bias
            sc = tl.load(S + gi, mask=m2, other=0.0).to(tl.float32)[:, :, None]
            b = tl.load(B + gi, mask=m2, other=0.0).to(tl.float32)[:, :, None]
            out = q.to(tl.float32) * sc + b
        else:
            code = tl.load(S + gi, mask=m2, other=0).to(tl.int32)
            if MODE == 3:  # nvfp4: E4M3 scale
                scale = _e4m3(code)
            else:  # E8M0: a power of two
                scale = tl.exp2((code - 127).to(tl.float32))
            if MODE == 4:
                out = _e4m3(q) * scale[:, :, None]
            else:
                out = _e2m1(q) * scale[:, :, None]
    return out


@triton.jit
def _moe_gemv(X, IDS, OUT, RW, W1, S1, B1, BIAS1, W2, S2, B2, BIAS2, N, K, X_DIV, limit, alpha,
              MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, GATED: tl.constexpr,
              ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
              BLOCK_N: tl.constexpr, BW: tl.constexpr, PART=None, CNT=None,
              TOP_K: tl.constexpr = 0):  # fmt: skip
    """OUT[s, rows] for slot s = program 0: x = X[s // X_DIV] (K,), expert IDS[s].
    GATED: act(x @ W1[e]^T + b1) * (x @ W2[e]^T + b2); else x @ W1[e]^T + b1, times RW[s]
    when SCALED. A k-step covers BW words (BW * PER inputs) of each of BLOCK_N rows.
    TOP_K > 0 (not GATED): the token's k slots summed in the kernel, OUT (T, N) (_slot_sum)."""
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
        y = _gated_act(acc1, acc2, limit, alpha, ACT)
    if SCALED:
        y = y * tl.load(RW + s).to(tl.float32)
    if TOP_K > 0:
        _slot_sum(y, rows, rmask, s, tl.program_id(1), tl.num_programs(1), N, OUT, PART, CNT,
                  TOP_K)  # fmt: skip
    else:
        tl.store(OUT + s.to(tl.int64) * N + rows, y.to(OUT.dtype.element_ty), mask=rmask)


@triton.jit
def _moe_qgemv(X, IDS, OUT, RW, W, S, B, BIAS1, BIAS2, N, K, X_DIV, limit, alpha,
               MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, GATED: tl.constexpr,
               ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
               BLOCK_N: tl.constexpr, KSTEPS: tl.constexpr, PREFETCH: tl.constexpr,
               EVEN: tl.constexpr, KWC: tl.constexpr, WARPS: tl.constexpr,
               PART=None, CNT=None, TOP_K: tl.constexpr = 0,
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
    TOP_K > 0 (not GATED): the token's k slots summed in the kernel, OUT (T, N) (_slot_sum).
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
    # the lanes' x inputs and groups and the k-loop, as _gemv_kernel's (the wait is above)
    x_pair0, g_pair, g_a, g_b = _gemv_lanes(lane, G, WPG, TWO)
    x_base = X + (s // X_DIV).to(tl.int64) * K
    acc, acc_h = _gemv_ksteps(w_ptr, rn, rn_h, n_mask, n_mask_h, rkw, 0, KW, x_base, x_pair0,
                              g_pair, g_a, g_b, s_row, s_row_h, s_ptr, b_ptr, KG, MODE, BITS, G,
                              HALVES, EVEN, LANES, KSTEPS, PREFETCH, False)  # fmt: skip
    out = _gemv_sum(acc, MODE)  # [8]
    out_row = OUT + s.to(tl.int64) * N
    if GATED:
        _gated_store(out, acc_h, pid_n, e, N, out_row, BIAS1, BIAS2, limit, alpha, MODE,
                     ACT, HAS_BIAS, HALVES)  # fmt: skip
    else:
        if HAS_BIAS:
            out += tl.load(BIAS1 + e * N + rn, mask=n_mask, other=0.0).to(tl.float32)
        if SCALED:
            out = out * tl.load(RW + s).to(tl.float32)
        if HALVES == 2:
            out_h = _gemv_sum(acc_h, MODE)
            if HAS_BIAS:
                out_h += tl.load(BIAS1 + e * N + rn_h, mask=n_mask_h, other=0.0).to(tl.float32)
            if SCALED:
                out_h = out_h * tl.load(RW + s).to(tl.float32)
        if TOP_K > 0:
            if HALVES == 2:  # rows rn, then rn_h = rn + 8: one tile of 16
                out = tl.reshape(tl.trans(tl.join(out, out_h)), [16])
            rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _slot_sum(out, rows, rows < N, s, pid_n, tl.num_programs(1), N, OUT, PART, CNT,
                      TOP_K)  # fmt: skip
        else:
            tl.store(out_row + rn, out.to(OUT.dtype.element_ty), mask=n_mask)
            if HALVES == 2:
                tl.store(out_row + rn_h, out_h.to(OUT.dtype.element_ty), mask=n_mask_h)


@triton.jit
def _gated_store(out, acc_h, pid_n, e, N, out_row, BIAS1, BIAS2, limit, alpha,
                 MODE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HALVES: tl.constexpr):  # fmt: skip
    """The gate/up epilogue of row tile pid_n: out [8] the summed first half (HALVES 2: 8
    gate rows, acc_h their up rows' lanes; 1: rows 0-3 gate, 4-7 up) of expert e -> the
    activation of its BLOCK_N // 2 outputs (+ the expert's biases) at out_row."""
    if HALVES == 2:
        g = out
        u = _gemv_sum(acc_h, MODE)
        rg = pid_n * 8 + tl.arange(0, 8)
    else:
        g, u = tl.split(tl.trans(tl.reshape(out, [2, 4])))  # rows 0-3 gate, 4-7 up
        rg = pid_n * 4 + tl.arange(0, 4)
    m = rg < N
    if HAS_BIAS:
        g += tl.load(BIAS1 + e * N + rg, mask=m, other=0.0).to(tl.float32)
        u += tl.load(BIAS2 + e * N + rg, mask=m, other=0.0).to(tl.float32)
    y = _gated_act(g, u, limit, alpha, ACT)
    tl.store(out_row + rg, y.to(out_row.dtype.element_ty), mask=m)


@triton.jit
def _gated_act(g, u, limit, alpha, ACT: tl.constexpr):
    """The gated experts' act(gate) * up: SiLU (ACT 0), or gpt-oss's: gate clamped above at
    limit, up both sides, (up + 1) * gate * sigmoid(alpha * gate)."""
    if ACT == 0:
        y = g / (1.0 + tl.exp(-g)) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
    return y


@triton.jit
def _slot_sum(y, rows, mask, s, pid_n, n_tiles, N, OUT, PART, CNT, TOP_K: tl.constexpr):
    """Slot s's weighted outputs y at `rows` of its token t = s // TOP_K, summed over the
    token's TOP_K slots: y goes to PART (S, N) float32 and the (t, row tile) ticket is taken
    (_split_sum, as split-K's partials); the last of the TOP_K programs adds the partials in
    slot order and writes OUT[t, rows] in OUT's dtype. No sum or cast launch after the
    kernel, and the tickets are back at 0 for the next launch."""
    t = s // TOP_K
    p_ptrs = PART + (t * TOP_K).to(tl.int64) * N + rows
    last, total = _split_sum(y, p_ptrs, mask, CNT, t * n_tiles + pid_n, s % TOP_K, N, TOP_K)
    if last:
        tl.store(OUT + t.to(tl.int64) * N + rows, total.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _route_kernel(L, WOUT, IDS, E, TOP_K: tl.constexpr, KP: tl.constexpr,
                  BLOCK_E: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                  NORM: tl.constexpr, PACKED: tl.constexpr = False,
                  PDL: tl.constexpr = False):  # fmt: skip
    """Token t = program 0: its E router logits L[t] -> the top-k experts IDS[t] (int32,
    best first) and their weights WOUT[t] (float32), as torch_moe.route computes them
    (_topk_store). PDL: the logits come from the router's linear; the expert kernels after
    this one wait for it in turn."""
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    z = tl.load(L + t * E + offs, mask=m, other=float("-inf")).to(tl.float32)
    _topk_store(z, m, offs, WOUT + t * TOP_K, IDS + t * TOP_K, TOP_K, KP, BLOCK_E,
                SOFTMAX_FIRST, NORM, PACKED)  # fmt: skip


@triton.jit
def _key(v):
    """float32 -> int32 in the same order (-0.0 just below +0.0; no NaNs)."""
    bits = v.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    """_key's inverse."""
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _topk_store(z, m, offs, WOUT, IDS, TOP_K: tl.constexpr, KP: tl.constexpr,
                BLOCK_E: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, NORM: tl.constexpr,
                PACKED: tl.constexpr = False):  # fmt: skip
    """One token's logits z [BLOCK_E] float32 (-inf past E, m = offs < E) -> its top-k
    expert ids IDS[0:k] and weights WOUT[0:k]: SOFTMAX_FIRST: softmax over all E in fp32,
    the k largest, renormalised to sum 1 when NORM; else the k largest logits, softmax over
    those k. Larger first, ties to the lower index (KP: k rounded up to a power of two):
    k rounds of max + the lowest index holding it (PACKED: the max over the values'
    order-preserving int32 bits, integer reductions both). (Ranks from one E x E
    comparison, three reductions in all, were slower on an H200: 7.8 against 3.4 us for
    qwen3's 128 experts.)"""
    if SOFTMAX_FIRST:
        if PACKED:
            zmax = _unkey(tl.max(_key(z), axis=0))
        else:
            zmax = tl.max(z, axis=0)
        p = tl.exp(z - zmax)
        v = tl.where(m, p / tl.sum(p, axis=0), -1.0)
    else:
        v = z
    slot = tl.arange(0, KP)
    vals = tl.zeros([KP], tl.float32)
    ids = tl.zeros([KP], tl.int32)
    if PACKED:  # int32 keys (the floats' order-preserving bits): both reductions of a round
        # are 32-bit integer ones, one redux.sync each on a warp, where a float max is 5
        # shuffles (sm_90: the route kernel's 53 SHFL at 128 experts, top-8)
        key = _key(v)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, axis=0)
            idx = tl.min(tl.where(key == best, offs, BLOCK_E), axis=0)
            vals = tl.where(slot == j, _unkey(best), vals)
            ids = tl.where(slot == j, idx, ids)
            key = tl.where(offs == idx, -2147483648, key)  # below every float's key
    else:
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
    tl.store(WOUT + slot, w, mask=km)
    tl.store(IDS + slot, ids, mask=km)


@triton.jit
def _router_kernel(X, W, BIAS, L, WOUT, IDS, CNT, E, K, HAS_BIAS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                   ONE_STEP: tl.constexpr, TOP_K: tl.constexpr,
                   KP: tl.constexpr, BLOCK_E: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                   NORM: tl.constexpr, PACKED: tl.constexpr = False,
                   PDL: tl.constexpr = False):  # fmt: skip
    """The router's linear and the routing in one launch. Program (token t, BLOCK_N rows of
    the router W (E, K)): the rows' logits x[t] @ W^T as cuda_ops.dense_gemv computes them
    (the same tiles and sums, rounded to x's dtype, then + bias rounded again, as the linear
    and its bias add round them), stored to L[t]; the token's ticket is taken (CNT[t]) and
    the last of its programs reads the E logits back and routes them (_topk_store, as
    _route_kernel), resetting the ticket for the next launch. PDL: the weights are loaded
    before waiting for x. EVEN: whole row blocks and K blocks (no masks); ONE_STEP: K fits
    one block."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < E
    w, w_ptrs, rk = _dense_first_block(W, rn, n_ok, K, K, BLOCK_K, EVEN, PDL)
    x_row = X + t.to(tl.int64) * K
    if ONE_STEP:  # K <= BLOCK_K: no next block in flight (its registers made ptxas spill)
        if EVEN:
            x = tl.load(x_row + rk)
        else:
            x = tl.load(x_row + rk, mask=rk < K, other=0.0)
        acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    else:
        acc = _dense_k_loop(w, w_ptrs, x_row, rk, n_ok, K, BLOCK_N, BLOCK_K, EVEN)
    z = tl.sum(acc, axis=1).to(L.dtype.element_ty)
    if HAS_BIAS:
        b = tl.load(BIAS + rn, mask=n_ok, other=0.0)
        z = (z.to(tl.float32) + b.to(tl.float32)).to(L.dtype.element_ty)
    l_row = L + t.to(tl.int64) * E
    tl.store(l_row + rn, z, mask=n_ok)
    tl.debug_barrier()  # every thread's logits are issued before the ticket is taken
    ticket = tl.atomic_add(CNT + t, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:
        tl.atomic_xchg(CNT + t, 0, sem="relaxed", scope="gpu")
        offs = tl.arange(0, BLOCK_E)
        m = offs < E
        zz = tl.load(l_row + offs, mask=m, other=float("-inf"), cache_modifier=".cg")
        _topk_store(zz.to(tl.float32), m, offs, WOUT + t * TOP_K, IDS + t * TOP_K, TOP_K, KP,
                    BLOCK_E, SOFTMAX_FIRST, NORM, PACKED)  # fmt: skip


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
            y = _gated_act(acc, acc_u, limit, alpha, ACT)
        else:
            y = acc
            if SCALED:
                y = y * tl.load(RW + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + slot[:, None] * N + rn[None, :], y.to(OUT.dtype.element_ty), mask=m2)
