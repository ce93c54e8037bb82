"""Fused Triton kernels for the small per-layer operations of the PyTorch CUDA backend.

At batch-1 decode a layer's seven matrix-vector products stream the weights; everything else
(two RMSNorms, rotary embedding of q and k, SiLU-multiply, two residual adds) moves a few KB
but, written as stock PyTorch ops, took ~40 kernel launches per layer, each ~2 us even when
replayed from a CUDA graph: about as long as reading the bf16 weights. Each kernel below does
one of those steps in one launch. They round where the PyTorch ops (and transformers) round,
so the CUDA backend computes what the CPU backend computes, to float rounding.

Without a GPU they run under TRITON_INTERPRET=1, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, y_ptr, w_ptr, h_out_ptr, x_out_ptr, n, eps, HAS_Y: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # rows x n passes 2^31 at large batch prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_Y:
        # the residual sum is rounded to the model dtype, as `h + y` is
        h = (h.to(tl.float32) + tl.load(y_ptr + row * n + cols, mask=mask, other=0.0)).to(
            h_ptr.dtype.element_ty
        )
        tl.store(h_out_ptr + row * n + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(h32 * h32, axis=0) / n + eps)
    # normalise in fp32, round once, then multiply by the weight (transformers' order)
    xn = (h32 * r).to(x_out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
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
    )
    return h_new, x


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    inv_ptr,
    out_ptr,
    H,
    T,
    sxb,
    sxh,
    sxt,
    spb,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per (b, h, t) row of head_dim values; out is contiguous (B, H, T, D)
    pid = tl.program_id(0).to(tl.int64)  # offsets pass 2^31 at large batch prefills
    t = pid % T
    bh = pid // T
    hh = bh % H
    b = bh // H
    i = tl.arange(0, BLOCK)
    m = i < HALF
    base = x_ptr + b * sxb + hh * sxh + t * sxt
    x1 = tl.load(base + i, mask=m, other=0.0)
    x2 = tl.load(base + HALF + i, mask=m, other=0.0)
    p = tl.load(pos_ptr + b * spb + t).to(tl.float32)
    ang = p * tl.load(inv_ptr + i, mask=m, other=0.0)
    dt = out_ptr.dtype.element_ty
    # cos/sin rounded to the model dtype and each product rounded, as the PyTorch ops do
    c = tl.cos(ang).to(dt).to(tl.float32)
    s = tl.sin(ang).to(dt).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    a1 = (x1f * c).to(dt).to(tl.float32)
    b1 = (-x2f * s).to(dt).to(tl.float32)
    a2 = (x2f * c).to(dt).to(tl.float32)
    b2 = (x1f * s).to(dt).to(tl.float32)
    o = out_ptr + pid * (2 * HALF)
    tl.store(o + i, (a1 + b1).to(dt), mask=m)
    tl.store(o + HALF + i, (a2 + b2).to(dt), mask=m)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x (B, H, T, D), any strides with unit last stride;
    positions (B or 1, T); inv_freq (D/2,) float32. Returns a contiguous (B, H, T, D)."""
    B, H, T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    pos = positions.reshape(positions.shape[0], T)
    if pos.stride(-1) != 1:
        pos = pos.contiguous()
    out = torch.empty((B, H, T, D), dtype=x.dtype, device=x.device)
    _rope_kernel[(B * H * T,)](
        x,
        pos,
        inv_freq,
        out,
        H,
        T,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        pos.stride(0) if pos.shape[0] > 1 else 0,
        HALF=D // 2,
        BLOCK=triton.next_power_of_2(D // 2),
        num_warps=1,
    )
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, sg, su, BLOCK: tl.constexpr):
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
    _silu_mul_kernel[grid](g, u, out, n, g.stride(0), u.stride(0), BLOCK=BLOCK, num_warps=4)
    return out
