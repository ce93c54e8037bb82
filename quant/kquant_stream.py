"""A persistent form of the K-quant GEMV (quant/kquant_lane.py), as
quant/triton_gemv_stream.py is of the 8-bit one: each program streams row tiles pid,
pid + P, ... (P programs, a few a SM) through the lane GEMV's per-k-step code
(_lane_step), and the next tile's first words are loaded while the current tile's last
k-step computes, so a program always has weights in flight.

Why: with K = 4096 and 4 warps, a lane GEMV program is one k-step of one 8-row tile: it
issues its loads, waits, computes and ends, with nothing in flight while it computes.
On the gate/up shape (3,584 tiles, 27 a SM) the 8-bit stream took 36.0 -> 30.8 us (H200,
benchmarks/KERNEL_NOTES.md). Q4_K/Q5_K only: Q6_K's words in flight during a step cost it
245 registers (sass_kquant.py), twice its one-warp budget.

Whole tiles and k-steps only (no masks, no split-K); _lane_gemv falls back to the lane
GEMV otherwise. Imported only where Triton loads.
"""

from __future__ import annotations

from mlxrun.quant import triton_gemv as tg
from mlxrun.quant import triton_kernels as tk
from mlxrun.quant.kquant_lane import _lane_hi, _lane_step

triton = tk.triton
tl = tk.tl
tlc = tk.tlc

if triton is not None:

    @triton.jit
    def _stream_rows(t, N, SILU: tl.constexpr):
        """The 8 rows of tile t, as _kq_lane_gemv_kernel lays out its tile pid_n."""
        r8 = tl.arange(0, 8)
        if SILU:  # 4 gate rows, then their 4 up rows
            return t * 4 + r8 % 4 + (r8 // 4) * (N // 2)
        return t * 8 + r8

    @triton.jit
    def _kq_stream_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, stride_xm, stride_ym, KIND: tl.constexpr,
        KSTEPS: tl.constexpr, KW: tl.constexpr, SW: tl.constexpr, KSC: tl.constexpr,
        PDL: tl.constexpr = False, SILU: tl.constexpr = False, WARPS: tl.constexpr = 4,
        V: tl.constexpr = 1,
    ):  # fmt: skip
        """y[m, N] = x[m, K] @ W^T: program (m, pid) computes the 8-row tiles pid, pid + P,
        ... (P = programs along axis 1), KSTEPS k-steps of 128*WARPS low-nibble words each
        (KW words a row, all of it), with _kq_lane_gemv_kernel's lanes, decode and epilogue
        (SILU: W = [gate; up], y = silu(gate) * up). One k-step's words are in flight while
        the previous one computes, across tiles too: past the last tile its first k-step is
        loaded again (in bounds, never used). SW: the row stride in words; KSC: sub-blocks a
        row (both constants: whole rows)."""
        LANES: tl.constexpr = 32 * WARPS
        m = tl.program_id(0)
        pid = tl.program_id(1)
        P = tl.num_programs(1)
        tiles = N // 8
        rkw = tl.arange(0, 4 * LANES)
        lane = tl.arange(0, LANES)
        lane_s = lane * (N > 0).to(tl.int32)  # opaque to the contiguity analysis (_lane_step)
        if KIND == 2:
            x_pair0 = lane * 16
        else:
            x_pair0 = (lane * 16)[:, None] + tl.arange(0, 2)[None, :]
        x_base = x_ptr + m * stride_xm
        y_base = y_ptr + m * stride_ym
        rn = _stream_rows(pid, N, SILU)
        n_mask = rn < N  # all true (whole tiles)
        wa = tg._load_step(w_ptr, rn, n_mask, rkw, 0, SW, True, 0, LANES)
        ha = wa
        if KIND != 0:
            ha = _lane_hi(w_ptr, rn, n_mask, rkw, lane_s, 0, SW, KW, KSC, KIND, True, LANES, V)
        if PDL:  # the weights depend on no kernel; x does
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        for t in range(pid, tiles, P):
            rn = _stream_rows(t, N, SILU)
            rn_next = _stream_rows(tl.minimum(t + P, tiles - 1), N, SILU)
            acc = tl.zeros([8, LANES], dtype=tl.float32)
            for s in tl.static_range(KSTEPS):
                if s + 1 < KSTEPS:
                    wb = tg._load_step(w_ptr, rn, n_mask, rkw, s + 1, SW, True, 0, LANES)
                    hb = wb
                    if KIND != 0:
                        hb = _lane_hi(w_ptr, rn, n_mask, rkw, lane_s, s + 1, SW, KW, KSC, KIND,
                                      True, LANES, V)  # fmt: skip
                else:
                    wb = tg._load_step(w_ptr, rn_next, n_mask, rkw, 0, SW, True, 0, LANES)
                    hb = wb
                    if KIND != 0:
                        hb = _lane_hi(w_ptr, rn_next, n_mask, rkw, lane_s, 0, SW, KW, KSC, KIND,
                                      True, LANES, V)  # fmt: skip
                acc = _lane_step(acc, wa, ha, s, x_base, x_pair0, lane, lane_s, rn, n_mask,
                                 s_ptr, b_ptr, KSC, KIND, True, LANES, V)  # fmt: skip
                wa = wb
                ha = hb
            out = tl.sum(acc, axis=1) * 562949953421312.0  # [8]: undo the decode's 2^-49
            if SILU:
                g, u = tl.split(tl.trans(tl.reshape(out, [2, 4])))  # rows 0-3 gate, 4-7 up
                tg._silu_store(g, u, y_base + t * 4 + tl.arange(0, 4))
            else:
                tl.store(y_base + rn, out.to(y_ptr.dtype.element_ty))
