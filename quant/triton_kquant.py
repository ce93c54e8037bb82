"""Triton GEMV and GEMM for GGUF K-quant weights (Q4_K, Q5_K, Q6_K) on CUDA, kept packed:
their launch parameters and kqmatmul, the entry point.

The weights are KQLinear, laid out at load by quant/kquant_layout.py (read its docstring for
the planes and their bits); its names (KQLinear, prepare_kquant, random_kquant,
dequantize_kquant, rows, concat, hi_shifts, q6_spread, kq_variant) are imported from here too.

`kqmatmul(x, w)` launches the kernels of quant/kquant_kernels.py: up to GEMV_MAX_M rows of x
run the GEMV (the affine int4 GEMV's loop: per lane and row one FFMA chain over a sub-block,
then dot * d*sc - dmin*m * sum(x); split-K, PDL, and silu=True for a joint [gate; up];
quant/kquant_lane.py), its launch picked by lane_config under kq_variant, or its persistent
form (quant/kquant_stream.py) where MLXRUN_KQ_STREAM asks; more rows the tensor-core GEMM
that decodes each weight tile in registers to x's dtype (tile_gemm_config).
"""

from __future__ import annotations

import dataclasses
import math
import os

from mlxrun.errors import MlxrunError
from mlxrun.quant import gguf_blocks as gb
from mlxrun.quant import kquant_kernels as kk
from mlxrun.quant import kquant_stream as kst
from mlxrun.quant import triton_kernels as tk
from mlxrun.quant import triton_launch as tch
from mlxrun.quant.kquant_layout import (  # noqa: F401 (callers import the layout's names here)
    KINDS,
    QK,
    KQLinear,
    _shapes,
    concat,
    dequantize_kquant,
    hi_shifts,
    kq_variant,
    prepare_kquant,
    q6_spread,
    random_kquant,
    rows,
)

torch = tk.torch


@dataclasses.dataclass(frozen=True)
class KQConfig:
    """Launch parameters: kernel "gemv" (block_n rows, sb super-blocks a k-step) or "gemm"
    (block_m x block_n tiles, one super-block a k-step); split_k programs along K."""

    kernel: str
    block_m: int
    block_n: int
    sb: int
    split_k: int
    num_warps: int


def choose_kq_config(m: int, w: KQLinear, device) -> KQConfig:
    """Launch parameters for x [m, K] @ W^T on the GEMM, or (m <= GEMV_MAX_M) on the tile
    GEMV (_kq_gemv_kernel, which kqmatmul runs only where a config asks for block_n 16 or
    32: the lane GEMV replaced it; kept for A/B timing). Not timed on a GPU yet; chosen by the SASS of
    the GEMV's loop for sm_90 (benchmarks/sass_kquant.py: 4096x4096, 4 warps), instructions
    per weight for Q4_K / Q5_K / Q6_K: 16 rows and 2 super-blocks a step 6.44 / 8.91 / 7.86
    (before Q4_K's in-place masks), 32 rows and 2 4.40 / 7.19 / 6.81 (each input converted
    once for 4 rows a thread; 96 / 127 / 165 registers, no spills), 64 rows and 2 3.82 /
    6.61 / 6.33 but 240-251 registers (2 programs a SM). Split K until ~4 programs a SM run
    (more splits cost their partials)."""
    sms = tk._num_sms(device)
    nb = w.k // QK
    if m <= tk.GEMV_MAX_M:
        bn, sb = 32, 2 if nb % 2 == 0 else 1
        tiles = m * math.ceil(w.n / bn)
        sk = tk._split(tiles, math.ceil(nb / sb), sms, 4.0)
        return KQConfig("gemv", 1, bn, sb, sk, 4)
    if device.type == "cpu":  # interpreter: small tiles keep the CPU tests fast
        bm, bn, warps = 16, 32, 4
    else:
        bm, bn, warps = (32 if m <= 32 else 64), 64, 8
    tiles = math.ceil(m / bm) * math.ceil(w.n / bn)
    sk = tk._split(tiles, nb, sms, 1.0) if tiles < sms else 1
    return KQConfig("gemm", bm, bn, 1, sk, warps)


# Q6_K's one-warp lane GEMV compiled with at most this many registers a thread (16 warps a
# SM; Triton 3.6 gives it 143-168 otherwise). H100, us, the four linears of a Llama-3-8B
# layer summed (benchmarks/KERNEL_NOTES.md, 2026-11-26): no cap 112.8, 144 114.6, 128
# 106.3, 112 108.7, 96 (spills) 123.3; the head 215.5 / 209.0 / 209.0 / 225.0 / 269.7
Q6K_MAXNREG = 128


def _maxnreg(w: KQLinear, warps: int) -> dict:
    """The lane GEMV's register cap: Q6K_MAXNREG for Q6_K on one warp, and (variants 5, 6) on
    two warps where K > 4096: H100, kq_ab.py, 4096x14336 25.3 -> 22.9 us capped (138 -> 128
    registers, no spills under Triton 3.6), but 4096x4096 7.7 -> 8.0 and 28672x4096 (4
    warps) 42.4 -> 43.6, so the cap stays off there (KERNEL_NOTES.md, 2026-11-27)."""
    if w.kind != "Q6_K":
        return {}
    if warps == 1 or (warps == 2 and w.k > 4096 and kq_variant() >= 5):
        return {"maxnreg": Q6K_MAXNREG}
    return {}


def lane_config(m: int, w: KQLinear, device, warps: int = 0) -> tk.KernelConfig:
    """Launch parameters of the K-quant GEMV (_kq_lane_gemv_kernel), as
    triton_kernels.choose_config picks them for an int4 weight of the same shape at 8 rows a
    program (the same low-nibble words a row, read the same way; its H100 sweep is in that
    function): up to GEMV_WARPS warps splitting each row's words, split K until ~6 warps a
    SM run, into a divisor of the k-steps where one is near, and at most 4 serial k-steps
    where the row blocks are few. warps > 0 (benchmarks/kq_ab.py's launch sweep): that many
    warps a program wherever a row holds a k-step of them, the rest of the rule as it is."""
    sms = tk._num_sms(device)
    kw = w.k // 8
    force, warps = warps, 1
    # Q6_K: with the loads built lanes-first (kq_variant 1) several warps a row, except the
    # head-sized (64+ row blocks a SM: one warp, 4 k-steps a program); 2 warps where N <=
    # 4096. H200, us, one warp (previous loads) -> this (kq_ab.py, KERNEL_NOTES 2026-11-26):
    # 6144x4096 13.6 -> 10.6 (4 warps), 4096x4096 9.7 -> 7.6 (2), 28672x4096 52.4 -> 38.9
    # (4), 4096x14336 27.8 -> 22.6 (2), the head 216.4 -> 142.8 (1). The previous loads
    # spill on 2-4 warps under Triton 3.6 (variant 0: one warp)
    v = kq_variant()
    top = tch.GEMV_WARPS
    tiles = m * math.ceil(w.n / 8)
    if w.kind == "Q6_K" and (v in (1, 3, 4, 5, 6) or w.hi_spread):
        top = 1 if tiles >= 64 * sms else min(top, 2 if w.n <= 4096 else 4)
    elif w.kind == "Q6_K" and v == 0 and not w.hi_spread:
        top = 1
    while warps < top and 256 * warps <= kw:
        warps *= 2
    while force and warps > force:
        warps //= 2
    while warps < force and 256 * warps <= 2 * kw:
        warps *= 2
    ksteps = math.ceil(kw / (128 * warps))
    sk = tk._split(tiles * warps, ksteps, sms, 6.0)
    divs = [d for d in range(1, ksteps + 1) if ksteps % d == 0]
    near = min(divs, key=lambda d: (abs(math.log(d / sk)), -d))
    if kw % (128 * warps) == 0 and abs(math.log(near / sk)) <= math.log(2):
        sk = near
    if warps == 1 and tiles < 8 * sms and ksteps / sk > 4:
        sk = math.ceil(ksteps / 4)
    if w.kind == "Q6_K" and warps == 1 and tiles < 64 * sms:
        # Q6_K's one warp (at most 128 registers a lane) hides latency with more programs: two
        # k-steps a split. H100 (profile_decode.py --linears --formats q6_k --no-prefetch),
        # us: 4096x14336 39.6 -> 33.4, 28672x4096 60.4 -> 56.6, 6144x4096 13.3 either way;
        # the head (16k row blocks) stays at one split (212.7 against 228.3 in two)
        sk = math.ceil(ksteps / 2)
    # Without the next step's words in flight: Q6_K holds 128 registers, no spills, 5.42
    # instructions a weight, against 255 registers, 128 B spilled, 5.57 with them (SASS for
    # sm_90, benchmarks/sass_kquant.py); Q4_K on the H100 is as fast or faster without (4096x14336 20.9 -> 17.3 us,
    # 4096x4096 5.9 -> 5.6, the others within 0.1)
    # 16 rows a program (two halves sharing x's loads and decode), as the int4 GEMV takes
    # them where a warp has at most 2 k-steps: variant 7, Q4_K only (sm_90, Triton 3.6, 4
    # warps: 96 -> 168 registers; Q5_K 162 -> 255, Q6_K spills)
    bn = 8
    if v >= 7 and w.kind == "Q4_K" and warps > 1 and ksteps <= 2 and w.n % 16 == 0:
        bn = 16
    per_sm = kq_stream_per_sm()
    if per_sm and w.kind != "Q6_K" and tiles >= 8 * sms and _stream_ok(w, warps):
        # the streaming GEMV where each program gets several tiles (the gate/up, the head)
        return tk.KernelConfig("stream", 1, 8, 1, num_warps=warps, per_sm=per_sm)
    # the first k-step's scales loaded before the PDL wait (cfg.early): variants 8 and 9
    # everywhere; 10 where a program has one k-step, for Q6_K only where its row tiles are
    # many (8+ a SM). H100, kq_ab.py, us, 7 (16 rows) -> 8 (+ early): Q4_K 6144x4096 7.9
    # -> 7.1, 5120x4096 7.6 -> 5.7, 4096x4096 5.7 -> 4.5, 28672x4096 28.6 -> 25.4, but the
    # down (3.5 k-steps) 14.9 -> 15.3; Q6_K (scales unmasked), without -> with: 28672x4096
    # 39.7 -> 36.9, but 6144x4096 10.4 -> 11.6, 4096x4096 7.6 -> 8.6
    early = v in (8, 9)
    if v >= 10 and math.ceil(ksteps / sk) == 1:
        early = w.kind != "Q6_K" or tiles >= 8 * sms
    return tk.KernelConfig("gemv", 1, bn, sk, num_warps=warps, prefetch=False, early=early)


def _loads(w: KQLinear) -> int:
    """The lane GEMV's V: 1 (loads built lanes-first) but for variant 0, and Q4_K rows of
    K <= 4096 with N > 4096 (variant 1: every N), where the previous loads were as fast or
    faster. us, previous -> new loads, H200 / H100 (kq_ab.py, KERNEL_NOTES.md 2026-11-26/27):
    6144x4096 6.6 -> 7.2 / 7.2 -> 8.1, 28672x4096 23.4 -> 23.9 / 27.5 -> 29.1, 128256x4096
    93.3 -> 105.6 / 105.2 -> 120.0; but 4096x4096 5.4 -> 4.9 / 5.9 -> 5.6, and 4096x14336
    16.0 -> 12.8 (H200)."""
    if w.hi_spread:  # the decode follows the layout, whatever the variant
        return 3
    v = kq_variant()
    if v == 0 or (w.kind == "Q4_K" and w.k <= 4096 and (v == 1 or (v >= 3 and w.n > 4096))):
        return 0
    return 2 if v >= 4 and w.kind == "Q6_K" else 1


def kq_stream_per_sm() -> int:
    """MLXRUN_KQ_STREAM: programs a SM of the streaming K-quant GEMV (quant/kquant_stream.py)
    where lane_config picks it, 0 (the default) never."""
    v = os.environ.get("MLXRUN_KQ_STREAM", "0")
    if not v.isdigit():
        raise MlxrunError(f"MLXRUN_KQ_STREAM={v!r}: use 0 (off) or the programs a SM")
    return int(v)


def _stream_ok(w: KQLinear, warps: int) -> bool:
    """Whether the streaming GEMV takes w: whole 8-row tiles and k-steps, dense planes."""
    sw = _shapes(w.kind, w.n, w.k)["weight"][1]
    dense = w.weight.stride(0) == sw and w.scales.is_contiguous() and w.biases.is_contiguous()
    return dense and w.n % 8 == 0 and (w.k // 8) % (128 * warps) == 0


def _stream_gemv(x2, w: KQLinear, y, silu: bool, cfg: tk.KernelConfig) -> None:
    m = x2.shape[0]
    kw = w.k // 8
    tiles = w.n // 8
    progs = min(tiles, cfg.per_sm * tk._num_sms(x2.device))
    kst._kq_stream_kernel[(m, progs)](
        x2, w.weight, w.scales, w.biases, y, w.n, x2.stride(0), y.stride(0),
        KIND=KINDS[w.kind], KSTEPS=kw // (128 * cfg.num_warps), KW=kw,
        SW=_shapes(w.kind, w.n, w.k)["weight"][1], KSC=w.k // gb.KQUANTS[w.kind][1],
        SILU=silu, WARPS=cfg.num_warps, V=_loads(w), num_warps=cfg.num_warps,
        **tk.pdl_args(x2.device),
    )  # fmt: skip


def _per_split(ksteps: int, split_k: int) -> tuple[int, int]:
    """(k-steps a split, splits) for split_k splits asked: no empty splits."""
    per = math.ceil(ksteps / split_k)
    return per, math.ceil(ksteps / per)


def _partials(x2, y, split: int, n: int, tickets: int):
    """Split-K's fp32 partials [split, m, n] and its `tickets` counters, or y for both where
    one split writes y itself (the kernels then read neither)."""
    if split > 1:
        part = torch.empty((split, x2.shape[0], n), dtype=torch.float32, device=x2.device)
        return part, tk._counters(x2.device, tickets)
    return y, y


def _lane_gemv(x2, w: KQLinear, y, silu: bool, cfg: tk.KernelConfig | None) -> None:
    m = x2.shape[0]
    cfg = cfg or lane_config(m, w, x2.device)
    if cfg.kernel == "stream":
        if _stream_ok(w, cfg.num_warps):
            _stream_gemv(x2, w, y, silu, cfg)
            return
        cfg = dataclasses.replace(cfg, kernel="gemv", split_k=1)
    kw = w.k // 8
    step = 128 * cfg.num_warps  # low-nibble words of a row per k-step (the warps split it)
    ksteps = math.ceil(kw / step)
    per, split = _per_split(ksteps, cfg.split_k)
    sw = _shapes(w.kind, w.n, w.k)["weight"][1]
    dense = w.weight.stride(0) == sw and w.scales.is_contiguous() and w.biases.is_contiguous()
    bn = cfg.block_n  # 8, or 16 (two halves of 8) without prefetch and with whole tiles
    if bn != 8 and (cfg.prefetch or w.n % 16):
        bn = 8
    even = dense and w.n % bn == 0 and kw == step * per * split
    tiles = math.ceil(w.n / bn)  # with silu: bn/2 gate rows and their up rows a tile
    part, cnt = _partials(x2, y, split, w.n, m * tiles * (bn // 8))
    ks = w.k // gb.KQUANTS[w.kind][1]
    kk._kq_lane_gemv_kernel[(m, tiles, split)](
        x2, w.weight, w.scales, w.biases, y, part, cnt, m, w.n, ks, x2.stride(0), y.stride(0),
        w.weight.stride(0), KIND=KINDS[w.kind], SPLIT_K=split, KB_PER_SPLIT=per, EVEN=even,
        KW=kw, SW=sw if even else 0, SILU=silu, WARPS=cfg.num_warps, PREFETCH=cfg.prefetch,
        KSC=ks if even else 0, V=_loads(w), HALVES=bn // 8, EARLY=cfg.early and not cfg.prefetch,
        SCE=even and kq_variant() >= 9,  # 9 and 10
        num_warps=cfg.num_warps, **_maxnreg(w, cfg.num_warps),
        **tk.pdl_args(x2.device),
    )  # fmt: skip


def tile_gemm_config(m: int, w: KQLinear, device, x_dtype) -> tk.KernelConfig:
    """Launch parameters of _kq_tile_gemm_kernel: triton_kernels.choose_config's for the
    affine GEMM (its H100 measurements) with k-steps of 128 weights (4 sub-blocks of 32 or
    8 of 16), W as the register operand (swap)."""
    sms = tk._num_sms(device)
    ng = 8 if w.kind == "Q6_K" else 4
    if device.type == "cpu":  # interpreter: small tiles keep the CPU tests fast
        bm, bn, warps, stages = 16, 32, 4, 1
    elif x_dtype == torch.float32:  # tf32x3 needs 3 MMAs and hi/lo operands: small tiles
        bm, bn, warps, stages = 16, 64, 4, 3
    elif m <= 64:  # a few sequences: W's 128 rows the wgmma's wide side, split K to a wave
        # 8 warps: the decoded tile in 64 registers a thread (4 warps spilled; SASS for sm_90,
        # Q4_K/Q5_K/Q6_K, instructions a weight decoded: 9.9 / 14.6 / 15.0, no spills)
        bm, bn, warps, stages = (32 if m <= 32 else 64), 128, 8, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    ksteps = math.ceil(w.k / 128)
    tiles = math.ceil(m / bm) * math.ceil(w.n / bn)
    sk = tch._split_even(tiles, ksteps, sms, 1.0) if tiles < sms else 1
    return tk.KernelConfig("gemm", bm, bn, sk, ng, warps, stages, swap=device.type != "cpu")


def _tile_gemm(x2, w: KQLinear, y, cfg: tk.KernelConfig | None) -> None:
    m = x2.shape[0]
    cfg = cfg or tile_gemm_config(m, w, x2.device, x2.dtype)
    sub = gb.KQUANTS[w.kind][1]
    ksteps = math.ceil(w.k / (cfg.ng * sub))
    per, split = _per_split(ksteps, cfg.split_k)
    tiles = math.ceil(m / cfg.block_m) * math.ceil(w.n / cfg.block_n)
    part, cnt = _partials(x2, y, split, w.n, tiles)
    kk._kq_tile_gemm_kernel[(tiles, split)](
        x2, w.weight, w.scales, w.biases, y, part, cnt, m, w.n, w.k, w.k // sub, x2.stride(0),
        y.stride(0), w.weight.stride(0), KIND=KINDS[w.kind], BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, NG=cfg.ng, SPLIT_K=split, KB_PER_SPLIT=per, GROUP_M=cfg.group_m,
        UPCAST=x2.device.type != "cuda", SWAP=cfg.swap, EVEN_N=w.n % cfg.block_n == 0,
        HS=w.hi_spread,
        EVEN_K=w.k % (cfg.ng * sub) == 0 and ksteps % per == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **tk.pdl_args(x2.device),
    )  # fmt: skip


def silu_fusable(x: torch.Tensor, w: KQLinear) -> bool:
    """Whether kqmatmul(x, w, silu=True) runs: w = [gate; up] with N/2 a multiple of 4, and
    at most GEMV_MAX_M rows of x (the GEMV)."""
    m = x.numel() // max(x.shape[-1], 1)
    return 0 < m <= tk.GEMV_MAX_M and w.n % 8 == 0


def kqmatmul(
    x: torch.Tensor, w: KQLinear, config: KQConfig | None = None, silu: bool = False
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T -> [..., N] in x's dtype, W a K-quant (KQLinear).

    silu (where silu_fusable): W is the joint [gate; up] and the result [..., N/2] is
    silu(x @ gate^T) * (x @ up^T), rounded as cuda_ops.silu_mul rounds it."""
    tk._need_torch()
    tk._check_runtime(x)
    if x.shape[-1] != w.k:
        raise MlxrunError(f"input has {x.shape[-1]} features but the weight expects {w.k}")
    if silu and not silu_fusable(x, w):
        raise ValueError("kqmatmul: silu needs the GEMV and an even [gate; up] weight")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, w.n // 2 if silu else w.n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, y.shape[-1])
    # a KQConfig (other than an 8-row GEMV) asks for the kernels the lane GEMV and the tile
    # GEMM replaced, for A/B timing
    old = isinstance(config, KQConfig) and not (config.kernel == "gemv" and config.block_n == 8)
    kernel = config.kernel if config is not None else "gemv" if m <= tk.GEMV_MAX_M else "gemm"
    kernel = "gemv" if kernel == "stream" else kernel  # the lane GEMV's persistent form
    if silu and (old or kernel != "gemv"):
        raise ValueError("kqmatmul: silu needs the lane GEMV")
    if not old and kernel == "gemv":
        if x2.dtype == torch.bfloat16 and (x2.data_ptr() % 4 or (m > 1 and x2.stride(0) % 2)):
            x2 = x2.clone()  # the GEMV reads bf16 x as uint32 pairs: 4-byte aligned rows
        cfg = None
        if config is not None:  # a KQConfig's (or KernelConfig's) split, warps, prefetch
            pf = getattr(config, "prefetch", w.kind != "Q6_K")
            bn = config.block_n if isinstance(config, tk.KernelConfig) else 8
            early = getattr(config, "early", False)
            cfg = tk.KernelConfig(
                "gemv", 1, bn, config.split_k, num_warps=config.num_warps, prefetch=pf, early=early
            )
            if getattr(config, "kernel", "") == "stream":
                cfg = config
        _lane_gemv(x2, w, y, silu, cfg)
        return y.reshape(*lead, y.shape[-1])
    if not old:
        _tile_gemm(x2, w, y, config)
        return y.reshape(*lead, w.n)
    _replaced(x2, w, y, config or choose_kq_config(m, w, x.device))
    return y.reshape(*lead, w.n)


def _replaced(x2, w: KQLinear, y, cfg: KQConfig) -> None:
    """The tile GEMV (_kq_gemv_kernel) or per-super-block GEMM (_kq_gemm_kernel) that the
    lane GEMV and the tile GEMM replaced, as cfg asks (A/B timing)."""
    m = x2.shape[0]
    nb = w.k // QK
    kw = w.k // 8
    per, split = _per_split(math.ceil(nb / cfg.sb), cfg.split_k)
    if cfg.kernel == "gemv":
        tiles = math.ceil(w.n / cfg.block_n)
        grid = (m, tiles, split)
    else:
        tiles = math.ceil(m / cfg.block_m) * math.ceil(w.n / cfg.block_n)
        grid = (tiles, split)
    part, cnt = _partials(x2, y, split, w.n, m * tiles if cfg.kernel == "gemv" else tiles)
    args = (x2, w.weight, w.scales, w.biases, y, part, cnt)
    if cfg.kernel == "gemv":
        kk._kq_gemv_kernel[grid](
            *args, w.n, kw, nb, x2.stride(0), y.stride(0), w.weight.stride(0),
            KIND=KINDS[w.kind], BLOCK_N=cfg.block_n, SB=cfg.sb, SPLIT_K=split,
            KB_PER_SPLIT=per, HS=w.hi_spread, num_warps=cfg.num_warps, **tk.pdl_args(x2.device),
        )  # fmt: skip
    else:
        kk._kq_gemm_kernel[grid](
            *args, m, w.n, kw, nb, x2.stride(0), y.stride(0), w.weight.stride(0),
            KIND=KINDS[w.kind], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=split,
            KB_PER_SPLIT=per, UPCAST=x2.device.type != "cuda", HS=w.hi_spread,
            num_warps=cfg.num_warps,
        )  # fmt: skip
