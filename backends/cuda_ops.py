"""Fused Triton kernels for the small per-layer operations of the PyTorch CUDA backend.

At batch-1 decode a layer's seven matrix-vector products stream the weights; everything else
(two RMSNorms, rotary embedding of q and k, SiLU-multiply, two residual adds) moves a few KB
but, written as stock PyTorch ops, took ~40 kernel launches per layer, each ~2 us even when
replayed from a CUDA graph: about as long as reading the bf16 weights. Each kernel here and
in cuda_attention.py (rotary embedding with the KV-cache store, decode attention) does one of
those steps in one launch. They round where the PyTorch ops (and transformers) round, so the
CUDA backend computes what the CPU backend computes, to float rounding. Beside them: the
quantized embedding gather, the graph decode's position step, a split argmax and a dense
batch-1 GEMV.

Without a GPU they run under TRITON_INTERPRET=1, which is how the tests check them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mlxrun.quant.triton_kernels import (
    _MODE_ID,
    _counters,
    _group_scale,
    _silu_store,
    pdl_args,
    tlc,
)

# With programmatic dependent launch (triton_kernels.pdl) each kernel below waits for the
# previous one before it reads anything (the norm weight and the GEMV's weights aside), then
# lets the next one launch.


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    y_ptr,
    w_ptr,
    h_out_ptr,
    x_out_ptr,
    n,
    eps,
    HAS_Y: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)  # rows x n passes 2^31 at large batch prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no wait
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    h = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_Y:
        # the residual sum is rounded to the model dtype, as `h + y` is; an fp32 y (a
        # tensor-parallel sum) is first rounded as one device's product is
        y = tl.load(y_ptr + row * n + cols, mask=mask, other=0.0).to(h_ptr.dtype.element_ty)
        h = (h.to(tl.float32) + y.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * n + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(h32 * h32, axis=0) / n + eps)
    # normalise in fp32, round once, then multiply by the weight (transformers' order)
    xn = (h32 * r).to(x_out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(x_out_ptr + row * n + cols, (xn * w).to(x_out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float):
    """(h + y, rms_norm(h + y) * w); with y None, (h, rms_norm(h) * w). Rows of the last dim."""
    n = h.shape[-1]
    h = h.contiguous()
    x = torch.empty_like(h)
    h_new = torch.empty_like(h) if y is not None else h
    rows = h.numel() // n
    _add_rms_norm_kernel[(rows,)](
        h,
        y.contiguous() if y is not None else h,
        w,
        h_new,
        x,
        n,
        eps,
        HAS_Y=y is not None,
        BLOCK=triton.next_power_of_2(n),
        num_warps=4 if n <= 4096 else 8,
        **pdl_args(h.device),
    )
    return h_new, x


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, sg, su, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):  # fmt: skip
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)  # a joint gate/up row stride x rows passes 2^31
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + row * sg + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + offs, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu rounds before the multiply
    tl.store(out_ptr + row * n + offs, (silu * u).to(dt), mask=m)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. gate and up may be column slices of one (..., 2n) tensor (the joint
    gate/up product): read in place, not copied out first."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    BLOCK = 1024
    grid = (g.shape[0], triton.cdiv(n, BLOCK))
    _silu_mul_kernel[grid](
        g, u, out, n, g.stride(0), u.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_args(g.device)
    )
    return out


@triton.jit
def _embed_kernel(ids_ptr, w_ptr, s_ptr, b_ptr, out_ptr, KW, KG, MODE: tl.constexpr,
                  BITS: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):  # fmt: skip
    # program (token, block of BLOCK words of its row): code i of word j is element
    # j*32/BITS + i, dequantized as torch_dequant.dequantize does (fp32, then rounded once)
    if PDL:
        tlc.gdc_wait()  # the ids are the previous step's argmax
        tlc.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    wo = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = wo < KW
    r = tl.load(ids_ptr + t).to(tl.int64)
    words = tl.load(w_ptr + r * KW + wo, mask=ok, other=0).to(tl.uint32, bitcast=True)
    EPW: tl.constexpr = 32 // BITS
    for i in tl.static_range(EPW):
        c = (words >> (BITS * i)) & ((1 << BITS) - 1)
        if MODE == 0:
            v = c.to(tl.float32)
        elif MODE == 3:  # E4M3 by the hardware conversion
            v = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:  # E2M1 code (canonical nibble) -> value * 2^-126 as float bits, times 2^126
            f = ((c << 22) & 0x01C00000) | ((c << 28) & 0x80000000)
            v = f.to(tl.float32, bitcast=True) * 8.507059173023462e37
        e = wo * EPW + i
        s, b = _group_scale(s_ptr, b_ptr, r * KG + e // G, ok, MODE)
        if MODE == 0:
            v = v * s + b  # two roundings, as torch's mul_ then add_ (launched without FMA)
        else:
            v = v * s
        tl.store(out_ptr + t * KW * EPW + e, v.to(out_ptr.dtype.element_ty), mask=ok)


def embed_rows(ids: torch.Tensor, w, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids (B, T) of a packed table (QuantizedWeight: weight (V, K*bits/32), scales,
    biases row-major) -> (B, T, K) in `dtype`, as torch_dequant.dequantize gives them. One
    launch: the gathers and element-wise ops of the torch version were ~9 kernels of each
    decode step."""
    kw = w.weight.shape[1]
    k = kw * 32 // w.bits
    out = torch.empty((*ids.shape, k), dtype=dtype, device=ids.device)
    n = ids.numel()
    if n == 0:
        return out
    BLOCK = 256
    biases = w.biases if w.biases is not None else w.scales
    _embed_kernel[(n, triton.cdiv(kw, BLOCK))](
        ids.contiguous(), w.weight.view(torch.int32), w.scales, biases, out, kw, k // w.group_size,
        MODE=_MODE_ID[w.mode], BITS=w.bits, G=w.group_size, BLOCK=BLOCK, num_warps=4,
        enable_fp_fusion=False, **pdl_args(ids.device),
    )  # fmt: skip
    return out


@triton.jit
def _embed_shard_kernel(ids_ptr, w_ptr, out_ptr, start, rows, K, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
    # program (token, block of its row): the table's row id - start in fp32, zeros where the
    # id is another rank's
    if PDL:
        tlc.gdc_wait()  # the ids are the previous step's argmax
        tlc.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(ids_ptr + t).to(tl.int64) - start
    inside = (offs * 0 + r >= 0) & (offs * 0 + r < rows)  # tensors: the interpreter's wish
    v = tl.load(w_ptr + tl.where(inside, r, 0) * K + offs, mask=inside & (offs < K), other=0.0)
    tl.store(out_ptr + t * K + offs, v.to(tl.float32), mask=offs < K)


def embed_shard(ids: torch.Tensor, w: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows ids (..., ) of a table split by vocabulary (w: rows [start, start + rows) of it,
    dense) -> (..., K) float32, zeros for the ids outside: this rank's term of the sum over
    ranks, in one launch (torch's masked lookup was ~7 kernels a decode step)."""
    k = w.shape[-1]
    out = torch.empty((*ids.shape, k), dtype=torch.float32, device=ids.device)
    n = ids.numel()
    if n:
        BLOCK = 1024
        _embed_shard_kernel[(n, triton.cdiv(k, BLOCK))](
            ids.contiguous(), w, out, start, rows, k, BLOCK=BLOCK, num_warps=4,
            **pdl_args(ids.device),
        )  # fmt: skip
    return out


@triton.jit
def _graph_advance_kernel(pos_ptr, pads_ptr, key_ok_ptr, mask_ptr, positions_ptr, B, L,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    b = tl.arange(0, BLOCK)
    ok = b < B
    p = tl.load(pos_ptr) + 1
    tl.store(positions_ptr + b, p - tl.load(pads_ptr + b, mask=ok), mask=ok)
    ok = ok & (b * 0 + p < L)  # a tensor compare: the interpreter rejects a scalar one here
    tl.store(mask_ptr + b * L + p, tl.load(key_ok_ptr + b * L + p, mask=ok), mask=ok)
    tl.debug_barrier()  # every thread has read pos
    tl.store(pos_ptr, p)


def graph_advance(pos, pads, key_ok, mask, positions) -> None:
    """A graph-mode StaticCache one position on, in one launch: pos += 1, the rope positions
    (B, 1) = pos - pads, and the new slot of the attention mask (B, L) = key_ok's."""
    B, L = key_ok.shape
    assert mask.is_contiguous() and key_ok.is_contiguous() and positions.is_contiguous()
    _graph_advance_kernel[(1,)](
        pos, pads, key_ok.view(torch.uint8), mask.view(torch.uint8), positions, B, L,
        BLOCK=triton.next_power_of_2(B), num_warps=1, **pdl_args(pos.device),
    )  # fmt: skip


@triton.jit
def _argmax_kernel(x_ptr, val_ptr, idx_ptr, bad_ptr, cnt_ptr, out_ptr, ok_ptr, V, stride,
                   BLOCK: tl.constexpr, NB: tl.constexpr, FINITE: tl.constexpr,
                   PDL: tl.constexpr = False):  # fmt: skip
    # program (row, block): the max of BLOCK logits and its first index; the last block of
    # the row to finish (atomic ticket) reduces the blocks' results and writes the row's.
    # FINITE: also whether the row has no NaN or inf (finite_rows' flag, without torch's
    # isfinite pass and its one-block reduction over the vocabulary).
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nblk = tl.num_programs(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    big = tl.max(x, axis=0)
    first = tl.min(tl.where(x == big, offs, V), axis=0)  # ties: the first index, as torch
    tl.store(val_ptr + row * nblk + blk, big)
    tl.store(idx_ptr + row * nblk + blk, first)
    if FINITE:
        bad = ((x != x) | (tl.abs(x) == float("inf"))) & (offs < V)
        tl.store(bad_ptr + row * nblk + blk, tl.sum(bad.to(tl.int32), axis=0))
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == nblk - 1:
        r = tl.arange(0, NB)
        ok = r < nblk
        vals = tl.load(val_ptr + row * nblk + r, mask=ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(idx_ptr + row * nblk + r, mask=ok, other=V, cache_modifier=".cg")
        best = tl.max(vals, axis=0)
        # NaN logits match no index (V): clamp, so the next step's embedding stays in range
        # (generate checks finite_rows and stops)
        top = tl.minimum(tl.min(tl.where(vals == best, idxs, V), axis=0), V - 1)
        tl.store(out_ptr + row, top.to(tl.int64))
        if FINITE:
            bads = tl.load(bad_ptr + row * nblk + r, mask=ok, other=0, cache_modifier=".cg")
            tl.store(ok_ptr + row, (tl.sum(bads, axis=0) == 0).to(tl.int8))
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None,
           ok: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """logits (B, V) -> (B,) int64 (into `out` if given), the first index of each row's
    maximum (torch.argmax's answer for finite logits). torch's CUDA argmax reduces a 128k
    vocabulary row in one block (~37 us at batch 1 on an H100); this spreads it over ~32
    programs per row. ok: a (B,) bool tensor that gets finite_rows(logits) in the same
    launch."""
    B, V = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    BLOCK = 4096
    nb = triton.cdiv(V, BLOCK)
    val = torch.empty((B, nb), dtype=torch.float32, device=x.device)
    idx = torch.empty((B, nb), dtype=torch.int32, device=x.device)
    if out is None:
        out = torch.empty((B,), dtype=torch.int64, device=x.device)
    assert out.shape == (B,) and out.dtype == torch.int64 and out.is_contiguous()
    if ok is not None:
        assert ok.shape == (B,) and ok.dtype == torch.bool and ok.is_contiguous()
    bad = torch.empty((B, nb), dtype=torch.int32, device=x.device) if ok is not None else idx
    _argmax_kernel[(B, nb)](
        x, val, idx, bad, _counters(x.device, B), out, out if ok is None else ok.view(torch.int8),
        V, x.stride(0), BLOCK=BLOCK, NB=triton.next_power_of_2(nb), FINITE=ok is not None,
        num_warps=4, **pdl_args(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _dense_first_block(w_ptr, rn, n_ok, K, stride_wn, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                       PDL: tl.constexpr):  # fmt: skip
    """(w, w_ptrs, rk): the first K block [BLOCK_N, BLOCK_K] of rows rn of W, loaded before
    the PDL wait (x is the previous kernel's output, the weights are not), for
    _dense_k_loop."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    if EVEN:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    return w, w_ptrs, rk


@triton.jit
def _dense_k_loop(w, w_ptrs, x_row, rk, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN: tl.constexpr):  # fmt: skip
    """The fp32 products of BLOCK_N rows of W with x_row [K], summed over the K blocks a
    lane at a time ([BLOCK_N, BLOCK_K]; the caller sums the lanes): w is the rows' first
    block (loaded at w_ptrs, before the PDL wait), and each next block's words are in flight
    while this one's FMAs run. Shared by the dense GEMV and the MoE router kernel, whose
    logits must be the GEMV's bit for bit. EVEN: whole row blocks and K blocks (no masks)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kn = k + BLOCK_K
        if EVEN:
            w_next = tl.load(w_ptrs + tl.minimum(kn, K - BLOCK_K))
            x = tl.load(x_row + k + rk)
        else:
            w_next = tl.load(w_ptrs + kn, mask=n_ok[:, None] & (kn + rk < K)[None, :], other=0.0)
            x = tl.load(x_row + k + rk, mask=k + rk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w = w_next
    return acc


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_xm, stride_ym, stride_wn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                       SILU: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    # program (row m of x, BLOCK_N rows of W): each thread streams a contiguous run of K of
    # every row (16-byte loads), the next block's words in flight while this one's FMAs run
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if SILU:  # rows: BLOCK_N/2 gate rows and their up rows, N/2 further on
        H: tl.constexpr = BLOCK_N // 2
        r = tl.arange(0, BLOCK_N)
        rg = pid_n * H + r % H
        rn = rg + (r // H) * (N // 2)
        n_ok = rg < N // 2
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
    w, w_ptrs, rk = _dense_first_block(w_ptr, rn, n_ok, K, stride_wn, BLOCK_K, EVEN, PDL)
    acc = _dense_k_loop(w, w_ptrs, x_ptr + m * stride_xm, rk, n_ok, K, BLOCK_N, BLOCK_K, EVEN)
    out = tl.sum(acc, axis=1)
    if SILU:
        g, u = tl.split(tl.trans(tl.reshape(out, [2, H])))
        ry = pid_n * H + tl.arange(0, H)
        _silu_store(g, u, y_ptr + m * stride_ym + ry, ry < N // 2)
    else:
        tl.store(y_ptr + m * stride_ym + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)


# Launch settings (rows, warps, vec) of dense_gemv by weight shape (N the weight's rows: gate
# and up together for the SiLU one), where a GPU's sweep (benchmarks/dense_gemv_sweep.py 1,2
# small) beat the defaults and the model's decode gained with them. H200, Llama-3-8B bf16,
# batch 1: TP 1 239.0 -> 242.9 tok/s, TP 2 (the shapes halved) 364.0 -> 385.9.
_DENSE_TUNED = {
    "H200": {
        (6144, 4096): (4, 4, 8), (4096, 4096): (8, 2, 16), (28672, 4096): (2, 4, 16),
        (4096, 14336): (4, 2, 16), (128256, 4096): (2, 4, 16),
        (3072, 4096): (4, 4, 8), (4096, 2048): (4, 2, 16), (14336, 4096): (2, 4, 16),
        (4096, 7168): (4, 2, 16), (64128, 4096): (2, 4, 16),
    },
}  # fmt: skip
# MLXRUN_DENSE_CFG="N,K=rows,warps,vec;..." sets shapes' settings over those, for A/B of the
# sweep's picks in the model
_DENSE_CFG: dict[int, dict] = {}  # by device index, read at its first call: a bad value is
# that run's error


def _dense_cfg(device: torch.device) -> dict:
    cfg = _DENSE_CFG.get(device.index)
    if cfg is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        cfg = dict(next((t for gpu, t in _DENSE_TUNED.items() if gpu in name), {}))
        spec = os.environ.get("MLXRUN_DENSE_CFG", "")
        try:
            env = {
                tuple(int(v) for v in shape.split(",")): tuple(int(v) for v in setting.split(","))
                for shape, setting in (item.split("=") for item in spec.split(";") if item)
            }
            if any(len(a) != 2 or len(b) != 3 for a, b in env.items()):
                raise ValueError(spec)
        except ValueError:
            from mlxrun.errors import MlxrunError  # noqa: PLC0415

            raise MlxrunError(
                f"MLXRUN_DENSE_CFG={spec!r}: expected 'N,K=rows,warps,vec' entries joined by ';'"
            ) from None
        _DENSE_CFG[device.index] = cfg = cfg | env
    return cfg


def dense_gemv(x: torch.Tensor, w: torch.Tensor, silu: bool = False, block_n: int | None = None,
               warps: int = 4, vec: int = 16, out_dtype=None) -> torch.Tensor:  # fmt: skip
    """x [..., K] @ w[N, K]^T for a few rows of x (bf16 or fp16, w contiguous in K), as one
    CUDA-core kernel. silu: w is the joint [gate; up] (N even) and the result is
    silu(gate) * up, rounded as silu_mul rounds it. out_dtype (default x's): float32 keeps
    the fp32 sums unrounded.

    cuBLAS runs a batch-1 bf16 product below the copy bandwidth on the 8B shapes; this kernel
    streams them faster (H100, cycled weights in a CUDA graph, us, cuBLAS -> this, with the
    defaults: 4 rows a program, 4 warps, 16 inputs a thread): 6144x4096 20.8 -> 17.6,
    28672x4096 83.0 -> 76.8, 4096x14336 44.4 -> 41.5, 128256x4096 391.2 -> 330.8 (3.18 TB/s
    of weight bytes); 4096x4096 16.3 -> 12.4 with 2 warps (4: 12.7 or more)."""
    k = x.shape[-1]
    n = w.shape[0]
    if block_n is None:  # the defaults, or this GPU's (or MLXRUN_DENSE_CFG's) for this shape
        block_n, warps, vec = _dense_cfg(x.device).get((n, k), (4, warps, vec))
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n // 2 if silu else n), dtype=out_dtype or x.dtype, device=x.device)
    block_k = 32 * warps * vec
    rows = block_n // 2 if silu else block_n
    grid = (m, triton.cdiv(n // 2 if silu else n, rows))
    even = (n // 2) % rows == 0 if silu else n % block_n == 0
    even = even and k % block_k == 0
    _dense_gemv_kernel[grid](
        x2, w, y, n, k, x2.stride(0), y.stride(0), w.stride(0), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN=even, SILU=silu, num_warps=warps, **pdl_args(x.device),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], y.shape[-1])
