"""The batched-decode GEMM (M <= 64 rows of x, int4 affine with bf16 scales, bf16 x) with
its weight words and x loaded by the Tensor Memory Accelerator: one thread issues each
k-step's two copies into shared memory and the warps wait on an mbarrier, instead of every
thread issuing cp.async for its part of them and the warpgroup syncing on it
(triton_gemm._gemm_kernel). The scales and biases (1/16 of the bytes) stay plain loads:
through the TMA too (a box of [BLOCK_N/8, NG, 8], two more copies and barriers a k-step)
the 8B decode step gained 7.9% at batch 32 instead of 13% (H200, KERNEL_NOTES.md,
2026-11-27). qmatmul launches it where KernelConfig.tma says.

Imported only where Triton loads (triton_kernels.py checks).
"""

from __future__ import annotations

from .triton_decode import _splitk_epilogue
from .triton_gemm import _dequant_4bit_bf16x2, _gq_pair, _l2_prefetch_tile, _tile_dot
from .triton_launch import _props, tl, tlc, triton


@triton.jit
def _gemm_tma_kernel(
    x_desc,
    w_desc,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    KG,
    stride_wn,
    stride_ym,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NG: tl.constexpr,
    SPLIT_K: tl.constexpr,
    KB_PER_SPLIT: tl.constexpr,
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
    L2_PF: tl.constexpr = 0,
):
    """y[M, N] = x[M, K] @ W^T for M <= BLOCK_M; program (n tile, k split).

    x_desc: x [M, K] bf16, block [BLOCK_M, NG*G] (rows past M read as zeros);
    w_desc: the words w_ptr [N, K/8] int32 (row stride stride_wn), block [BLOCK_N, NG*G/8];
    s_ptr, b_ptr: scales and biases [N/8, K/G, 8] bf16 (triton_layout's row-inner tiles).
    Every k-step lies inside K and every tile inside N (launch checks). L2_PF (with PDL):
    as _gemm_kernel's, the first k-steps into L2 before the wait."""
    WPG: tl.constexpr = G // 8
    BK: tl.constexpr = NG * G
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    kb0 = pid_k * KB_PER_SPLIT
    rn = n0 + tl.arange(0, BLOCK_N)
    s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
    if PDL:  # the weights depend on no kernel, but x does: wait before the first load
        if L2_PF > 0:
            _l2_prefetch_tile(w_ptr, s_ptr, b_ptr, rn, True, s_row, kb0, stride_wn, KG, 0,
                              NG, WPG, L2_PF)  # fmt: skip
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T: the W tile is wgmma's A
    for j in tl.range(0, KB_PER_SPLIT, num_stages=STAGES):
        kb = kb0 + j
        words = w_desc.load([n0, kb * (NG * WPG)])
        x_tile = x_desc.load([0, kb * BK])
        offs = s_row[:, None] + (kb * NG + tl.arange(0, NG))[None, :] * 8
        s = tl.load(s_ptr + offs)
        b = tl.load(b_ptr + offs)
        words = tl.reshape(words, [BLOCK_N, NG, WPG])
        s2 = _gq_pair(s, not UPCAST)
        b2 = _gq_pair(b, not UPCAST)
        w_tile = _dequant_4bit_bf16x2(words, s2, b2, 0, BLOCK_N, NG, WPG, not UPCAST)
        acc = _tile_dot(acc, x_tile, w_tile, UPCAST, True)
    acc = tl.trans(acc)
    rm = tl.arange(0, BLOCK_M)
    _splitk_epilogue(
        acc, y_ptr, part_ptr, cnt_ptr, rm, rn, M, N, stride_ym, M * N, pid_n, pid_k, SPLIT_K
    )


def tma_fits(x2, w, cfg) -> bool:
    """Whether _gemm_tma_kernel can take x2 [m, K] @ w^T under cfg: int4 affine with bf16
    scales and biases, bf16 x, one row tile, whole tiles and k-steps, and the TMA's
    16-byte alignment of every base and row stride. A GPU before Hopper (no TMA) keeps the
    cp.async kernel; the interpreter runs this one."""
    import torch

    m = x2.shape[0]
    return (
        cfg.tma > 0
        and (x2.device.type != "cuda" or _props(x2.device).major >= 9)
        and w.mode == "affine"
        and w.bits == 4
        and x2.dtype == torch.bfloat16
        and w.scales.dtype == torch.bfloat16
        and w.biases is not None
        and w.biases.dtype == torch.bfloat16
        and m <= cfg.block_m
        and w.n % cfg.block_n == 0
        and w.k % (cfg.ng * w.group_size) == 0
        and w.scales.is_contiguous()
        and w.biases.is_contiguous()
        and w.weight.stride(-1) == 1
        and (w.weight.stride(0) * 4) % 16 == 0
        and (x2.stride(0) * 2) % 16 == 0
        and all(t.data_ptr() % 16 == 0 for t in (x2, w.weight, w.scales, w.biases))
    )


def qmatmul_tma(x2, w, cfg, y, part, cnt, split: int, per: int, pdl: dict) -> None:
    """Launch _gemm_tma_kernel for y [m, N] = x2 [m, K] @ w^T (tma_fits holds); part, cnt:
    the split-K partials and tickets as qmatmul allocates them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bk = cfg.ng * w.group_size
    x_desc = TensorDescriptor.from_tensor(x2, [cfg.block_m, bk])
    w_desc = TensorDescriptor.from_tensor(w.weight, [cfg.block_n, bk // 8])
    grid = (w.n // cfg.block_n, split)
    _gemm_tma_kernel[grid](
        x_desc, w_desc, w.weight, w.scales, w.biases, y, part, cnt, x2.shape[0], w.n,
        w.k // w.group_size, w.weight.stride(0), y.stride(0),
        G=w.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NG=cfg.ng, SPLIT_K=split,
        KB_PER_SPLIT=per, STAGES=cfg.num_stages, UPCAST=x2.device.type != "cuda",
        L2_PF=min(cfg.l2_prefetch, per), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
