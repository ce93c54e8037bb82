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
next to each other, so M > 1 re-reads the weights from L2), larger M
uses a tensor-core GEMM (tl.dot) that dequantizes each weight tile in registers.
Without Triton or a GPU, `dequantize_torch` gives the dense weight for one layer at a time.
"""

from __future__ import annotations

import dataclasses
import functools
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

    try:
        from triton.language.extra import cuda as tlc
    except ImportError:  # no grid dependency control: pdl() is then False
        tlc = None
    _TRITON_ERROR = None
except Exception as e:  # ImportError, or a triton that cannot load its libraries
    triton = None
    tl = None
    tlc = None
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
# The most warps a GEMV program splits K across; MLXRUN_GEMV_WARPS=1 gives the one-warp
# configs (for A/B timing)
GEMV_WARPS = int(os.environ.get("MLXRUN_GEMV_WARPS", "4"))
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


# Bit j (m, e0, e1, sign) of the E2M1 code at position i of a prepared word is bit
# _E2M1_BITS[i][j]. Positions 0-2 and 4-6 keep m, e0, e1 next to each other and the sign 9
# bits above them: the distance from bits 22..24 (where a float's exponent and mantissa read
# them exactly) to bit 31, so one shift and one mask decode them. 3 and 7 take the bits left
# over. Each 16-bit half has the same pattern (positions 0-3, 4-7), which the GEMM's packed
# pairs need. Contiguous nibbles took a mask, a multiply (two copies of the nibble) and a
# mask each: the GEMV's k-step went 1204 -> 948 SASS instructions (mxfp4, sass_count.py).
_E2M1_BITS = (
    (0, 1, 2, 9),
    (3, 4, 5, 12),
    (6, 7, 8, 15),
    (13, 14, 10, 11),
    (16, 17, 18, 25),
    (19, 20, 21, 28),
    (22, 23, 24, 31),
    (29, 30, 26, 27),
)


def _code_bits(mode: str | None, device) -> torch.Tensor | None:
    """[EPW, bits] word bit of each code bit in a prepared word, or None for plain fields
    (position i at bits i*bits..). mode None: the canonical (MLX) layout."""
    if mode in ("mxfp4", "nvfp4"):
        return torch.tensor(_E2M1_BITS, device=device, dtype=torch.int64)
    return None


def _repack(codes: torch.Tensor, bits: int, group_size: int, mode: str) -> torch.Tensor:
    """codes uint8 [N, K] (natural order) -> int32 [N, K*bits/32] in the group-transposed order
    (E2M1 codes with their bits placed as _E2M1_BITS)."""
    n, k = codes.shape
    epw = 32 // bits
    wpg = group_size // epw
    # element (g, i, w) of the group-transposed order is input g*G + i*WPG + w
    c = codes.view(n, k // group_size, epw, wpg).permute(0, 1, 3, 2).to(torch.int64)
    table = _code_bits(mode, codes.device)
    if table is None:
        shifts = torch.arange(epw, device=codes.device, dtype=torch.int64) * bits
        words = (c << shifts).sum(-1)  # [N, K/G, WPG]; disjoint bit fields, so sum == or
    else:
        words = sum(((c >> j) & 1) << table[:, j] for j in range(bits)).sum(-1)
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


def _unpack(words: torch.Tensor, bits: int, mode: str | None = None) -> torch.Tensor:
    """int32 [N, W] -> uint8 codes [N, W*32/bits], position i of word w at column w*epw + i.
    mode None: canonical words; else words as `_repack` wrote them for that mode."""
    epw = 32 // bits
    w = words.to(torch.int64)[..., None]
    table = _code_bits(mode, words.device)
    if table is None:
        shifts = torch.arange(epw, device=words.device, dtype=torch.int64) * bits
        c = (w >> shifts) & ((1 << bits) - 1)
    else:
        c = sum(((w >> table[:, j]) & 1) << j for j in range(bits))
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
        [_repack(_unpack(w[i : i + step], bits), bits, group_size, mode) for i in range(0, n, step)]
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
    codes = _unpack(w.weight, w.bits, w.mode).view(w.n, ng, wpg, epw).permute(0, 1, 3, 2)
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
    def _scale_code(e, MODE: tl.constexpr):
        """An 8-bit scale code (uint32) as its fp32 value."""
        if MODE == 2:  # E4M3 code -> its value times 2^-120 as float bits, then exact
            bits = ((e & 0x7F) << 20) | ((e & 0x80) << 24)
            s = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36
        else:  # E8M0 code e -> 2^(e-127); e == 0 is the denormal 2^-127
            bits = tl.where(e == 0, 0x00400000, e << 23)
            s = bits.to(tl.float32, bitcast=True)
        return s

    @triton.jit
    def _group_scale(s_ptr, b_ptr, offs, mask, MODE: tl.constexpr):
        """Per-group scale and bias as fp32 [.., ..] (bias only in affine mode)."""
        if MODE == 0:
            s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            e = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.uint32)
            s = _scale_code(e, MODE)
            b = s  # unused outside affine mode
        return s, b

    @triton.jit
    def _decode_pos(w, I: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr):
        """Position I of the packed words w (uint32) -> fp32 f = value * 2^(SH-149) (affine),
        value * 2^-120 (E4M3) or value * 2^-126 (E2M1); SH = _pos_shift(I, MODE, BITS).

        Affine: a float bit pattern below 2^24 reads as pattern * 2^-149 (denormals and the
        exponent-1 binade are linear), so a code masked in place at bits SH..SH+BITS-1 <= 23
        *is* q * 2^(SH-149): one LOP3. A code that reaches bit 24 is read by a shift alone:
        w >> BITS*I (SH = 0) leaves the code plus the codes above it times 2^BITS: for the top
        position nothing is above; for 4-bit position 6 (w >> 24 = q6 + 16*q7) the kernel
        gives position 7 the input x7 - 16*x6, which cancels the 16*q7 term.
        """
        if MODE == 0:
            if BITS * I + BITS <= 24:
                f = (w & (((1 << BITS) - 1) << (BITS * I))).to(tl.float32, bitcast=True)
            else:
                f = (w >> (BITS * I)).to(tl.float32, bitcast=True)
        elif MODE == 3:  # E4M3: magnitude bits -> 20..26, sign -> 31: value * 2^-120
            t = w >> (8 * I)
            f = (((t << 20) & 0x07F00000) | ((t << 24) & 0x80000000)).to(tl.float32, bitcast=True)
        else:  # E2M1 in prepare's layout (_E2M1_BITS): magnitude -> 22..24, sign -> 31
            if I == 3:  # m, e0 at 13, 14, e1 at 10, sign at 11: one multiply adds three
                # copies of the isolated bits (shifted by 9, 14, 20; no carries between them)
                v = (w & 0x6C00) * ((1 << 9) + (1 << 14) + (1 << 20))
            elif I == 7:  # the same 16 bits higher, moved down to 19, 20, 22, 23 first
                v = ((w >> 7) & 0x00D80000) * (1 + (1 << 5) + (1 << 11))
            elif I == 6:  # m, e0, e1 at 22..24, sign at 31: in place
                v = w
            else:  # positions 0-2 at 3*I, 4-5 at 16 + 3*(I-4): m, e0, e1 then sign 9 above
                v = w << (22 - 3 * I if I < 3 else 6 - 3 * (I - 4))
            f = (v & 0x81C00000).to(tl.float32, bitcast=True)
        return f

    @triton.jit
    def _gemv_x4(x_ptr, offs, mask, I: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                 EVEN: tl.constexpr):  # fmt: skip
        """Inputs of position I for a lane's 4 words: offs [32, 2] are the offsets, in pairs
        of inputs, of the lane's two word pairs. Returns x0..x3 [32] fp32, each x * 2^(100-SH)
        (the power of two that keeps x * decoded code normal; SH as in _decode_pos).

        bf16 inputs are loaded as uint32 pairs; bf16 -> fp32 * 2^(100-SH) is then one integer
        op per input: (v << 16) + E (one LEA) and (v & 0xFFFF0000) + E, E = (100-SH) << 23
        added to the exponent field (x == 0 becomes 2^(-27-SH): its products underflow to 0).
        """
        if MODE == 0 and BITS * I + BITS <= 24:
            SH: tl.constexpr = BITS * I
        else:
            SH: tl.constexpr = 0
        if x_ptr.dtype.element_ty == tl.bfloat16:
            p32 = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
            if EVEN:
                v = tl.load(p32 + offs)
            else:
                v = tl.load(p32 + offs, mask=mask, other=0)
            va, vb = tl.split(v)
            E: tl.constexpr = 0 if MODE == 3 else (100 - SH) << 23
            x0 = ((va << 16) + E).to(tl.float32, bitcast=True)
            x1 = ((va & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
            x2 = ((vb << 16) + E).to(tl.float32, bitcast=True)
            x3 = ((vb & 0xFFFF0000) + E).to(tl.float32, bitcast=True)
        else:
            eo = offs[:, :, None] * 2 + tl.arange(0, 2)[None, None, :]  # [32, 2, 2] inputs
            if EVEN:
                xv = tl.load(x_ptr + eo)
            else:
                xv = tl.load(x_ptr + eo, mask=mask[:, :, None], other=0.0)
            if MODE != 3:
                xv = xv.to(tl.float32) * (1.2676506002282294e30 / (1 << SH))
            else:
                xv = xv.to(tl.float32)
            lo, hi = tl.split(xv)  # [32, 2]: first / second input of each pair
            x0, x2 = tl.split(lo)
            x1, x3 = tl.split(hi)
        return x0, x1, x2, x3

    @triton.jit
    def _gemv_xsum(x0, x1, x2, x3, I: tl.constexpr, BITS: tl.constexpr):
        """sum of 4 affine inputs of position I from _gemv_x4, times 2^-49 (undoes 2^(100-SH))."""
        if BITS * I + BITS <= 24:
            C: tl.constexpr = 1.401298464324817e-45 * (1 << (BITS * I))
        else:
            C: tl.constexpr = 1.401298464324817e-45
        return (x0 + x1 + x2 + x3) * C

    @triton.jit
    def _gemv_scale(s_ptr, b_ptr, offs, mask, MODE: tl.constexpr, EVEN: tl.constexpr):
        """Per-group scale and bias [8, 32] as fp32 (bias only in affine mode); GEMV copy of
        _group_scale without masks when EVEN (one vector of a scale tile's 8 rows a lane)."""
        if MODE == 0:
            if EVEN:
                s = tl.load(s_ptr + offs)
                b = tl.load(b_ptr + offs)
            else:
                s = tl.load(s_ptr + offs, mask=mask, other=0.0)
                b = tl.load(b_ptr + offs, mask=mask, other=0.0)
            if s_ptr.dtype.element_ty == tl.bfloat16:  # one shift or mask per value
                s = (s.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                b = (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                s = s.to(tl.float32)
                b = b.to(tl.float32)
        else:
            if EVEN:
                e = tl.load(s_ptr + offs).to(tl.uint32)
            else:
                e = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.uint32)
            s = _scale_code(e, MODE)
            b = s  # unused outside affine mode
        return s, b

    @triton.jit
    def _split_sum(acc, p_ptrs, mask, cnt_ptr, tile_id, pid_k, stride_split,
                   SPLIT_K: tl.constexpr):  # fmt: skip
        """Split-K through the partials buffer: store this split's acc at p_ptrs (split s at
        + s*stride_split) and take the tile's atomic ticket. Returns (last, total): the last
        program of the tile gets the sum of every split's partial and resets the ticket to 0
        for the next launch (one launch, no memset); the others get (False, zeros)."""
        tl.store(p_ptrs + pid_k * stride_split, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is issued before the ticket is taken
        ticket = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLIT_K - 1
        total = tl.zeros_like(acc)
        if last:
            for s in range(SPLIT_K):
                total += tl.load(
                    p_ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")
        return last, total

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
        (split s at part_ptr + s*stride_split), the last program of a tile writing the sum
        (_split_sum)."""
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            p_ptrs = part_ptr + rm[:, None] * N + rn[None, :]
            last, total = _split_sum(acc, p_ptrs, mask, cnt_ptr, tile_id, pid_k, stride_split,
                                     SPLIT_K)  # fmt: skip
            if last:
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_store(g, u, y_ptrs, mask=None):
        """y = silu(g) * u, each product rounded to y's dtype first (as the GEMV's output is,
        and as F.silu rounds before the multiply)."""
        dt = y_ptrs.dtype.element_ty
        g = g.to(dt).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(y_ptrs, (silu * u.to(dt).to(tl.float32)).to(dt), mask=mask)

    @triton.jit
    def _silu_epilogue(g, u, y_ptr, part_ptr, cnt_ptr, rn, rn_h, N, stride_split, tile_id,
                       pid_k, SPLIT_K: tl.constexpr):  # fmt: skip
        """_splitk_epilogue for SILU: gate rows rn and up rows rn_h of the partials; y's
        columns are the gate rows."""
        if SPLIT_K == 1:
            _silu_store(g, u, y_ptr + rn)
        else:
            rows = tl.join(rn, rn_h)  # [8 or 4, 2]
            last, total = _split_sum(tl.join(g, u), part_ptr + rows, rows < N, cnt_ptr,
                                     tile_id, pid_k, stride_split, SPLIT_K)  # fmt: skip
            if last:
                gt, ut = tl.split(total)
                _silu_store(gt, ut, y_ptr + rn)

    @triton.jit
    def _load_step(w_ptr, rn, n_mask, rkw, kb, stride_wn, EVEN: tl.constexpr, MODE: tl.constexpr,
                   LANES: tl.constexpr):  # fmt: skip
        """Words [8, 4*LANES] of k-step kb of rows rn (stride_wn = words/row); E4M3 (MODE 3):
        the same bytes as [8, 16*LANES] uint8 (converted by the hardware).
        EVEN: no row/K masks (stride_wn is then a constexpr: rows at immediate offsets)."""
        if MODE == 3:
            kw = kb * (16 * LANES) + tl.arange(0, 16 * LANES)  # bytes
            base = w_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
            row = stride_wn * 4
        else:
            kw = kb * (4 * LANES) + rkw
            base = w_ptr
            row = stride_wn
        ptrs = base + rn[:, None] * row + kw[None, :]
        if EVEN:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=n_mask[:, None] & (kw < row)[None, :], other=0)
        return w

    @triton.jit
    def _gemv_words(w2, LANES: tl.constexpr):
        """[8, 4*LANES] words -> 4 x [8, LANES] (word 4l+j of each row in lane l, j = 0..3)."""
        w4 = tl.reshape(w2.to(tl.uint32, bitcast=True), [8, LANES, 2, 2])
        w_even, w_odd = tl.split(w4)  # words 4l+2c / 4l+2c+1, [8, LANES, 2]
        w0, w2_ = tl.split(w_even)
        w1, w3 = tl.split(w_odd)
        return w0, w1, w2_, w3

    @triton.jit
    def _split22(t):
        """t [.., 2, 2] -> t[.., 0, 0], t[.., 0, 1], t[.., 1, 0], t[.., 1, 1]."""
        lo, hi = tl.split(t)  # last index 0 / 1
        a00, a10 = tl.split(lo)
        a01, a11 = tl.split(hi)
        return a00, a01, a10, a11

    @triton.jit
    def _gemv_fp8(p, wb, x_base, xo, xmask, G: tl.constexpr, BITS: tl.constexpr,
                  EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
        """p [8, LANES] += E4M3 bytes wb [8, 16*LANES] (word 4l+j, position b at byte
        16l+4j+b) x x: the bytes become fp32 by the hardware conversion (E4M3 pairs -> f16x2
        -> f32)."""
        WPG: tl.constexpr = G // 4
        v = tl.reshape(wb.to(tl.float8e4nv, bitcast=True).to(tl.float32), [8, LANES, 4, 2, 2])
        f0, f1, f2, f3 = _split22(v)  # positions b = 0..3: [8, LANES, 4] (word j)
        for b in tl.static_range(4):
            if b == 0:
                fb = f0
            elif b == 1:
                fb = f1
            elif b == 2:
                fb = f2
            else:
                fb = f3
            g0, g1, g2, g3 = _split22(tl.reshape(fb, [8, LANES, 2, 2]))  # words j = 0..3
            x0, x1, x2, x3 = _gemv_x4(x_base, xo + b * (WPG // 2), xmask, b, 3, BITS, EVEN)
            p = p + g0 * x0[None, :] + g1 * x1[None, :] + g2 * x2[None, :] + g3 * x3[None, :]
        return p

    @triton.jit
    def _gemv_fma(p, pb, w0, w1, w2, w3, x0, x1, x2, x3, I: tl.constexpr, MODE: tl.constexpr,
                  BITS: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
        """p (+ pb: words 2, 3 when TWO) += decoded position I of 8 rows x this lane's inputs;
        p + a + b + ... left to right: one FFMA chain per row."""
        f0 = _decode_pos(w0, I, MODE, BITS)
        f1 = _decode_pos(w1, I, MODE, BITS)
        f2 = _decode_pos(w2, I, MODE, BITS)
        f3 = _decode_pos(w3, I, MODE, BITS)
        if TWO:
            p = p + f0 * x0[None, :] + f1 * x1[None, :]
            pb = pb + f2 * x2[None, :] + f3 * x3[None, :]
        else:
            p = p + f0 * x0[None, :] + f1 * x1[None, :] + f2 * x2[None, :] + f3 * x3[None, :]
        return p, pb

    @triton.jit
    def _gemv_apply(acc, p, pb, xsum, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, kb, KG,
                    MODE: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                    EVEN: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
        """acc [8, LANES] += p * scale (+ bias * xsum) with the scales of this lane's groups."""
        EPW: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = G // EPW
        NG: tl.constexpr = 4 * LANES // WPG  # groups per k-step
        g_idx = kb * NG + g_a  # [LANES]
        smask = n_mask[:, None] & (g_idx < KG)[None, :]
        scale, bias = _gemv_scale(s_ptr, b_ptr, s_row[:, None] + g_idx[None, :] * 8, smask,
                                  MODE, EVEN)  # fmt: skip
        if MODE == 0:
            acc = acc + p * scale + bias * xsum[None, :]
        elif WPG < 4:
            g_idx2 = kb * NG + g_b
            smask2 = n_mask[:, None] & (g_idx2 < KG)[None, :]
            scale2, _ = _gemv_scale(s_ptr, b_ptr, s_row[:, None] + g_idx2[None, :] * 8, smask2,
                                    MODE, EVEN)  # fmt: skip
            acc = acc + p * scale + pb * scale2
        else:
            acc = acc + p * scale
        return acc

    @triton.jit
    def _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a, g_b, s_row, s_row_h,
                   n_mask, n_mask_h, s_ptr, b_ptr, KG, MODE: tl.constexpr, BITS: tl.constexpr,
                   G: tl.constexpr, HALVES: tl.constexpr, EVEN: tl.constexpr,
                   LANES: tl.constexpr):  # fmt: skip
        """One k-step of _gemv_kernel for 8 rows (HALVES == 1) or 16 (wa_h, acc_h: rows 8..15,
        sharing the x inputs): acc [8, LANES] += this lane's 4 words of each row (wa [8,
        4*LANES]) times x, with the scales (and biases) of their groups."""
        EPW: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = G // EPW
        NG: tl.constexpr = 4 * LANES // WPG  # groups per k-step
        TWO: tl.constexpr = WPG < 4  # nvfp4: a lane's words 0,1 and 2,3 are in two groups
        TRICK: tl.constexpr = MODE == 0 and BITS == 4  # positions 6, 7 by shifts alone
        NPOS: tl.constexpr = 0 if MODE == 3 else (EPW - 2 if TRICK else EPW)
        p = tl.zeros([8, LANES], dtype=tl.float32)
        pb = tl.zeros([8, LANES], dtype=tl.float32)
        q = tl.zeros([8, LANES], dtype=tl.float32)
        qb = tl.zeros([8, LANES], dtype=tl.float32)
        xo = x_pair0 + kb * (NG * G // 2)
        xmask = (kb * NG + g_pair) < KG
        if MODE == 3:  # E4M3 bytes -> fp32 values by cvt (2 an instruction), x unscaled
            p = _gemv_fp8(p, wa, x_base, xo, xmask, G, BITS, EVEN, LANES)
            if HALVES == 2:
                q = _gemv_fp8(q, wa_h, x_base, xo, xmask, G, BITS, EVEN, LANES)
        else:
            w0, w1, w2, w3 = _gemv_words(wa, LANES)
            if HALVES == 2:
                v0, v1, v2, v3 = _gemv_words(wa_h, LANES)
        xsum = tl.zeros([LANES], dtype=tl.float32)  # sum of the lane's inputs * 2^-49
        for i in tl.static_range(NPOS):
            x0, x1, x2, x3 = _gemv_x4(x_base, xo + i * (WPG // 2), xmask, i, MODE, BITS, EVEN)
            p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, x0, x1, x2, x3, i, MODE, BITS, TWO)
            if HALVES == 2:
                q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, x0, x1, x2, x3, i, MODE, BITS, TWO)
            if MODE == 0:
                xsum += _gemv_xsum(x0, x1, x2, x3, i, BITS)
        if TRICK:  # position 6: w >> 24 = q6 + 16*q7; position 7: w >> 28 = q7, x7 - 16*x6
            y0, y1, y2, y3 = _gemv_x4(x_base, xo + 6 * (WPG // 2), xmask, 6, MODE, BITS, EVEN)
            z0, z1, z2, z3 = _gemv_x4(x_base, xo + 7 * (WPG // 2), xmask, 7, MODE, BITS, EVEN)
            xsum += (y0 + y1 + y2 + y3 + z0 + z1 + z2 + z3) * 1.401298464324817e-45
            z0 = z0 - 16.0 * y0
            z1 = z1 - 16.0 * y1
            z2 = z2 - 16.0 * y2
            z3 = z3 - 16.0 * y3
            p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, y0, y1, y2, y3, 6, MODE, BITS, TWO)
            p, pb = _gemv_fma(p, pb, w0, w1, w2, w3, z0, z1, z2, z3, 7, MODE, BITS, TWO)
            if HALVES == 2:
                q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, y0, y1, y2, y3, 6, MODE, BITS, TWO)
                q, qb = _gemv_fma(q, qb, v0, v1, v2, v3, z0, z1, z2, z3, 7, MODE, BITS, TWO)
        acc = _gemv_apply(acc, p, pb, xsum, s_ptr, b_ptr, s_row, n_mask, g_a, g_b, kb, KG,
                          MODE, G, BITS, EVEN, LANES)  # fmt: skip
        if HALVES == 2:
            acc_h = _gemv_apply(acc_h, q, qb, xsum, s_ptr, b_ptr, s_row_h, n_mask_h, g_a, g_b,
                                kb, KG, MODE, G, BITS, EVEN, LANES)  # fmt: skip
        return acc, acc_h

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
        EVEN: tl.constexpr = False,
        KW: tl.constexpr = 0,
        PDL: tl.constexpr = False,
        SILU: tl.constexpr = False,
        WARPS: tl.constexpr = 1,
    ):
        """y[m, N] = x[m, K] @ W^T for one row m of x: CUDA-core FMA on decoded codes.

        WARPS warps per program (launch with num_warps=WARPS), BLOCK_N = 8 or 16 rows (two
        halves of 8 sharing each x input). Lane l of the LANES = 32*WARPS loads words
        4l..4l+3 of each row per k-step of 4*LANES words, split into 4 [8, LANES] tensors (one
        word per lane and row), so each row's dot product is one FFMA chain per lane over its
        4 words and all positions, and the x inputs and row-inner scale tiles it needs land in
        the same lanes (no shared memory, no barrier, no shuffle in the loop). Scale and bias
        are applied per lane (acc += p*s + b*sum(x)); the lanes are summed once after the
        loop, across warps through shared memory: WARPS > 1 splits K inside the program,
        without the partials and ticket round trip of SPLIT_K. With PREFETCH the
        loop runs two k-steps per iteration, each step's words loaded one step ahead (two
        register buffers, no copies).
        Program (m, pid_n, pid_k) covers rows [pid_n*BLOCK_N, +BLOCK_N) and k-steps
        [pid_k*KB_PER_SPLIT, +KB_PER_SPLIT); m is the fastest grid axis, so the programs of
        several rows of x read the same weights back to back (from L2).
        EVEN: N % BLOCK_N == 0 and whole k-steps in every split: no masks; KW: the words per
        row (stride_wn) as a constant, or 0.
        PDL (launched with programmatic dependent launch): the first k-step's words are
        loaded before waiting for the previous kernel (weights depend on no kernel); x, the
        partials and y only after. The next kernel is let in after the wait, not before: a
        trigger at entry lets every later kernel of the step launch at once (each one's
        programs trigger on arrival), and their waiting programs and early loads crowd the
        SMs (H100: 4096x4096 7.5 -> 7.8 us, 6144x4096 9.5 -> 12.5 us).
        SILU (W = [gate; up], N/2 a multiple of 8): a tile's rows are gate rows and their up
        rows, N/2 further on (16 rows: 8 and 8; 8 rows: 4 and 4), and y[m, N/2] =
        silu(gate) * up, rounded as cuda_ops.silu_mul rounds the two products: no SiLU
        launch of its own.
        """
        tl.static_assert(BLOCK_N == 8 or BLOCK_N == 16)
        HALVES: tl.constexpr = BLOCK_N // 8
        LANES: tl.constexpr = 32 * WARPS
        EPW: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = G // EPW
        TWO: tl.constexpr = WPG < 4  # nvfp4: a lane's words 0,1 and 2,3 are in two groups
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        KG = K // G
        if KW > 0:
            swn = KW
        else:
            swn = stride_wn
        if SILU and HALVES == 2:
            rn = pid_n * 8 + tl.arange(0, 8)
            rn_h = rn + N // 2
        elif SILU:
            r8 = tl.arange(0, 8)
            rn = pid_n * 4 + r8 % 4 + (r8 // 4) * (N // 2)
            rn_h = rn  # unused
        else:
            rn = pid_n * BLOCK_N + tl.arange(0, 8)
            rn_h = rn + 8
        n_mask = rn < N
        n_mask_h = rn_h < N
        rkw = tl.arange(0, 4 * LANES)
        lane = tl.arange(0, LANES)
        s_row = (rn // 8) * (KG * 8) + (rn % 8)  # scales are stored [N/8, K/G, 8]
        s_row_h = (rn_h // 8) * (KG * 8) + (rn_h % 8)
        # pair c of lane l: words 4l+2c, 4l+2c+1; their inputs at position 0, in input pairs
        # (uint32 units: 2 inputs): one 8-byte vector per lane unless TWO (then 2 x 4 bytes)
        if TWO:
            x_pair0 = (2 * lane[:, None] + tl.arange(0, 2)[None, :]) * (G // 2)
            g_pair = 2 * lane[:, None] + tl.arange(0, 2)[None, :]
        else:
            xl = (lane // (WPG // 4)) * (G // 2) + (2 * lane) % (WPG // 2)
            x_pair0 = tl.multiple_of(xl, 2)[:, None] + tl.arange(0, 2)[None, :]
            g_pair = (lane // (WPG // 4))[:, None] + 0 * tl.arange(0, 2)[None, :]
        g_a = (4 * lane) // WPG  # group (within the k-step) of words 0, 1 of the lane
        g_b = (4 * lane + 2) // WPG  # of words 2, 3 (== g_a unless TWO)
        x_base = x_ptr + m * stride_xm
        acc = tl.zeros([8, LANES], dtype=tl.float32)
        acc_h = tl.zeros([8, LANES], dtype=tl.float32)
        kb0 = pid_k * KB_PER_SPLIT
        if PREFETCH:  # each step's words are in flight while the previous step computes
            # (with PDL the first step's are issued before the wait, while the previous kernel
            # still runs; a second step issued there too made ptxas hold it through the loop:
            # 134 -> 168 registers at 8 rows, 4096x14336 16.4 -> 21.9 us on the H100)
            wa = _load_step(w_ptr, rn, n_mask, rkw, kb0, swn, EVEN, MODE, LANES)
            wa_h = wa
            if HALVES == 2:
                wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb0, swn, EVEN, MODE, LANES)
            if PDL:
                tlc.gdc_wait()
                tlc.gdc_launch_dependents()
            kb_last = kb0 + KB_PER_SPLIT - 1
            for j in range(0, KB_PER_SPLIT // 2):
                kb = kb0 + 2 * j
                wb = _load_step(w_ptr, rn, n_mask, rkw, kb + 1, swn, EVEN, MODE, LANES)
                wb_h = wb
                if HALVES == 2:
                    wb_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb + 1, swn, EVEN, MODE, LANES)
                acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a,
                                        g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG,
                                        MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
                # past the last step: reload it (in bounds, no predicate, never used; peeling
                # the last pair instead makes ptxas spill at 16 rows)
                kn = tl.minimum(kb + 2, kb_last)
                wa = _load_step(w_ptr, rn, n_mask, rkw, kn, swn, EVEN, MODE, LANES)
                wa_h = wa
                if HALVES == 2:
                    wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kn, swn, EVEN, MODE, LANES)
                acc, acc_h = _gemv_step(acc, acc_h, wb, wb_h, kb + 1, x_base, x_pair0, g_pair,
                                        g_a, g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr,
                                        KG, MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
            if KB_PER_SPLIT % 2 == 1:
                acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, kb_last, x_base, x_pair0, g_pair,
                                        g_a, g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr,
                                        KG, MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
        else:
            if PDL:
                tlc.gdc_wait()
                tlc.gdc_launch_dependents()
            for j in range(0, KB_PER_SPLIT):
                kb = kb0 + j
                wa = _load_step(w_ptr, rn, n_mask, rkw, kb, swn, EVEN, MODE, LANES)
                wa_h = wa
                if HALVES == 2:
                    wa_h = _load_step(w_ptr, rn_h, n_mask_h, rkw, kb, swn, EVEN, MODE, LANES)
                acc, acc_h = _gemv_step(acc, acc_h, wa, wa_h, kb, x_base, x_pair0, g_pair, g_a,
                                        g_b, s_row, s_row_h, n_mask, n_mask_h, s_ptr, b_ptr, KG,
                                        MODE, BITS, G, HALVES, EVEN, LANES)  # fmt: skip
        # decoded products carry 2^-49 (affine), 2^-20 (fp8) or 2^-26 (fp4)
        if MODE == 0:
            C: tl.constexpr = 562949953421312.0
        elif MODE == 3:
            C: tl.constexpr = 1.0
        else:
            C: tl.constexpr = 67108864.0
        out = tl.sum(acc, axis=1) * C  # [8]
        tile = m * tl.num_programs(1) + pid_n
        if SILU and HALVES == 2:
            out_h = tl.sum(acc_h, axis=1) * C
            _silu_epilogue(out, out_h, y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr, rn,
                           rn_h, N, M * N, tile, pid_k, SPLIT_K)  # fmt: skip
        elif SILU:
            g, u = tl.split(tl.trans(tl.reshape(out, [2, 4])))  # rows 0-3 gate, 4-7 up
            rg = pid_n * 4 + tl.arange(0, 4)
            _silu_epilogue(g, u, y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr, rg,
                           rg + N // 2, N, M * N, tile, pid_k, SPLIT_K)  # fmt: skip
        else:
            if HALVES == 2:
                out_h = tl.sum(acc_h, axis=1) * C
                out = tl.reshape(tl.trans(tl.join(out, out_h)), [16])
            rn_all = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _splitk_epilogue(out[None, :], y_ptr + m * stride_ym, part_ptr + m * N, cnt_ptr,
                             tl.arange(0, 1), rn_all, 1, N, 0, M * N, tile, pid_k,
                             SPLIT_K)  # fmt: skip

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
        else:  # prepare's E2M1 layout: positions 3 and 7 as _decode_pos, the others shifted
            i = tl.arange(0, EPW)[None, None, :, None]
            w = words[:, :, None, :]
            sh = tl.where(i < 3, 22 - 3 * i, tl.maximum(18 - 3 * i, 0))  # m, e0, e1 -> 22..24
            odd = tl.where(i == 3, (w & 0x6C00) * 0x104200, ((w >> 7) & 0x00D80000) * 0x821)
            v = tl.where((i == 3) | (i == 7), odd, w << sh)
            f = (v & 0x81C00000).to(tl.float32, bitcast=True)
            v = (f * 8.507059173023462e37) * scale[:, :, None, None]  # 2^126
        return v

    # Packed bf16x2 dequantization for the GEMM (4-bit codes: affine with bf16 scales, mxfp4,
    # nvfp4; bf16 x). Each int32 holds two bf16 lanes. ASM: PTX inline assembly (GPU); else
    # the same bits in plain Triton (the interpreter has no inline assembly).

    @triton.jit
    def _gq_prmt(a, b, SEL: tl.constexpr, ASM: tl.constexpr):
        """PTX prmt.b32 with selector 0x5410 (low halves of a, b) or 0x7632 (high halves)."""
        if ASM:
            return tl.inline_asm_elementwise(
                "prmt.b32 $0, $1, $2, " + SEL + ";", "=r,r,r", [a, b], dtype=tl.int32,
                is_pure=True, pack=1)  # fmt: skip
        elif SEL == "0x5410":
            return (a & 0xFFFF) | (b << 16)
        else:
            return ((a >> 16) & 0xFFFF) | (b & -65536)

    @triton.jit
    def _gq_magic(t, ASM: tl.constexpr):
        """(t & 0x000F000F) | 0x43004300: the low nibble q of each half as the bf16 128 + q."""
        if ASM:  # one LOP3 (the compiler emits an AND and an OR for the plain expression)
            return tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [t], dtype=tl.int32,
                is_pure=True, pack=1)  # fmt: skip
        else:
            return (t & 0x000F000F) | 0x43004300

    @triton.jit
    def _gq_e2m1(r, B):
        """Position B (0-3) of the E2M1 codes in each half of r (prepare's layout, the same
        in both halves) -> bf16 pairs = value * 2^-126: m, e0, e1 -> bits 6..8 of the half,
        sign -> 15, by a shift (B 0-2) or as _decode_pos does position 3 (B == 3), then one
        mask. r: [.., 1, HW]; B: [.., 4, 1]."""
        odd = ((r >> 7) & 0x00D800D8) * 0x821  # m, e0 at 13, 14 -> 6, 7; e1 10 -> 8, s 11 -> 15
        return tl.where(B == 3, odd, r << tl.maximum(6 - 3 * B, 0)) & -2118090304  # 0x81C081C0

    @triton.jit
    def _gq_scale_pair(s_ptr, b_ptr, offs, mask, MODE: tl.constexpr, ASM: tl.constexpr):
        """Per-group scale and bias (affine; else bias 0) as bf16 pairs (int32) [BN, NG]."""
        if MODE == 0:
            s2 = _gq_pair(tl.load(s_ptr + offs, mask=mask, other=0.0), ASM)
            b2 = _gq_pair(tl.load(b_ptr + offs, mask=mask, other=0.0), ASM)
        else:
            e = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.int32)
            if MODE == 2:  # E4M3 scale: exact in fp32 (value * 2^-120 as bits, times 2^120)
                f = (((e & 0x7F) << 20) | ((e & 0x80) << 24)).to(tl.float32, bitcast=True)
                u = ((f * 1.329227995784916e36).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            else:  # E8M0 2^(e-127) as bf16 bits; e == 0 is the denormal 2^-127
                u = tl.where(e == 0, 0x40, e << 7)
            s2 = u | (u << 16)
            b2 = tl.full(s2.shape, -2147450880, tl.int32)  # 0x80008000: (-0, -0)
        return s2, b2

    @triton.jit
    def _gq_f32(v, HI: tl.constexpr):
        """bf16 lane (0 low, 1 high) of packed v -> fp32 (exact)."""
        if HI:
            return (v & -65536).to(tl.float32, bitcast=True)
        else:
            return (v << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _gq_bf16_bits(f):
        """fp32 -> bf16 bits (round to nearest even) in the low 16 bits of an int32."""
        b = f.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF

    @triton.jit
    def _gq_fma2(a, b, c, ASM: tl.constexpr):
        """Packed bf16x2: round_bf16(a * b + c) in each lane."""
        if ASM:
            return tl.inline_asm_elementwise(
                "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                is_pure=True, pack=1)  # fmt: skip
        else:
            lo = _gq_f32(a, 0) * _gq_f32(b, 0) + _gq_f32(c, 0)
            hi = _gq_f32(a, 1) * _gq_f32(b, 1) + _gq_f32(c, 1)
            return _gq_bf16_bits(lo) | (_gq_bf16_bits(hi) << 16)

    @triton.jit
    def _gq_pair(h, ASM: tl.constexpr):
        """bf16 tensor -> int32 holding it in both lanes."""
        if ASM:
            return tl.inline_asm_elementwise(
                "mov.b32 $0, {$1, $1};", "=r,h", [h], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            u = (h.to(tl.float32).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            return u | (u << 16)

    @triton.jit
    def _gq_unpair(v, ASM: tl.constexpr):
        """int32 holding a bf16 pair -> (low, high) as bf16 (ASM) or exact fp32 (interpreter):
        the inverse of _gq_pair."""
        if ASM:
            lo, hi = tl.inline_asm_elementwise(
                "mov.b32 {$0, $1}, $2;", "=h,=h,r", [v], dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=1)  # fmt: skip
        else:
            lo = _gq_f32(v, 0)
            hi = _gq_f32(v, 1)
        return lo, hi

    @triton.jit
    def _dequant_4bit_bf16x2(
        words, s2, b2, MODE: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr,
        WPG: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """4-bit words [BN, NG, WPG] (group-transposed, see the module docstring) with the
        scale and bias pairs of _gq_scale_pair [BN, NG] -> the W tile [BN, NG*G] in natural k
        order: bf16 (ASM) or fp32 holding the same bf16 values (interpreter).

        Two words 2j, 2j+1 of a group hold inputs g*G + i*WPG + 2j + {0, 1} at nibble i: one
        prmt puts nibbles 0-3 of both into one register (0x7632: nibbles 4-7), so a shift and
        one LOP3 give positions i of both as the bf16 pair (128 + q), two packed bf16 FMAs
        give q*s + b (q exact, one rounding, as the fp32 path rounded to bf16). The pair is
        two k-adjacent elements: wgmma's register-operand layout (kWidth 2) takes it as is,
        so Triton converts the tile to the dot layout in registers (no shared memory).
        About 2 instructions per weight element. E2M1 (MODE 1, 2): _gq_e2m1 gives the pair
        as value * 2^-126, two packed multiplies by 2^126 and the scale (each exact or one
        rounding, no intermediate overflow)."""
        HW: tl.constexpr = WPG // 2
        wa, wb = tl.split(tl.reshape(words.to(tl.int32, bitcast=True), [BLOCK_N, NG, HW, 2]))
        r = tl.join(_gq_prmt(wa, wb, "0x5410", ASM), _gq_prmt(wa, wb, "0x7632", ASM))
        r = tl.permute(r, [0, 1, 3, 2])  # [BN, NG, 2 (nibbles 0-3 | 4-7), HW]
        b = tl.arange(0, 4)[None, None, None, :, None]
        if MODE == 0:
            t = r[:, :, :, None, :] >> (b * 4)  # [BN, NG, 2, 4, HW]: position i = 4a + b
            m = _gq_magic(t, ASM)
            c1 = tl.full([BLOCK_N, NG, 2, 4, HW], 0x3F803F80, tl.int32)  # bf16 (1, 1)
            c0 = tl.full([BLOCK_N, NG, 2, 4, HW], -1023360256, tl.int32)  # 0xC300C300: -128
        else:
            m = _gq_e2m1(r[:, :, :, None, :], b)
            c1 = tl.full([BLOCK_N, NG, 2, 4, HW], 0x7E807E80, tl.int32)  # bf16 2^126
            c0 = tl.full([BLOCK_N, NG, 2, 4, HW], -2147450880, tl.int32)  # 0x80008000: -0
        s2 = s2[:, :, None, None, None]
        b2 = b2[:, :, None, None, None]
        v = _gq_fma2(_gq_fma2(m, c1, c0, ASM), s2, b2, ASM)  # ptxas: HADD2/HMUL2 + HFMA2
        v = tl.reshape(v, [BLOCK_N, NG, 8, HW])
        lo, hi = _gq_unpair(v, ASM)
        return tl.reshape(tl.join(lo, hi), [BLOCK_N, NG * WPG * 8])

    @triton.jit
    def _gq_e4m3(t):
        """E4M3 code in the low byte of each half of t -> bf16 pair = value * 2^-120
        (magnitude -> bits 4..10, sign -> 15)."""
        return ((t & 0x007F007F) << 4) | ((t & 0x00800080) << 8)

    @triton.jit
    def _dequant_e4m3_bf16x2(
        words, s2, b2, BLOCK_N: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr,
        ASM: tl.constexpr,
    ):  # fmt: skip
        """mxfp8 words [BN, NG, WPG] -> the W tile [BN, NG*G] as _dequant_4bit_bf16x2 does
        (4 bytes a word: positions 2a + p, a from the prmt, p the byte in the half)."""
        HW: tl.constexpr = WPG // 2
        wa, wb = tl.split(tl.reshape(words.to(tl.int32, bitcast=True), [BLOCK_N, NG, HW, 2]))
        r = tl.join(_gq_prmt(wa, wb, "0x5410", ASM), _gq_prmt(wa, wb, "0x7632", ASM))
        r = tl.permute(r, [0, 1, 3, 2])  # [BN, NG, 2 (bytes 0-1 | 2-3), HW]
        sh = (tl.arange(0, 2) * 8)[None, None, None, :, None]
        m = _gq_e4m3(r[:, :, :, None, :] >> sh)  # [BN, NG, 2, 2, HW]
        c1 = tl.full([BLOCK_N, NG, 2, 2, HW], 0x7B807B80, tl.int32)  # bf16 2^120
        c0 = tl.full([BLOCK_N, NG, 2, 2, HW], -2147450880, tl.int32)  # 0x80008000: -0
        v = _gq_fma2(_gq_fma2(m, c1, c0, ASM), s2[:, :, None, None, None], c0, ASM)
        v = tl.reshape(v, [BLOCK_N, NG, 4, HW])
        lo, hi = _gq_unpair(v, ASM)
        return tl.reshape(tl.join(lo, hi), [BLOCK_N, NG * WPG * 4])

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
        PACKED: tl.constexpr = False,
        EVEN_N: tl.constexpr = False,
        EVEN_K: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        """y[M, N] = x[M, K] @ W^T on tensor cores; each W tile is dequantized in registers.

        PACKED (4-bit codes and bf16 x, affine with bf16 scales): packed bf16x2 decode
        straight into the tensor-core register layout (_dequant_4bit_bf16x2); otherwise fp32
        per element.
        EVEN_N: N is a multiple of BLOCK_N; EVEN_K: every split's k-steps lie inside K (no
        masks on the weight, scale and x loads; the loop has fewer instructions)."""
        EPW: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = G // EPW
        BK: tl.constexpr = NG * G
        if PDL:  # see _gemv_kernel; here everything waits (the loop reads x and W together)
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
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
        n_mask = (rn < N) | EVEN_N
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
            g_mask = (g_idx < KG) | EVEN_K
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


_OUTGROWN: list = []  # replaced ticket buffers: a captured CUDA graph may still use one


def _counters(device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


_PROPS: dict = {}  # device index -> its properties (the query costs host time per call)


def _props(device):
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _PROPS:
        _PROPS[key] = torch.cuda.get_device_properties(key)
    return _PROPS[key]


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small grid keeps the CPU tests fast
    return _props(device).multi_processor_count


def _l2_bytes(device) -> int:
    return _props(device).L2_cache_size


@functools.cache
def _pdl_api() -> bool:
    """Whether this Triton has grid dependency control and the launch option (3.3/3.4+)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions  # noqa: PLC0415
    except Exception:
        return False
    fields = {f.name for f in dataclasses.fields(CUDAOptions)}
    return tlc is not None and hasattr(tlc, "gdc_wait") and "launch_pdl" in fields


def pdl(device) -> bool:
    """Launch the decode kernels with programmatic dependent launch (Hopper and later).

    Each kernel then lets the next one start while it runs: the next one's programs are
    placed on the SMs, issue their first weight loads (which depend on no earlier kernel) and
    wait in `gdc_wait` until this one's results are visible. Every kernel triggers the next
    (gdc_launch_dependents) only once its own wait is over, so at most one kernel waits
    ahead. Without it every kernel of a decode step pays its launch and its first DRAM round
    trip after the previous one ends: a few us each, ~300 times a token. MLXRUN_PDL=0 turns
    it off (for A/B timing)."""
    if device.type != "cuda" or os.environ.get("MLXRUN_PDL", "1") == "0":
        return False
    return _pdl_api() and _props(device).major >= 9


def pdl_args(device) -> dict:
    """The PDL constexpr and launch option of a kernel launched on `device` (see pdl)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters.

    kernel: "gemv" (num_warps warps per program, splitting each k-step of 128*num_warps
    words per row) or "gemm" (tl.dot, k-steps of ng groups). split_k: programs along K whose
    partials the last one sums.
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


def _packed_gemm(w: QLinear, x_dtype) -> bool:
    """The GEMM's packed bf16x2 decode applies: bf16 x and mxfp4, nvfp4, mxfp8, or affine
    4-bit with bf16 scales and biases (affine 8-bit keeps the per-element path)."""
    if x_dtype != torch.bfloat16:
        return False
    if w.mode == "affine":
        return w.bits == 4 and w.scales.dtype == torch.bfloat16 and w.biases.dtype == torch.bfloat16
    return True


def _split_even(n_tiles: int, ksteps: int, sms: int, waves: float) -> int:
    """Like _split, but a divisor of ksteps (every split gets the same whole k-steps, so the
    GEMM runs without k masks): the smallest one reaching 0.9 of the wanted programs, or
    _split's count where that divisor would be more than twice too many."""
    want = waves * sms / max(n_tiles, 1)
    for d in range(1, ksteps + 1):
        if ksteps % d == 0 and d >= 0.9 * want:
            return d if d <= 2 * want + 1 else _split(n_tiles, ksteps, sms, waves)
    return ksteps


def choose_config(m: int, w: QLinear, device, x_dtype=None) -> KernelConfig:
    """Heuristic launch parameters for x [m, K] @ W^T (bench/tuning may override).

    Chosen from the H100 sweep in benchmarks/KERNEL_NOTES.md (run 3).
    """
    sms = _num_sms(device)
    if m <= GEMV_MAX_M:
        # Up to 4 warps a program, each taking its own part of every k-step (lanes along K,
        # summed through shared memory once at the end): a split of K inside the program,
        # with no partials and no ticket round trip. H100 sweep (profile_decode.py --linears
        # --all --warps 1,2,4: cycled weights, PDL on), int4 us, best with 1 warp -> 4 warps:
        # 6144x4096 8.3 -> 6.6, 4096x4096 6.8 -> 5.6, 28672x4096 25.9 -> 24.9, 4096x14336
        # 14.6 -> 14.2, 128256x4096 101.6 -> 96.4; with 4 warps more splits only lost.
        kw = w.k * w.bits // 32
        fp4 = w.mode in ("mxfp4", "nvfp4")
        warps = 1
        while warps < GEMV_WARPS and 256 * warps <= kw:
            warps *= 2
        if fp4 and w.n >= 64 * sms:
            # fp4 with many row blocks (8 or more a SM): 2 warps, twice the k-steps a warp
            # (mxfp4 28672x4096 26.2 -> 24.1 us, 128256x4096 97.4 -> 95.1; 4 warps still
            # win at 6144x4096, 7.5 against 7.7, and 4096x14336, 14.8 against 16.1). In the
            # decode loop (bench, fp4, same call): 438.4, 434.8 -> 440.3, 440.5 tok/s
            warps = min(warps, 2)
        ksteps = math.ceil(kw / (128 * warps))
        if warps > 1:
            # 16 rows (two halves sharing each x input) where a warp has at most 2 k-steps:
            # mxfp8 4096x4096 8.0 -> 7.4 us, but 4096x14336 (7 k-steps) 23.5 -> 84.2;
            # fp4 is slower at 16 rows everywhere (6144x4096 7.5 -> 8.6 us)
            bn = 16 if not fp4 and ksteps <= 2 else 8
        else:
            # 8 or 16 rows (affine with >= 2 row blocks per SM: 8% fewer instructions,
            # twice the work per warp; the fp formats spill at 16)
            bn = 16 if w.mode == "affine" and math.ceil(w.n / 16) >= 4 * sms else 8
        # split K until ~6 warps per SM are in flight (more splits cost their partials and
        # the ticket round trip), into a divisor of the k-steps where one is near (no masks)
        tiles = m * math.ceil(w.n / bn)
        sk = _split(tiles * warps, ksteps, sms, 6.0)
        divs = [d for d in range(1, ksteps + 1) if ksteps % d == 0]
        near = min(divs, key=lambda d: (abs(math.log(d / sk)), -d))
        if kw % (128 * warps) == 0 and abs(math.log(near / sk)) <= math.log(2):
            sk = near
        # One warp a program (rows of fewer than 256 words): from the sweep with PDL on,
        # int4 6144x4096 10.8 us in 1 split, 8.3 in 2; 4096x4096 6.8 in 2; 16 rows lost at
        # N = 6144, 10.1 against 9.1 us, and won at N >= 28672.
        few = warps == 1 and tiles < 8 * sms  # the small shapes (q/k/v, o, down at batch 1)
        if few and fp4:
            # fp4 decodes with ~2x the instructions of int4 and wants every warp it can get:
            # one k-step each (6144x4096 11.0 -> 9.6 us, 4096x4096 9.3 -> 7.9, 4096x14336
            # 22.2 -> 19.5)
            sk = ksteps
        elif few and ksteps / sk > 4:  # long serial chains lose where the rows are few:
            sk = math.ceil(ksteps / 4)  # 4096x14336 int4 17.8 us in 2 splits, 14.6 in 4
        # (with many rows one split wins: mxfp8 28672x4096 45.5 us against 48.6 in 2)
        # E4M3 holds ~155 registers a lane with the next step's words in flight: where a
        # warp has many k-steps, more resident warps beat the prefetch (mxfp8 4096x14336,
        # 7 four-warp steps: 23.5 -> 22.6 us without it; 4096x4096, 2 steps: 7.4 -> 9.5)
        prefetch = not (w.mode == "mxfp8" and warps > 1 and ksteps > 2)
        return KernelConfig("gemv", 1, bn, sk, num_warps=warps, prefetch=prefetch)
    g = w.group_size
    swap = False
    if device.type == "cpu":  # interpreter: small tiles keep the CPU tests fast
        bm, bn, ng, warps = 32, 64, max(1, 256 // g), 4
    elif x_dtype == torch.float32:  # tf32x3 needs 3 MMAs and hi/lo operands: small tiles
        bm, bn, ng, warps = 16, 64, max(1, 64 // g), 4
    elif m <= 64:
        # A few sequences (batched decode): the weight tile is the wgmma's 128-row operand
        # and x's rows its narrow side, split K to about one wave. Measured at M = 32 on the
        # 8B shapes (profile_decode.py --linears): 0.6x the time of the 128x128 tiles.
        # The split divides the k-steps where it can (no k masks in the loop: EVEN_K).
        bm = 32 if m <= 32 else 64
        ng = max(2, 128 // g)  # g128: 2 groups a step, so the scale loads are 4 bytes (async)
        ksteps = math.ceil(w.k / (ng * g))
        tiles = math.ceil(m / bm) * math.ceil(w.n / 128)
        sk = _split_even(tiles, ksteps, sms, 1.0)
        return KernelConfig("gemm", bm, 128, sk, ng, 4, 4, swap=True)
    elif w.mode == "affine" and w.bits == 4:
        # measured best for g64 (0.81x the time); with bf16 x the swap puts the packed decode
        # straight into wgmma's register operand (no shared-memory round trip), any g
        bm, bn, ng, warps, swap = 128, 128, max(2, 128 // g), 8, True
    elif w.mode != "affine" and x_dtype == torch.bfloat16:
        # packed decode (as affine 4-bit): 6.2-6.3 SASS instructions per weight element
        # against 7.8-8.5 with the 128x256 k64 tiles (sass_gemm.py); not measured on a GPU
        bm, bn, ng, warps, swap = 128, 128, max(1, 128 // g), 8, True
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


def silu_fusable(x: torch.Tensor, w: QLinear, config: KernelConfig | None = None) -> bool:
    """Whether qmatmul(x, w, config, silu=True) can run: w = [gate; up] with N/2 a multiple
    of 8, and the GEMV (at most GEMV_MAX_M rows of x)."""
    m = x.numel() // max(x.shape[-1], 1)
    if not 0 < m <= GEMV_MAX_M or (w.n // 2) % SCALE_ROWS or w.n % 2:
        return False
    cfg = config or choose_config(m, w, x.device, x.dtype)
    return cfg.kernel == "gemv"


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
    )


def qmatmul(
    x: torch.Tensor,
    w: QLinear,
    config: KernelConfig | None = None,
    silu: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T -> [..., N] in out_dtype (default x's), W quantized
    (QLinear). The kernels sum in fp32: out_dtype float32 keeps those sums unrounded.

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
            y[r : r + rows] = qmatmul(x2[r : r + rows], w, config, out_dtype=out_dtype)
        return y.reshape(*lead, w.n)
    cfg = config or choose_config(m, w, x.device, x.dtype)
    if cfg.kernel == "gemv":
        if x2.dtype == torch.bfloat16 and (x2.data_ptr() % 4 or (m > 1 and x2.stride(0) % 2)):
            x2 = x2.clone()  # the GEMV reads bf16 x as uint32 pairs: 4-byte aligned rows
        dense = w.weight.stride(0) == w.k * w.bits // 32 and w.scales.is_contiguous()
        consts = _gemv_constexprs(w, cfg, silu, dense)
        split = consts["SPLIT_K"]
        tiles = math.ceil(w.n / cfg.block_n)  # with silu: gate rows and their up rows a tile
        grid = (m, tiles, split)
        kern = _gemv_kernel
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
        )
    part = torch.empty((split, m, w.n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = _counters(x.device, m * tiles) if split > 1 else y
    biases = w.biases if w.biases is not None else w.scales
    kern[grid](
        x2, w.weight, w.scales, biases, y, part, cnt, m, w.n, w.k, x2.stride(0), y.stride(0),
        w.weight.stride(0), **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device),
    )  # fmt: skip
    return y.reshape(*lead, y.shape[-1])
