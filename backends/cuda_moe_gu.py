"""The MoE gate/up launch with each program streaming several row tiles of its slot's expert.

The per-slot kernel (`_moe_qgemv`) gives every (slot, row tile) a program. Where a row is one
k-step (qwen3-30b-a3b's gate/up: 2048 inputs, one 2-warp step of 256 words), all programs
fit in one wave and issue their whole tile at once: the bytes are served interleaved, so every
program's last bytes come in near the end of the transfer, and the decode and FMAs of all of
them run after it. Here a program takes TILES row tiles of one slot in turn, the next tile's
words loaded while the current one computes, so fewer bytes are in flight at once and the
first tiles' compute overlaps the rest's transfer. The k-step, sums and epilogue are the
per-slot kernel's (the same values).
"""

from __future__ import annotations

import re

import triton
import triton.language as tl

from mlxrun.backends.cuda_moe_kernels import _gated_store
from mlxrun.errors import MlxrunError
from mlxrun.quant.triton_gemv import _gemv_kstep, _gemv_lanes, _gemv_sum, _load_step
from mlxrun.quant.triton_launch import tlc


@triton.jit
def _tile_rows(t, N, HALVES: tl.constexpr):
    """Rows of gate/up tile t (as _moe_qgemv's GATED programs) and their mask (tiles past
    the last masked): HALVES 2: 8 gate rows and their 8 up rows (N further on); 1: 4 gate
    rows then their 4 up rows in one 8 (rn_h unused)."""
    if HALVES == 2:
        rn = t * 8 + tl.arange(0, 8)
        rn_h = rn + N
        mask = rn < N
    else:
        r8 = tl.arange(0, 8)
        r4 = t * 4 + r8 % 4
        rn = r4 + (r8 // 4) * N
        rn_h = rn
        mask = r4 < N
    return rn, rn_h, mask


@triton.jit
def _moe_gu_stream(X, IDS, OUT, W, S, B, BIAS1, BIAS2, N, X_DIV, limit, alpha,
                   MODE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                   ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                   WARPS: tl.constexpr, TILES: tl.constexpr, EVEN: tl.constexpr,
                   PDL: tl.constexpr = False):  # fmt: skip
    """OUT[s, outputs of tiles p, p + P, .. p + (TILES-1)*P] for slot s = program 0, p =
    program 1 of P: act(gate + b1) * (up + b2) of expert IDS[s] on x = X[s // X_DIV], as
    _moe_qgemv (GATED) computes them. W, S, B: the joint [gate_e; up_e] repack (rows of K
    inputs, one k-step: K * BITS / 32 == 4 * 32 * WARPS words). EVEN: every tile whole (no
    masks). PDL: the expert id and x come from earlier kernels: nothing before the wait."""
    HALVES: tl.constexpr = BLOCK_N // 8
    LANES: tl.constexpr = 32 * WARPS
    EPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // EPW
    TWO: tl.constexpr = WPG < 4
    KW: tl.constexpr = K // EPW
    KG: tl.constexpr = K // G
    s = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    e = tl.load(IDS + s).to(tl.int64)
    w_ptr = W + e * (2 * N) * KW
    s_ptr = S + e * (2 * N) * KG
    b_ptr = B + e * (2 * N) * KG
    rkw = tl.arange(0, 4 * LANES)
    lane = tl.arange(0, LANES)
    x_pair0, g_pair, g_a, g_b = _gemv_lanes(lane, G, WPG, TWO)
    x_base = X + (s // X_DIV).to(tl.int64) * K
    out_row = OUT + s.to(tl.int64) * N
    rn, rn_h, n_mask = _tile_rows(p, N, HALVES)
    wa = _load_step(w_ptr, rn, n_mask, rkw, 0, KW, EVEN, MODE, LANES)
    wa_h = wa
    if HALVES == 2:
        wa_h = _load_step(w_ptr, rn_h, n_mask, rkw, 0, KW, EVEN, MODE, LANES)
    for j in tl.static_range(TILES):
        t = p + j * P
        rn, rn_h, n_mask = _tile_rows(t, N, HALVES)
        wb = wa
        wb_h = wa_h
        if j + 1 < TILES:  # the next tile's words in flight while this one computes
            rb, rb_h, mb = _tile_rows(t + P, N, HALVES)
            wb = _load_step(w_ptr, rb, mb, rkw, 0, KW, EVEN, MODE, LANES)
            if HALVES == 2:
                wb_h = _load_step(w_ptr, rb_h, mb, rkw, 0, KW, EVEN, MODE, LANES)
        s_row = (rn // 8) * (KG * 8) + (rn % 8)
        s_row_h = (rn_h // 8) * (KG * 8) + (rn_h % 8)
        acc = tl.zeros([8, LANES], dtype=tl.float32)
        acc_h = tl.zeros([8, LANES], dtype=tl.float32)
        acc, acc_h = _gemv_kstep(acc, acc_h, wa, wa_h, 0, x_base, x_pair0, g_pair, g_a, g_b,
                                 s_row, s_row_h, n_mask, n_mask, s_ptr, b_ptr, KG, MODE,
                                 BITS, G, HALVES, EVEN, LANES, False)  # fmt: skip
        _gated_store(_gemv_sum(acc, MODE), acc_h, t, e, N, out_row, BIAS1, BIAS2, limit, alpha,
                     MODE, ACT, HAS_BIAS, HALVES)  # fmt: skip
        wa = wb
        wa_h = wb_h


def stream_fits(p, warps: int) -> bool:
    """Whether _moe_gu_stream runs PackedExperts p (gate/up) at `warps` warps: a row is one
    whole k-step (4 words a lane), not E4M3 (its k-step takes another decode)."""
    return p.gated and p.w.mode != "mxfp8" and p.k * p.w.bits // 32 == 128 * warps


def stream_launch(x, ids, h, p, b1, b2, x_div, o, warps: int, block_n: int, tiles: int,
                  pdl: dict) -> None:  # fmt: skip
    """_moe_gu_stream over every slot of ids: h (S, n) = act(gate) * up of each slot's
    expert; each program takes `tiles` row tiles of its slot."""
    from mlxrun.quant.triton_layout import _MODE_ID  # noqa: PLC0415

    w = p.w
    n_tiles = triton.cdiv(p.n, block_n // 2)
    progs = triton.cdiv(n_tiles, tiles)
    even = p.n % (block_n // 2) == 0 and n_tiles % tiles == 0
    bias = b1 is not None
    _moe_gu_stream[(ids.shape[0], progs)](
        x, ids, h, w.weight, w.scales, w.biases if w.biases is not None else w.scales,
        b1 if bias else h, b2 if bias else h, p.n, x_div, o.swiglu_limit, o.swiglu_alpha,
        MODE=_MODE_ID[w.mode], BITS=w.bits, G=w.group_size, K=p.k,
        ACT=0 if o.act == "silu" else 1, HAS_BIAS=bias, BLOCK_N=block_n, WARPS=warps,
        TILES=tiles, EVEN=even, num_warps=warps, **pdl,
    )  # fmt: skip


_GU_SPEC = re.compile(r"t(1|2|3|4|6|8)(?:n(8|16))?")


def parse_gu(spec: str) -> tuple[int, int | None] | None:
    """MLXRUN_MOE_GU -> None (per slot) or (tiles a program, rows a tile or None: QCFG's)."""
    spec = spec.strip()
    if spec == "0":
        return None
    m = _GU_SPEC.fullmatch(spec)
    if m is None:
        raise MlxrunError(
            f"MLXRUN_MOE_GU: cannot read {spec!r}: write 0 (per-slot gate/up kernel) or "
            "t<tiles>[n<rows>], e.g. t2 or t4n8 (tiles 1/2/3/4/6/8 a program, rows 8/16)"
        )
    return int(m.group(1)), m.group(2) and int(m.group(2))
