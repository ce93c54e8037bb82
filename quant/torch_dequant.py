"""Dequantize the canonical packed format with plain PyTorch ops (any device).

Used by the PyTorch backend where no fused kernel exists (CPU, MPS): one layer is expanded
at a time, inside its matmul, so the model never holds a full-precision copy.
"""

from __future__ import annotations

import torch

# E2M1 code -> value; the sign is the top bit of the nibble.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUTS: dict = {}


def _lut(device: torch.device) -> torch.Tensor:
    if device not in _LUTS:
        _LUTS[device] = torch.tensor(_E2M1, dtype=torch.float32, device=device)
    return _LUTS[device]


def unpack(weight: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint32-packed (..., n*bits/32) -> integer codes (..., n) uint8 or int32; value i sits
    at bit offset i*bits of the row's bit stream, least significant first."""
    if 8 % bits == 0:
        # Little-endian words: byte j holds values j*per .. j*per+per-1, low bits first.
        # Working on bytes is several times faster than on 32-bit words.
        b = weight.contiguous().view(torch.uint8)
        if bits == 8:
            return b[..., :n]
        mask = (1 << bits) - 1
        q = torch.stack([torch.bitwise_right_shift(b, s) & mask for s in range(0, 8, bits)], dim=-1)
        return q.reshape(*b.shape[:-1], b.shape[-1] * (8 // bits))[..., :n]
    # 3, 5, 6 bits: values straddle word boundaries, so read 64-bit windows.
    w = weight.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nxt = torch.nn.functional.pad(w[..., 1:], (0, 1))
    pair = w | (nxt << 32)
    bit = torch.arange(n, device=w.device, dtype=torch.int64) * bits
    q = (pair[..., bit // 32] >> (bit % 32)) & ((1 << bits) - 1)
    return q.to(torch.int32)


def dequantize(
    weight: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor | None,
    mode: str,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed weight (out, in*bits/32) -> dense (out, in) in `dtype`.

    affine: scales*q + biases per group; mxfp4/mxfp8: E2M1/E4M3 value x 2^(e8m0-127);
    nvfp4: E2M1 value x E4M3 scale.
    """
    n = weight.shape[-1] * 32 // bits
    q = unpack(weight, bits, n)
    lead = q.shape[:-1]
    if mode == "affine":
        s = scales.to(torch.float32).unsqueeze(-1)
        b = biases.to(torch.float32).unsqueeze(-1)
        # in place: the float copy of the codes is the only full-size temporary
        w = q.reshape(*lead, n // group_size, group_size).to(torch.float32).mul_(s).add_(b)
    else:
        if bits == 4:
            vals = _lut(q.device)[q.long()]
        else:  # 8-bit codes are E4M3
            vals = q.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        if mode == "nvfp4":
            s = scales.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        else:  # E8M0: a bare power of two
            e = scales.view(torch.uint8).to(torch.int32)
            s = torch.ldexp(torch.ones(e.shape, device=e.device), e - 127)
        w = vals.reshape(*lead, n // group_size, group_size).mul_(s.unsqueeze(-1))
    return w.reshape(*lead, n).to(dtype)
