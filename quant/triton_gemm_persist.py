"""A persistent form of the batched-decode GEMM (triton_gemm.py, M <= 64, the swapped
128-row weight tile): a fixed number of programs a SM, each taking an equal run of the
(weight tile, k-step) iterations in one flat loop ("stream-K").

Why: the one-shot GEMM at M = 32 runs 1.7 programs a SM (3 fit) with a tail, each one
warpgroup's chain of cp.async wait, barrier, decode and wgmma, and reads at ~1.4 TB/s where
the batch-1 GEMV reads the same bytes at 2.5 (benchmarks/KERNEL_NOTES.md, 2026-11-27). Here
every SM holds `per_sm` programs to the end and the cp.async pipeline runs across tile
boundaries: the loop is one range over iterations, so Triton's pipeliner keeps the next
tiles' loads in flight while a tile's last k-step and its epilogue run.

A tile whose k-steps fall to several programs is summed as split-K is: each contributor
stores its fp32 partial in slot c (its rank among the tile's contributors) of [C, M, N] and
takes the tile's ticket; the last one adds the slots in order 0..C-1 (deterministic) and
writes y, and resets the ticket for the next launch. A tile held by one program is written
directly.

Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

import math

from . import triton_launch as _launch
from .triton_decode import _group_scale
from .triton_gemm import (
    _decode_tile,
    _dequant_4bit_bf16x2,
    _dequant_e4m3_bf16x2,
    _gq_scale_pair,
    _l2_prefetch_tile,
    _tile_dot,
)
from .triton_launch import _counters, tl, tlc, torch, triton


@triton.jit
def _owner(it, P, ITERS):
    """The program whose run holds iteration `it` (runs start at p * ITERS // P)."""
    return ((it + 1) * P + ITERS - 1) // ITERS - 1


@triton.jit
def _cta_barrier(dep, ASM: tl.constexpr):
    """bar.sync 0 once a thread (dep: any scalar). Triton's own barrier (tl.debug_barrier)
    inside the k-loop keeps its pipeliner off the loop (Triton 3.6, sm_90: no cp.async, 16
    KB of shared memory instead of the stages); inline assembly does not. The interpreter
    has no inline assembly and runs a program's lanes together: the plain barrier there."""
    if ASM:
        tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r,r", [dep],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        tl.debug_barrier()


@triton.jit
def _persist_epilogue(acc, y_ptr, part_ptr, cnt_ptr, rm, rn, M, N, stride_ym, t, pid, P,
                      ITERS, KS: tl.constexpr, SLOTS: tl.constexpr,
                      ASM: tl.constexpr):  # fmt: skip
    """acc [BN, BM] (y^T of tile t's rows rn, x rows rm) from this program's share of the
    tile's k-steps: y directly where the tile has one contributor, else through slot c of
    the partials [SLOTS, M, N] and the tile's ticket (the last sums the slots in order)."""
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    first = _owner(t * KS, P, ITERS)
    count = _owner(t * KS + KS - 1, P, ITERS) - first + 1
    if count == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        stride = M * N
        p_ptrs = part_ptr + rm[None, :] * N + rn[:, None]
        tl.store(p_ptrs + (pid - first) * stride, acc, mask=mask)
        _cta_barrier(t, ASM)  # every thread's partial is issued before the ticket is taken
        ticket = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
        if ticket == count - 1:
            total = tl.zeros_like(acc)
            # unrolled to SLOTS (a loop nested in the k-loop would keep Triton's pipeliner
            # off it: Triton 3.6, sm_90, no cp.async then)
            for c in tl.static_range(SLOTS):
                live = mask & (tl.zeros_like(rm)[None, :] + c < count)
                total += tl.load(p_ptrs + c * stride, mask=live, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemm_persist_kernel(
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
    KS: tl.constexpr,
    SLOTS: tl.constexpr,
    UPCAST: tl.constexpr,
    PACKED: tl.constexpr = False,
    EVEN_N: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
    PDL: tl.constexpr = False,
    L2_PF: tl.constexpr = 0,
    ONE_M: tl.constexpr = False,
):
    """y[M, N] = x[M, K] @ W^T, W tiles of BLOCK_N rows as wgmma's register operand (acc is
    y^T [BLOCK_N, BLOCK_M]); KS k-steps of NG groups a tile; program p of P runs iterations
    [p * ITERS // P, (p + 1) * ITERS // P) of ITERS = tiles * KS, tile-major. Tiles: the x
    row tiles fastest (ONE_M: M <= BLOCK_M, one). EVEN_K: K is KS whole k-steps."""
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    BK: tl.constexpr = NG * G
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    num_m = 1 if ONE_M else tl.cdiv(M, BLOCK_M)  # (no division by it in the loop)
    ITERS = num_m * tl.cdiv(N, BLOCK_N) * KS
    start = pid * ITERS // P
    end = (pid + 1) * ITERS // P
    KG = K // G
    rg = tl.arange(0, NG)
    rw = tl.arange(0, WPG)
    rk = tl.arange(0, BK)
    if PDL:
        if L2_PF > 0:
            t0 = start // KS
            rn0 = (t0 // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
            n0_mask = (rn0 < N) | EVEN_N
            s_row0 = (rn0 // 8) * (KG * 8) + (rn0 % 8)
            _l2_prefetch_tile(w_ptr, s_ptr, b_ptr, rn0, n0_mask, s_row0, start - t0 * KS,
                              stride_wn, KG, MODE, NG, WPG, L2_PF)  # fmt: skip
        tlc.gdc_wait()  # x is the previous kernel's output
        tlc.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for it in range(start, end):
        t = it // KS
        kb = it - t * KS
        rm = (t % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (t // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = rm < M
        n_mask = (rn < N) | EVEN_N
        s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
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
        acc = _tile_dot(acc, x_tile, w_tile, UPCAST, True)
        if (kb == KS - 1) | (it == end - 1):  # this program's share of tile t is done
            _persist_epilogue(acc, y_ptr, part_ptr, cnt_ptr, rm, rn, M, N, stride_ym, t, pid,
                              P, ITERS, KS, SLOTS, not UPCAST)  # fmt: skip
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)


def persist_grid(m: int, w, cfg, sms: int, fit: int = 0) -> tuple[int, int, int]:
    """(programs, KS, C) of the persistent GEMM for x [m, K] @ W^T (w a QLinear, or anything
    with its n, k, group_size) under cfg (a "gemm" KernelConfig with persist > 0):
    cfg.persist programs a SM, at most `fit` (the programs a SM holds, where known), and
    none with fewer than cfg.min_steps k-steps (a short run is mostly its partial's store
    and sum); KS the k-steps a tile; C the most programs one tile's k-steps fall to (the
    partials' slots)."""
    ks = math.ceil(w.k / (cfg.ng * w.group_size))
    iters = math.ceil(m / cfg.block_m) * math.ceil(w.n / cfg.block_n) * ks
    per_sm = min(cfg.persist, fit) if fit else cfg.persist
    progs = max(1, min(per_sm * sms, iters // max(1, cfg.min_steps)))
    run = iters // progs  # every run has run or run + 1 iterations
    return progs, ks, min(progs, (ks + run - 1) // run + 1)


# Programs a SM that the compiled kernel's registers and shared memory allow, by launch
# (read from the first launch's kernel): a run queued behind the resident ones would double
# the time (M = 64 takes ~190 registers, 2 a SM, where M = 32 takes ~140, 3 a SM)
_FIT: dict = {}


def _fit(kernel, warps: int, device) -> int:
    """Programs of `kernel` (Triton's compiled kernel; 0 where unknown) one SM holds: 64K
    registers allocated 256 a warp at a time, its shared memory plus 1 KB reserved a block."""
    regs = getattr(kernel, "n_regs", 0) if kernel is not None else 0
    if not regs or device.type != "cuda":
        return 0
    by_regs = 65536 // (-(-regs * 32 // 256) * 256 * warps)
    smem = getattr(_launch._props(device), "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (kernel.metadata.shared + 1024)
    return max(1, min(by_regs, by_smem, 2048 // (32 * warps)))


def launch_persist(x2, w, y, cfg, consts: dict, launch_args: dict) -> None:
    """Run _gemm_persist_kernel for x2 [m, K] (contiguous rows) @ W^T into y [m, N].
    consts: the format's constexprs (MODE, BITS, G, UPCAST, PACKED); launch_args: PDL's."""
    m = x2.shape[0]
    key = (x2.device, cfg, w.n, w.k, w.group_size, *consts.values())
    progs, ks, slots = persist_grid(m, w, cfg, _launch._num_sms(x2.device), _FIT.get(key, 0))
    tiles = math.ceil(m / cfg.block_m) * math.ceil(w.n / cfg.block_n)
    part = torch.empty((slots, m, w.n), dtype=torch.float32, device=x2.device) if slots > 1 else y
    cnt = _counters(x2.device, tiles) if slots > 1 else y
    biases = w.biases if w.biases is not None else w.scales
    kernel = _gemm_persist_kernel[(progs,)](
        x2, w.weight, w.scales, biases, y, part, cnt, m, w.n, w.k, x2.stride(0), y.stride(0),
        w.weight.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NG=cfg.ng, KS=ks, SLOTS=slots,
        EVEN_N=w.n % cfg.block_n == 0, EVEN_K=w.k == ks * cfg.ng * w.group_size,
        L2_PF=cfg.l2_prefetch, ONE_M=m <= cfg.block_m, **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_args,
    )  # fmt: skip
    if key not in _FIT:
        _FIT[key] = _fit(kernel, cfg.num_warps, x2.device)
