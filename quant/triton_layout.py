"""The layout the quantized-linear Triton kernels read (see triton_kernels.py's docstring):
`prepare` repacks the canonical MLX-format weight once at load time into a QLinear (codes
regrouped within each group, scales and biases in row-inner tiles of 8 rows), `concat` and
`join_rows` fuse several of them, and `dequantize_torch` expands one back to a dense matrix in
plain PyTorch (the reference, and the path without Triton or a GPU).
"""

from __future__ import annotations

import dataclasses

from mlxrun.errors import MlxrunError

try:
    import torch
except ImportError:  # an MLX-only install: the module still imports, use raises
    torch = None

# mode -> (allowed bits, allowed group sizes, scales are 8-bit codes)
_MODES = {
    "affine": ((4, 8), (32, 64, 128), False),
    "mxfp4": ((4,), (32,), True),
    "nvfp4": ((4,), (16,), True),
    "mxfp8": ((8,), (32,), True),
}
_MODE_ID = {"affine": 0, "mxfp4": 1, "nvfp4": 2, "mxfp8": 3}
SCALE_ROWS = 8  # scales/biases are stored in tiles of 8 rows (row index innermost)


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
