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
(one warp per program streams 8 rows x 1024+ inputs per step; split-K so that small N still
fills all SMs, in one launch: the last program of each row block sums the split partials;
rows of x are programs next to each other, so M > 1 re-reads the weights from L2), larger M
uses a tensor-core GEMM (tl.dot) that dequantizes each weight tile in registers.
Without Triton or a GPU, `dequantize_torch` gives the dense weight for one layer at a time.
"""

from __future__ import annotations

import dataclasses
import math
import os

from mlxrun.errors import MlxrunError

try:
    import torch
except ImportError:  # an MLX-only install: the module still imports, use raises
    torch = None

try:
    import triton
    import triton.language as tl

    _TRITON_ERROR = None
except Exception as e:  # ImportError, or a triton that cannot load its libraries
    triton = None
    tl = None
    _TRITON_ERROR = e

# mode -> (allowed bits, allowed group sizes, scales are 8-bit codes)
_MODES = {
    "affine": ((4, 8), (32, 64, 128), False),
    "mxfp4": ((4,), (32,), True),
    "nvfp4": ((4,), (16,), True),
    "mxfp8": ((8,), (32,), True),
}
_MODE_ID = {"affine": 0, "mxfp4": 1, "nvfp4": 2, "mxfp8": 3}
GEMV_MAX_M = 4  # above this many rows the tensor-core kernel wins (per-row FMA cost grows)
SCALE_ROWS = 8  # scales/biases are stored in tiles of 8 rows (row index innermost)
MAX_INDEX = 2**31 - 1  # element offsets the kernels compute in int32


@dataclasses.dataclass(frozen=True)
class QLinear:
    """A quantized linear weight W [N, K] prepared for the Triton kernels.

    weight: int32 [N, K*bits/32], repacked within each group (see the module docstring).
    scales: [ceil(N/8), K/G, 8] (row-inner tiles of 8 rows, zero-padded); float (affine,
        dtype as stored) or uint8 codes (E8M0 / E4M3).
    biases: like scales (affine) or None.
    """

    weight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor | None
    mode: str
    bits: int
    group_size: int
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read for the weight (packed codes + scales + biases, no padding)."""
        groups = self.n * (self.k // self.group_size)
        total = self.weight.numel() * 4 + groups * self.scales.element_size()
        if self.biases is not None:
            total += groups * self.biases.element_size()
        return total


def _need_torch() -> None:
    if torch is None:
        raise MlxrunError("quantized Triton kernels need PyTorch: pip install 'mlxrun[cuda]'")


def _as_tensor(a, device=None):
    """numpy array or tensor -> tensor (uint32 numpy viewed as int32: torch lacks uint32 math)."""
    if isinstance(a, torch.Tensor):
        t = a
    else:
        import numpy as np

        arr = np.ascontiguousarray(a)
        if arr.dtype == np.uint32:
            arr = arr.view(np.int32)
        t = torch.from_numpy(arr)
    if t.dtype == torch.uint32:
        t = t.view(torch.int32)
    return t if device is None else t.to(device)


def _check_format(mode: str, bits: int, group_size: int) -> None:
    if mode not in _MODES:
        raise MlxrunError(f"unknown quantization mode {mode!r}: use one of {sorted(_MODES)}")
    ok_bits, ok_groups, _ = _MODES[mode]
    if bits not in ok_bits or group_size not in ok_groups:
        raise MlxrunError(
            f"{mode} with bits={bits}, group_size={group_size} has no Triton kernel: "
            f"use bits in {ok_bits} and group_size in {ok_groups}"
        )


def _repack(codes: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """codes uint8 [N, K] (natural order) -> int32 [N, K*bits/32] in the group-transposed order."""
    n, k = codes.shape
    epw = 32 // bits
    wpg = group_size // epw
    # element (g, i, w) of the group-transposed order is input g*G + i*WPG + w
    c = codes.view(n, k // group_size, epw, wpg).permute(0, 1, 3, 2).to(torch.int64)
    shifts = torch.arange(epw, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)  # [N, K/G, WPG]; disjoint bit fields, so sum == or
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.reshape(n, k // epw).to(torch.int32)


def _tile_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, KG] -> [ceil(N/8), KG, 8]: 8 rows inner, so one lane loads a group's 8 scales."""
    n, kg = t.shape
    pad = (-n) % SCALE_ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, kg)])
    return t.view(-1, SCALE_ROWS, kg).transpose(1, 2).contiguous()


def _untile_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [N, W] -> uint8 codes [N, W*32/bits], position i of word w at column w*epw + i."""
    epw = 32 // bits
    shifts = torch.arange(epw, device=words.device, dtype=torch.int64) * bits
    c = (words.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(words.shape[0], -1).to(torch.uint8)


def prepare(
    weight, scales, biases, mode: str = "affine", bits: int = 4, group_size: int = 64, device=None
) -> QLinear:
    """Canonical MLX quantized weight -> QLinear for `qmatmul`.

    weight: uint32 [N, K*bits/32] (numpy or torch), scales [N, K/G], biases [N, K/G] or None.
    The packed codes are repacked once (same size); no full-precision copy is kept.
    """
    _need_torch()
    _check_format(mode, bits, group_size)
    w = _as_tensor(weight, device)
    s = _as_tensor(scales, w.device)
    n, kw = w.shape
    k = kw * 32 // bits
    if k % group_size or tuple(s.shape) != (n, k // group_size):
        raise MlxrunError(
            f"scales shape {tuple(s.shape)} does not match weight {tuple(w.shape)} for "
            f"bits={bits}, group_size={group_size}: expected {(n, k // group_size)}"
        )
    if mode == "affine":
        if biases is None:
            raise MlxrunError("affine quantized weight has no biases: pass the '.biases' tensor")
        b = _as_tensor(biases, w.device)
        if b.shape != s.shape:
            raise MlxrunError(f"biases shape {tuple(b.shape)} differs from scales {tuple(s.shape)}")
        if not s.is_floating_point():
            raise MlxrunError(f"affine scales must be floats, got {s.dtype}")
    else:
        b = None
        s = s.view(torch.uint8) if s.element_size() == 1 else s
        if s.dtype != torch.uint8:
            raise MlxrunError(f"{mode} scales must be uint8 codes, got {s.dtype}")
    # row chunks bound the int64 temporaries (~64 bytes per weight) to ~1 GB
    step = max(SCALE_ROWS, (1 << 24) // k)
    packed = torch.cat(
        [_repack(_unpack(w[i : i + step], bits), bits, group_size) for i in range(0, n, step)]
    )
    s = _tile_rows(s)
    b = _tile_rows(b) if b is not None else None
    return QLinear(packed.contiguous(), s, b, mode, bits, group_size, n, k)


def concat(parts: list[QLinear]) -> QLinear | None:
    """QLinears that read the same x (q, k, v; gate, up) -> one QLinear of all their rows, or
    None where their formats differ. Each part's tensors are re-pointed into the joint ones,
    so the rows are held once."""
    p0 = parts[0]
    key = (p0.k, p0.mode, p0.bits, p0.group_size, p0.scales.dtype)
    if any((p.k, p.mode, p.bits, p.group_size, p.scales.dtype) != key for p in parts) or any(
        p.n % SCALE_ROWS for p in parts
    ):  # scale tiles of 8 rows: a part that pads its last tile cannot sit mid-tensor
        return None
    names = ("weight", "scales") + (("biases",) if p0.biases is not None else ())
    joint = {name: join_rows([getattr(p, name) for p in parts]) for name in names}
    n = sum(p.n for p in parts)
    return QLinear(
        joint["weight"],
        joint["scales"],
        joint.get("biases"),
        p0.mode,
        p0.bits,
        p0.group_size,
        n,
        p0.k,
    )


def join_rows(ts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0, then each input becomes a view of its rows of the result (its
    own storage is freed), so callers holding the parts keep working on the same values."""
    j = torch.cat(ts)
    row = 0
    for t in ts:
        t.set_(j.untyped_storage(), j.storage_offset() + row * j.stride(0), t.shape, t.stride())
        row += t.shape[0]
    return j


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_to_float(b: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes -> float32 values (no NaN handling: MLX never writes 0x7f/0xff)."""
    b = b.to(torch.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(torch.float32)
    mag = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.exp2(e.to(torch.float32) - 7))
    return torch.where(b >= 128, -mag, mag)


def dequantize_torch(w: QLinear, dtype=None) -> torch.Tensor:
    """Plain-PyTorch dequantization: QLinear -> dense W [N, K] (float32 unless dtype given)."""
    _need_torch()
    epw = 32 // w.bits
    wpg = w.group_size // epw
    ng = w.k // w.group_size
    codes = _unpack(w.weight, w.bits).view(w.n, ng, wpg, epw).permute(0, 1, 3, 2)
    codes = codes.reshape(w.n, w.k).to(torch.int64)
    scales = _untile_rows(w.scales, w.n)
    if w.mode == "affine":
        q = codes.to(torch.float32)
        s = scales.to(torch.float32).repeat_interleave(w.group_size, 1)
        b = _untile_rows(w.biases, w.n).to(torch.float32)
        out = q * s + b.repeat_interleave(w.group_size, 1)
    else:
        if w.mode == "mxfp8":
            v = _e4m3_to_float(codes)
        else:
            lut = torch.tensor(_E2M1, device=codes.device)
            v = torch.where(codes >= 8, -lut[codes & 7], lut[codes & 7])
        sc = scales.to(torch.int32)
        if w.mode == "nvfp4":
            sf = _e4m3_to_float(sc)
        else:
            sf = torch.exp2(sc.to(torch.float32) - 127)
        out = v * sf.repeat_interleave(w.group_size, 1)
    return out if dtype is None else out.to(dtype)


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _group_scale(s_ptr, b_ptr, offs, mask, MODE: tl.constexpr):
        """Per-group scale and bias as fp32 [.., ..] (bias only in affine mode)."""
        if MODE == 0:
            s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            e = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.uint32)
            if MODE == 2:  # E4M3 code -> its value times 2^-120 as float bits, then exact
                bits = ((e & 0x7F) << 20) | ((e & 0x80) << 24)
                s = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36
            else:  # E8M0 code e -> 2^(e-127); e == 0 is the denormal 2^-127
                bits = tl.where(e == 0, 0x00400000, e << 23)
                s = bits.to(tl.float32, bitcast=True)
            b = s  # unused outside affine mode
        return s, b

    @triton.jit
    def _decode_pos(words, I: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr):
        """Position I of every packed word -> fp32 = value * 2^-(149 - shift) (affine) etc.

        Returns (f, xk): f the decoded float, xk the power of two to multiply x by so that
        x*xk*f equals x*value*2^-49 (affine), 2^-26 (fp4) or 2^-20 (fp8) without denormals.
        """
        if MODE == 0:
            if BITS * I + BITS <= 23:  # field fits in the mantissa where it lies
                SH: tl.constexpr = BITS * I
                src = words
            else:
                SH: tl.constexpr = BITS * I - 16
                src = words >> 16
            f = (src & (((1 << BITS) - 1) << SH)).to(tl.float32, bitcast=True)
            xk = 1.2676506002282294e30 / (1 << SH)  # 2^100 / 2^SH: product = x*q*2^-49
        elif MODE == 3:  # E4M3: magnitude bits -> 20..26, sign -> 31: value * 2^-120
            t = words >> (8 * I)
            f = (((t << 20) & 0x07F00000) | ((t << 24) & 0x80000000)).to(tl.float32, bitcast=True)
            xk = 1.2676506002282294e30
        else:  # E2M1: magnitude bits -> 22..24, sign -> 31: value * 2^-126
            # one multiply adds two shifted copies of the isolated nibble (no carries: they
            # land on bits 22..25 and 28..31); the mask keeps 22..24 of one, 31 of the other
            if I < 4:
                J: tl.constexpr = I
                src = words
            else:
                J: tl.constexpr = I - 4
                src = words >> 16
            u = src & (0xF << (4 * J))
            v = u * ((1 << (22 - 4 * J)) + (1 << (28 - 4 * J)))
            f = (v & 0x81C00000).to(tl.float32, bitcast=True)
            xk = 1.2676506002282294e30
        return f, xk

    @triton.jit
    def _splitk_epilogue(
        acc,
        y_ptr,
        part_ptr,
        cnt_ptr,
        rm,
        rn,
        M,
        N,
        stride_ym,
        stride_split,
        tile_id,
        pid_k,
        SPLIT_K: tl.constexpr,
    ):
        """Write acc [BM, BN] to y, or, with split-K, through the partials buffer [S, M, N]
        (split s at part_ptr + s*stride_split):
        the last program of a tile (by an atomic ticket) sums the partials, writes y and
        resets the ticket to 0 for the next launch (one launch, no memset)."""
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            p_ptrs = part_ptr + rm[:, None] * N + rn[None, :]
            tl.store(p_ptrs + pid_k * stride_split, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is issued before the ticket is taken
            ticket = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                total = tl.zeros_like(acc)
                for s in range(SPLIT_K):
                    total += tl.load(
                        p_ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _load_step(w_ptr, rn, n_mask, rkw, kb, stride_wn, DO=True):
        """Words [BLOCK_N, 128] of k-step kb (128 words of each row; stride_wn = words/row)."""
        kw = kb * 128 + rkw
        mask = n_mask[:, None] & (kw < stride_wn)[None, :] & DO
        return tl.load(w_ptr + rn[:, None] * stride_wn + kw[None, :], mask=mask, other=0)

    @triton.jit
    def _gemv_kernel(
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
        BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr,
        KB_PER_SPLIT: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        """y[m, N] = x[m, K] @ W^T for one row m of x: CUDA-core FMA on decoded codes.

        One warp per program (launch with num_warps=1): lane l loads words 4l..4l+3 of each of
        BLOCK_N rows per k-step of 128 words, so the x slices and the row-inner scale tiles it
        needs land in the same lanes with no layout change (no shared memory, no barrier).
        Program (m, pid_n, pid_k) covers rows [pid_n*BLOCK_N, +BLOCK_N) and k-steps
        [pid_k*KB_PER_SPLIT, +KB_PER_SPLIT); m is the fastest grid axis, so the programs of
        several rows of x read the same weights back to back (from L2).
        """
        EPW: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = G // EPW
        NG: tl.constexpr = 128 // WPG  # groups per k-step
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        KG = K // G
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rkw = tl.arange(0, 128)
        rg = tl.arange(0, NG)
        rw = tl.arange(0, WPG)
        s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
        x_base = x_ptr + m * stride_xm
        # per-(row, group) sums stay in registers across the loop; reduced over groups once
        acc2 = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
        kb0 = pid_k * KB_PER_SPLIT
        if PREFETCH:
            w_next = _load_step(w_ptr, rn, n_mask, rkw, kb0, stride_wn)
        for j in range(0, KB_PER_SPLIT):
            kb = kb0 + j
            if PREFETCH:  # the next step's words are in flight while this one computes
                w2 = w_next
                w_next = _load_step(w_ptr, rn, n_mask, rkw, kb + 1, stride_wn, j + 1 < KB_PER_SPLIT)
            else:
                w2 = _load_step(w_ptr, rn, n_mask, rkw, kb, stride_wn)
            words = tl.reshape(w2, [BLOCK_N, NG, WPG]).to(tl.uint32, bitcast=True)
            g_idx = kb * NG + rg  # [NG] group index along K
            g_mask = g_idx < KG
            s_offs = s_row[:, None] + g_idx[None, :] * 8
            smask = n_mask[:, None] & g_mask[None, :]
            scale, bias = _group_scale(s_ptr, b_ptr, s_offs, smask, MODE)
            x_row = x_base + g_idx[:, None] * G + rw[None, :]  # [NG, WPG]: position 0
            xmask = g_mask[:, None]
            p = tl.zeros([BLOCK_N, NG, WPG], dtype=tl.float32)
            xsum = tl.zeros([NG, WPG], dtype=tl.float32)
            for i in tl.static_range(EPW):
                xi = tl.load(x_row + i * WPG, mask=xmask, other=0.0).to(tl.float32)
                f, xk = _decode_pos(words, i, MODE, BITS)
                p += f * (xi * xk)[None, :, :]
                if MODE == 0:
                    xsum += xi
            # decoded products carry 2^-49 (affine), 2^-20 (fp8) or 2^-26 (fp4)
            if MODE == 0:
                t = (tl.sum(p, axis=2) * 562949953421312.0) * scale  # [BLOCK_N, NG]
                acc2 += t + bias * tl.sum(xsum, axis=1)[None, :]
            elif MODE == 3:
                acc2 += (tl.sum(p, axis=2) * 1048576.0) * scale
            else:
                acc2 += (tl.sum(p, axis=2) * 67108864.0) * scale
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
        tile = m * tl.num_programs(1) + pid_n
        _splitk_epilogue(acc, y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr, tl.arange(0, 1),
                         rn, 1, N, 0, M * N, tile, pid_k, SPLIT_K)  # fmt: skip

    @triton.jit
    def _decode_tile(words, scale, bias, MODE: tl.constexpr, BITS: tl.constexpr, EPW: tl.constexpr):
        """words [BN, NG, WPG] -> dequantized fp32 [BN, NG, EPW, WPG] (natural k order)."""
        sh = (tl.arange(0, EPW) * BITS)[None, None, :, None]
        t = words[:, :, None, :] >> sh
        if MODE == 0:
            q = ((t & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            v = q * scale[:, :, None, None] + bias[:, :, None, None]
        elif MODE == 3:
            f = (((t << 20) & 0x07F00000) | ((t << 24) & 0x80000000)).to(tl.float32, bitcast=True)
            v = (f * 1.329227995784916e36) * scale[:, :, None, None]  # 2^120
        else:
            f = (((t << 22) & 0x01C00000) | ((t << 28) & 0x80000000)).to(tl.float32, bitcast=True)
            v = (f * 8.507059173023462e37) * scale[:, :, None, None]  # 2^126
        return v

    @triton.jit
    def _gemm_kernel(
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
        SPLIT_K: tl.constexpr,
        KB_PER_SPLIT: tl.constexpr,
        GROUP_M: tl.constexpr,
        UPCAST: tl.constexpr,
        SWAP: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W^T on tensor cores; each W tile is dequantized in registers."""
        EPW: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = G // EPW
        BK: tl.constexpr = NG * G
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        # grouped order: GROUP_M row tiles share each weight tile while it sits in L2
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        gsize = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsize
        pid_n = (pid % width) // gsize
        KG = K // G
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = rm < M
        n_mask = rn < N
        rg = tl.arange(0, NG)
        rw = tl.arange(0, WPG)
        rk = tl.arange(0, BK)
        s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
        if SWAP:  # W tile as the first (register) operand: acc holds y^T [BLOCK_N, BLOCK_M]
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        kb0 = pid_k * KB_PER_SPLIT
        for j in range(0, KB_PER_SPLIT):
            kb = kb0 + j
            g_idx = kb * NG + rg
            g_mask = g_idx < KG
            w_ptrs = (
                w_ptr
                + rn[:, None, None] * stride_wn
                + g_idx[None, :, None] * WPG
                + rw[None, None, :]
            )
            wmask = n_mask[:, None, None] & g_mask[None, :, None]
            words = tl.load(w_ptrs, mask=wmask, other=0).to(tl.uint32, bitcast=True)
            s_offs = s_row[:, None] + g_idx[None, :] * 8
            smask = n_mask[:, None] & g_mask[None, :]
            scale, bias = _group_scale(s_ptr, b_ptr, s_offs, smask, MODE)
            wv = _decode_tile(words, scale, bias, MODE, BITS, EPW)
            k_idx = kb * BK + rk
            x_tile = tl.load(
                x_ptr + rm[:, None] * stride_xm + k_idx[None, :],
                mask=m_mask[:, None] & (k_idx[None, :] < K),
                other=0.0,
            )
            w_tile = tl.reshape(wv, [BLOCK_N, BK]).to(x_tile.dtype)
            if UPCAST:  # the interpreter multiplies bf16 tiles as raw uint16: go through fp32
                x_tile = x_tile.to(tl.float32)
                w_tile = w_tile.to(tl.float32)
            if SWAP:
                if x_tile.dtype == tl.float32 and not UPCAST:
                    acc = tl.dot(w_tile, tl.trans(x_tile), acc, input_precision="tf32x3")
                else:
                    acc = tl.dot(w_tile, tl.trans(x_tile), acc)
            elif x_tile.dtype == tl.float32 and not UPCAST:
                acc = tl.dot(x_tile, tl.trans(w_tile), acc, input_precision="tf32x3")
            else:
                acc = tl.dot(x_tile, tl.trans(w_tile), acc)
        if SWAP:
            acc = tl.trans(acc)
        _splitk_epilogue(
            acc, y_ptr, part_ptr, cnt_ptr, rm, rn, M, N, stride_ym, M * N, pid, pid_k, SPLIT_K
        )


# ----------------------------------------------------------------------------- dispatch

_COUNTERS: dict = {}  # device -> zeroed int32 tickets, reset by the kernels themselves


def _counters(device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


_SMS: dict = {}  # device -> multiprocessor count (the property query costs host time per call)


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small grid keeps the CPU tests fast
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters.

    kernel: "gemv" (one warp per program, k-steps of 128 words per row) or "gemm" (tl.dot,
    k-steps of ng groups). split_k: programs along K whose partials the last one sums.
    """

    kernel: str
    block_m: int
    block_n: int
    split_k: int
    ng: int = 1
    num_warps: int = 1
    num_stages: int = 1
    group_m: int = 8
    prefetch: bool = True
    swap: bool = False


def _split(n_tiles: int, ksteps: int, sms: int, waves: float) -> int:
    """Split K so that about waves*SMs programs run; each split gets whole k-steps."""
    want = max(1, min(ksteps, math.ceil(waves * sms / max(n_tiles, 1))))
    per = math.ceil(ksteps / want)
    return math.ceil(ksteps / per)


def choose_config(m: int, w: QLinear, device, x_dtype=None) -> KernelConfig:
    """Heuristic launch parameters for x [m, K] @ W^T (bench/tuning may override).

    Chosen from the H100 sweep in benchmarks/KERNEL_NOTES.md (run 3).
    """
    sms = _num_sms(device)
    if m <= GEMV_MAX_M:
        # 8 rows x 128 words per warp-step; split K only until ~4 warps per SM are in flight
        # (the sweep: more splits cost their partials and the ticket round trip)
        bn = 8
        ksteps = math.ceil(w.k * w.bits / 32 / 128)
        sk = _split(m * math.ceil(w.n / bn), ksteps, sms, 4.0)
        return KernelConfig("gemv", 1, bn, sk)
    g = w.group_size
    swap = False
    if device.type == "cpu":  # interpreter: small tiles keep the CPU tests fast
        bm, bn, ng, warps = 32, 64, max(1, 256 // g), 4
    elif x_dtype == torch.float32:  # tf32x3 needs 3 MMAs and hi/lo operands: small tiles
        bm, bn, ng, warps = 16, 64, max(1, 64 // g), 4
    elif m <= 16:
        bm, bn, ng, warps = 16, 64, max(1, 256 // g), 4
    elif w.mode == "affine" and w.bits == 4 and g == 64:  # measured best (0.81x the time)
        bm, bn, ng, warps, swap = 128, 128, 2, 8, True
    elif w.mode in ("mxfp4", "mxfp8"):  # measured best: 128x256 tiles, k-step 64
        bm, bn, ng, warps = 128, 256, 2, 8
    else:
        bm, bn, ng, warps = 128, 128, max(1, 128 // g), 8
    ksteps = math.ceil(w.k / (ng * g))
    tiles = math.ceil(m / bm) * math.ceil(w.n / bn)
    sk = _split(tiles, ksteps, sms, 2.0) if tiles < sms else 1
    return KernelConfig("gemm", bm, bn, sk, ng, warps, 3, swap=swap)


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


def qmatmul(x: torch.Tensor, w: QLinear, config: KernelConfig | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T -> [..., N] in x's dtype, W quantized (QLinear)."""
    _need_torch()
    _check_runtime(x)
    if x.shape[-1] != w.k:
        raise MlxrunError(f"input has {x.shape[-1]} features but the weight expects {w.k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise MlxrunError(f"qmatmul takes bf16/fp16/fp32 inputs, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, w.n)
    # The kernels index rows of x and y in 32 bits: a prefill of many sequences at once (an
    # 8B model at batch 198 x 512 tokens reaches 2.9e9 output elements) runs in row blocks.
    rows = MAX_INDEX // max(w.n, w.k)
    if m > rows:
        for r in range(0, m, rows):
            y[r : r + rows] = qmatmul(x2[r : r + rows], w, config)
        return y.reshape(*lead, w.n)
    cfg = config or choose_config(m, w, x.device, x.dtype)
    if cfg.kernel == "gemv":
        ksteps = math.ceil(w.k * w.bits // 32 / 128)
    else:
        ksteps = math.ceil(w.k / (cfg.ng * w.group_size))
    per = math.ceil(ksteps / cfg.split_k)
    split = math.ceil(ksteps / per)  # no empty splits
    biases = w.biases if w.biases is not None else w.scales
    common = dict(
        MODE=_MODE_ID[w.mode],
        BITS=w.bits,
        G=w.group_size,
        BLOCK_N=cfg.block_n,
        SPLIT_K=split,
        KB_PER_SPLIT=per,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.kernel == "gemv":
        tiles = math.ceil(w.n / cfg.block_n)
        grid = (m, tiles, split)
        kern, extra = _gemv_kernel, dict(PREFETCH=cfg.prefetch and per > 1)
    else:
        tiles = math.ceil(m / cfg.block_m) * math.ceil(w.n / cfg.block_n)
        grid = (tiles, split)
        kern = _gemm_kernel
        extra = dict(
            BLOCK_M=cfg.block_m,
            NG=cfg.ng,
            GROUP_M=cfg.group_m,
            UPCAST=x.device.type != "cuda",
            SWAP=cfg.swap,
        )
    part = torch.empty((split, m, w.n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = _counters(x.device, m * tiles) if split > 1 else y
    kern[grid](
        x2, w.weight, w.scales, biases, y, part, cnt, m, w.n, w.k, x2.stride(0), y.stride(0),
        w.weight.stride(0), **common, **extra,
    )  # fmt: skip
    return y.reshape(*lead, w.n)
