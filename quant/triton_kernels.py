"""Fused Triton kernels for MLX-format quantized linears on CUDA.

The canonical weight (DESIGN.md) is `weight` uint32 [N, K*bits/32] with value k of a row at
bit offset k*bits, `scales` [N, K/G] and, in affine mode, `biases` [N, K/G]. `prepare` repacks
it once at load time: inside each group of G inputs, element g*G + i*WPG + w (WPG = words per
group, i = position in the word) moves to word g*WPG + w, position i. For a fixed position i
the inputs of consecutive words are then consecutive in x, so the GEMV loads each slice of x
as one contiguous vector and decodes each position with one mask, no per-element shift.

Decoding uses float bit patterns instead of int->float conversions (a quarter-rate
instruction on Hopper): a code masked in place inside the mantissa (affine), or moved into
exponent/mantissa bits (E2M1, E4M3), *is* a float that equals the value times a power of two,
denormals included (Triton emits no flush-to-zero). x is pre-multiplied by 2^100 so the
products stay normal; the power of two comes back once per group, with the scale.

`qmatmul(x, w)` picks the kernel by the number of rows of x: M <= 4 uses the CUDA-core GEMV
(up to 4 warps per program stream 8 or 16 rows, each warp its own part of every k-step,
summed once at the end; split-K across programs where that still leaves SMs idle, in one
launch: the last program of each row block sums the split partials; rows of x are programs
next to each other, so M > 1 re-reads the weights from L2; the 8-bit formats, where the
programs would be many or their rows long, run a persistent form whose programs stream row
tiles with the next one's weights in flight: triton_gemv_stream.py), larger M
uses a tensor-core GEMM (tl.dot) that dequantizes each weight tile in registers.
Without Triton or a GPU, `dequantize_torch` gives the dense weight for one layer at a time.

Where the parts live: the layout, `prepare` and `dequantize_torch` in triton_layout.py; the
code decode and epilogues every kernel shares in triton_decode.py; the GEMV in triton_gemv.py
(its k-step in triton_gemv_step.py); the GEMM in triton_gemm.py; launch parameters, device
properties and PDL in triton_launch.py. This module turns a launch's parameters into the
kernels' constexprs and launches them.
"""

from __future__ import annotations

import dataclasses
import math
import os

from mlxrun.errors import MlxrunError

from .triton_launch import (
    _TRITON_ERROR,
    GEMV_MAX_M,
    KernelConfig,
    _counters,
    choose_config,
    pdl_args,
    stream_even,
    torch,
    triton,
)
from .triton_launch import _l2_bytes as _l2_bytes
from .triton_launch import _num_sms as _num_sms
from .triton_launch import _split as _split
from .triton_launch import launch_from_name as launch_from_name
from .triton_launch import tl as tl
from .triton_launch import tlc as tlc
from .triton_layout import _MODE_ID as _MODE_ID
from .triton_layout import SCALE_ROWS, QLinear, _need_torch
from .triton_layout import concat as concat
from .triton_layout import dequantize_torch as dequantize_torch
from .triton_layout import join_rows as join_rows
from .triton_layout import prepare as prepare

if triton is not None:
    from .triton_decode import _group_scale as _group_scale
    from .triton_decode import _silu_store as _silu_store
    from .triton_decode import _split_sum as _split_sum
    from .triton_decode import _splitk_epilogue as _splitk_epilogue
    from .triton_gemm import _gemm_kernel
    from .triton_gemm_tma import qmatmul_tma, tma_fits
    from .triton_gemv import _gemv_kernel
    from .triton_gemv_stream import _gemv_stream_kernel

MAX_INDEX = 2**31 - 1  # element offsets the kernels compute in int32


def _check_runtime(x: torch.Tensor) -> None:
    if triton is None:
        raise MlxrunError(
            f"Triton is not available ({_TRITON_ERROR}): install triton on a Linux CUDA machine, "
            "or use dequantize_torch on CPU/MPS"
        )
    if x.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise MlxrunError(
            f"qmatmul runs on CUDA tensors (got {x.device.type}); use dequantize_torch there, "
            "or set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU"
        )


def _packed_gemm(w: QLinear, x_dtype) -> bool:
    """The GEMM's packed bf16x2 decode applies: bf16 x and mxfp4, nvfp4, mxfp8, or affine
    4-bit with bf16 scales and biases (affine 8-bit keeps the per-element path)."""
    if x_dtype != torch.bfloat16:
        return False
    if w.mode == "affine":
        return w.bits == 4 and w.scales.dtype == torch.bfloat16 and w.biases.dtype == torch.bfloat16
    return True


def _stream_constexprs(w, cfg: KernelConfig, silu: bool = False, ptx: bool = True) -> dict:
    """_gemv_stream_kernel's constexprs for w under cfg (a "stream" config); ptx: the
    per-word E4M3 decode in PTX (else through Triton's fp8 type: the interpreter)."""
    kw = w.k * w.bits // 32
    cvt = (2 if ptx else 1) if cfg.cvt and w.mode == "mxfp8" else 0
    return dict(
        MODE=_MODE_ID[w.mode],
        BITS=w.bits,
        G=w.group_size,
        BLOCK_N=cfg.block_n,
        KSTEPS=kw // (128 * cfg.num_warps),
        KW=kw,
        SILU=silu,
        WARPS=cfg.num_warps,
        CVT=cvt,
        AHEAD=cfg.ahead,
    )


def _constexprs(w, cfg: KernelConfig, per: int, split: int) -> dict:
    """The constexprs both kernels take: format, row block and the K split."""
    return dict(
        MODE=_MODE_ID[w.mode],
        BITS=w.bits,
        G=w.group_size,
        BLOCK_N=cfg.block_n,
        SPLIT_K=split,
        KB_PER_SPLIT=per,
    )


def _gemv_constexprs(w, cfg: KernelConfig, silu: bool = False, dense: bool = True) -> dict:
    """_gemv_kernel's constexprs for w (a QLinear, or anything with its n, k, bits,
    group_size and mode) under cfg, as qmatmul launches it; benchmarks/sass_count.py compiles
    the same. dense: w's rows and scales are contiguous."""
    kw = w.k * w.bits // 32
    step = 128 * cfg.num_warps  # words of a row per k-step (the warps split it)
    ksteps = math.ceil(kw / step)
    per = math.ceil(ksteps / cfg.split_k)
    split = math.ceil(ksteps / per)  # no empty splits
    # whole row blocks, k-steps and splits, contiguous rows: no masks, a constant stride
    even = dense and w.n % cfg.block_n == 0 and kw == step * per * split
    # with one k-step per split, PREFETCH still loads it before the loop (before gdc_wait)
    return dict(
        _constexprs(w, cfg, per, split),
        PREFETCH=cfg.prefetch,
        EVEN=even,
        KW=kw if even else 0,
        SILU=silu,
        WARPS=cfg.num_warps,
        SEQ=cfg.seq,
        EARLY=cfg.early,
        XVEC=cfg.xvec and w.k % 32 == 0,  # whole lanes of x in or past K (_gemv_xq)
        QUADS=cfg.quads,
    )


def silu_fusable(x: torch.Tensor, w: QLinear, config: KernelConfig | None = None) -> bool:
    """Whether qmatmul(x, w, config, silu=True) can run: w = [gate; up] with N/2 a multiple
    of 8, and the GEMV (at most GEMV_MAX_M rows of x)."""
    m = x.numel() // max(x.shape[-1], 1)
    if not 0 < m <= GEMV_MAX_M or (w.n // 2) % SCALE_ROWS or w.n % 2:
        return False
    cfg = config or choose_config(m, w, x.device, x.dtype)
    return cfg.kernel in ("gemv", "stream")


def qmatmul(
    x: torch.Tensor,
    w: QLinear,
    config: KernelConfig | None = None,
    silu: bool = False,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T (+ bias [N]) -> [..., N] in out_dtype (default x's),
    W quantized (QLinear). The kernels sum in fp32: out_dtype float32 keeps those sums
    unrounded. The one-shot GEMV adds the bias to its fp32 sums before rounding once; the
    other kernels' outputs get it added after (one more rounding, as y + bias).

    silu (where silu_fusable): W is the joint [gate; up] and the result [..., N/2] is
    silu(x @ gate^T) * (x @ up^T), rounded as cuda_ops.silu_mul rounds it."""
    _need_torch()
    _check_runtime(x)
    if x.shape[-1] != w.k:
        raise MlxrunError(f"input has {x.shape[-1]} features but the weight expects {w.k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise MlxrunError(f"qmatmul takes bf16/fp16/fp32 inputs, got {x.dtype}")
    if silu and not silu_fusable(x, w, config):
        raise ValueError("qmatmul: silu needs the GEMV and an even [gate; up] weight")
    if bias is not None and (silu or bias.shape != (w.n,)):
        raise ValueError(f"qmatmul: bias must be [{w.n}] and without silu")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, w.n // 2 if silu else w.n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, y.shape[-1])
    # The kernels index rows of x and y in 32 bits: a prefill of many sequences at once (an
    # 8B model at batch 198 x 512 tokens reaches 2.9e9 output elements) runs in row blocks.
    rows = MAX_INDEX // max(w.n, w.k)
    if m > rows:
        for r in range(0, m, rows):
            y[r : r + rows] = qmatmul(x2[r : r + rows], w, config, out_dtype=out_dtype, bias=bias)
        return y.reshape(*lead, w.n)
    cfg = config or choose_config(m, w, x.device, x.dtype)
    dense = w.weight.stride(0) == w.k * w.bits // 32 and w.scales.is_contiguous()
    if cfg.kernel == "stream" and not (dense and stream_even(w, cfg.block_n, cfg.num_warps, silu)):
        cfg = dataclasses.replace(cfg, kernel="gemv", split_k=1)  # partial tiles or k-steps
    if cfg.kernel == "stream":
        if x2.dtype == torch.bfloat16 and (x2.data_ptr() % 4 or (m > 1 and x2.stride(0) % 2)):
            x2 = x2.clone()  # bf16 x is read as uint32 pairs: 4-byte aligned rows
        tiles = (w.n // 2 if silu else w.n) // (cfg.block_n // 2 if silu else cfg.block_n)
        # per_sm programs a SM in all: the rows of x share them (and read each tile's
        # weights together, the second from L2)
        progs = max(1, min(tiles, cfg.per_sm * _num_sms(x.device) // m))
        if cfg.balance:  # as many tiles for every program
            progs = math.ceil(tiles / math.ceil(tiles / progs))
        grid = (m, progs)
        _gemv_stream_kernel[grid](
            x2, w.weight, w.scales, w.biases if w.biases is not None else w.scales, y, w.n,
            w.k, x2.stride(0), y.stride(0), **_stream_constexprs(w, cfg, silu, x.device.type == "cuda"),
            num_warps=cfg.num_warps, **pdl_args(x.device),
        )  # fmt: skip
        if bias is not None:
            y += bias
        return y.reshape(*lead, y.shape[-1])
    if cfg.kernel == "gemv":
        if x2.dtype == torch.bfloat16 and (x2.data_ptr() % 4 or (m > 1 and x2.stride(0) % 2)):
            x2 = x2.clone()  # the GEMV reads bf16 x as uint32 pairs: 4-byte aligned rows
        consts = _gemv_constexprs(w, cfg, silu, dense)
        split = consts["SPLIT_K"]
        tiles = math.ceil(w.n / cfg.block_n)  # with silu: gate rows and their up rows a tile
        grid = (m, tiles, split)
        kern = _gemv_kernel
        if bias is not None:  # added in the epilogue, before the one rounding
            consts = dict(consts, bias_ptr=bias.contiguous(), HAS_BIAS=True)
            bias = None
    else:
        ksteps = math.ceil(w.k / (cfg.ng * w.group_size))
        per = math.ceil(ksteps / cfg.split_k)
        split = math.ceil(ksteps / per)  # no empty splits
        tiles = math.ceil(m / cfg.block_m) * math.ceil(w.n / cfg.block_n)
        grid = (tiles, split)
        kern = _gemm_kernel
        consts = dict(
            _constexprs(w, cfg, per, split),
            BLOCK_M=cfg.block_m,
            NG=cfg.ng,
            GROUP_M=cfg.group_m,
            UPCAST=x.device.type != "cuda",
            SWAP=cfg.swap,
            PACKED=_packed_gemm(w, x.dtype),
            EVEN_N=w.n % cfg.block_n == 0,
            EVEN_K=w.k % (cfg.ng * w.group_size) == 0 and ksteps % per == 0,
            L2_PF=min(cfg.l2_prefetch, per),
        )
    part = torch.empty((split, m, w.n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = _counters(x.device, m * tiles) if split > 1 else y
    if cfg.kernel == "gemm" and tma_fits(x2, w, cfg):
        qmatmul_tma(x2, w, cfg, y, part, cnt, split, per, pdl_args(x.device))
        if bias is not None:
            y += bias
        return y.reshape(*lead, y.shape[-1])
    biases = w.biases if w.biases is not None else w.scales
    kern[grid](
        x2, w.weight, w.scales, biases, y, part, cnt, m, w.n, w.k, x2.stride(0), y.stride(0),
        w.weight.stride(0), **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device),
    )  # fmt: skip
    if bias is not None:
        y += bias
    return y.reshape(*lead, y.shape[-1])
