"""GGUF (ggml) block formats: numpy reference decode and the exact maps onto the canonical format.

Every ggml block type below decodes to the same shape of thing: integer codes (one per weight),
and per sub-block of S weights a float32 scale and, for some types, a float32 bias, so that

    w = scale * code + bias        (fp32, in that order: the gguf package's own arithmetic)

`decode` returns that triple; `dequantize` applies it. `gguf.quants.dequantize` is the oracle:
the fp32 values are equal bit for bit (tests/test_gguf_blocks.py). The scales are exact in fp32:
an fp16 `d` times a 6- or 8-bit integer sub-scale needs at most 19 significant bits.

| type   | bytes/block | weights | S  | code          | scale        | bias      |
|--------|-------------|---------|----|---------------|--------------|-----------|
| Q4_0   | 18          | 32      | 32 | q - 8         | d            |           |
| Q4_1   | 20          | 32      | 32 | q             | d            | m         |
| Q5_0   | 22          | 32      | 32 | q - 16        | d            |           |
| Q5_1   | 24          | 32      | 32 | q             | d            | m         |
| Q8_0   | 34          | 32      | 32 | int8 q        | d            |           |
| Q2_K   | 84          | 256     | 16 | q (2 bit)     | d * sc       | -dmin * m |
| Q3_K   | 110         | 256     | 16 | q - 4 (3 bit) | d * (sc-32)  |           |
| Q4_K   | 144         | 256     | 32 | q (4 bit)     | d * sc       | -dmin * m |
| Q5_K   | 176         | 256     | 32 | q (5 bit)     | d * sc       | -dmin * m |
| Q6_K   | 210         | 256     | 16 | q - 32        | d * int8 sc  |           |
| IQ4_NL | 18          | 32      | 32 | table[q]      | d            |           |
| IQ4_XS | 136         | 256     | 32 | table[q]      | d * (sc-32)  |           |
| MXFP4  | 17          | 32      | 32 | 2 * E2M1[q]   | 2^(e - 128)  |           |

`to_affine` maps a type onto the canonical affine format (uint32-packed unsigned codes, groups
of 32) where that is exact: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 with fp16 scales and biases, Q4_K/Q5_K
with fp32 ones (`d * sc` does not fit fp16's 11-bit significand). The others have sub-blocks of
16 or non-uniform codes, which no affine group of 32 represents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlxrun.errors import MlxrunError
from mlxrun.quant.reference import pack

QK = 256  # weights per K-quant super-block

# type -> (bytes per block, weights per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q2_K": (84, QK),
    "Q3_K": (110, QK),
    "Q4_K": (144, QK),
    "Q5_K": (176, QK),
    "Q6_K": (210, QK),
    "IQ4_NL": (18, 32),
    "IQ4_XS": (136, QK),
    "MXFP4": (17, 32),
}
TYPES = tuple(BLOCKS)

# type -> (bits, scale dtype) of its exact canonical affine form (groups of 32)
AFFINE: dict[str, tuple[int, str]] = {
    "Q4_0": (4, "F16"),
    "Q4_1": (4, "F16"),
    "Q5_0": (5, "F16"),
    "Q5_1": (5, "F16"),
    "Q8_0": (8, "F16"),
    "Q4_K": (4, "F32"),
    "Q5_K": (5, "F32"),
}

IQ4_TABLE = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
# E2M1 values doubled (so they are integers); the scale carries the halving
MXFP4_TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


@dataclass
class Decoded:
    """w = scale * code + bias per sub-block: codes int16 [rows, n]; scales, biases float32
    [rows, n / sub] (biases None where the type has none)."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None
    sub: int


def row_bytes(kind: str, n: int) -> int:
    """Bytes of one row of `n` weights stored as `kind`."""
    nbytes, per = BLOCKS[kind]
    return n // per * nbytes


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (..., 2) -> float32 (...)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 2k): all low nibbles, then all high nibbles (ggml's order)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _bits(b: np.ndarray, width: int) -> np.ndarray:
    """(..., k) bytes -> (..., 8/width, k): field j of every byte (bits j*width up), in
    order of j: ggml stores successive runs of k weights in successive bit fields."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    return (b[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, each (..., 8).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _blocks(raw: np.ndarray, kind: str, nbytes: int) -> np.ndarray:
    """GGUF rows (uint8 [rows, nblocks * nbytes]) -> their blocks (rows, nblocks, nbytes)."""
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % nbytes:
        raise MlxrunError(f"{kind} rows must be whole {nbytes}-byte blocks, got {raw.shape}")
    return raw.reshape(raw.shape[0], -1, nbytes)


def decode(raw: np.ndarray, kind: str) -> Decoded:
    """GGUF rows (uint8 [rows, nblocks * block_bytes]) -> `Decoded` codes/scales/biases."""
    if kind not in BLOCKS:
        raise MlxrunError(f"unknown GGUF block type {kind}: known are {', '.join(TYPES)}")
    nbytes, per = BLOCKS[kind]
    blk = _blocks(raw, kind, nbytes)
    rows, nb = blk.shape[:2]
    bias = None
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"):
        off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "IQ4_NL": 2, "MXFP4": 1}[kind]
        q = _nibbles(blk[..., off : off + 16]).astype(np.int16)  # (rows, nb, 32)
        if kind == "MXFP4":
            # ggml_e8m0_to_fp32_half: 2^(e-128), e = 0 and 1 as fp32 subnormals
            e = blk[..., 0].astype(np.uint32)
            bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
            scale = bits.astype(np.uint32).view(np.float32)
            q = MXFP4_TABLE[q].astype(np.int16)
        else:
            scale = _f16(blk[..., 0:2])
        if kind in ("Q5_0", "Q5_1"):
            qh = np.ascontiguousarray(blk[..., off - 4 : off]).view("<u4")  # (rows, nb, 1)
            high = (qh >> np.arange(32, dtype=np.uint32)) & 1
            q = q | (high.astype(np.int16) << 4)
        if kind in ("Q4_1", "Q5_1"):
            bias = _f16(blk[..., 2:4])
        elif kind == "IQ4_NL":
            q = IQ4_TABLE[q].astype(np.int16)
        elif kind == "Q4_0":
            q = q - 8
        elif kind == "Q5_0":
            q = q - 16
        sub = 32
    elif kind == "Q8_0":
        scale = _f16(blk[..., 0:2])
        q = blk[..., 2:].view(np.int8).astype(np.int16)
        sub = 32
    elif kind == "Q2_K":
        sc, qs = blk[..., 0:16], blk[..., 16:80]
        d, dmin = _f16(blk[..., 80:82]), _f16(blk[..., 82:84])
        scale = d[..., None] * (sc & 15).astype(np.float32)  # (rows, nb, 16)
        bias = -(dmin[..., None] * (sc >> 4).astype(np.float32))
        # two halves of 128 weights, each 4 runs of 32 in successive 2-bit fields of 32 bytes
        q = _bits(qs.reshape(rows, nb, 2, 32), 2).astype(np.int16)
        sub = 16
    elif kind == "Q3_K":
        hmask, qs, s = blk[..., 0:32], blk[..., 32:96], blk[..., 96:108]
        d = _f16(blk[..., 108:110])
        lo = _nibbles(s[..., 0:8])  # (rows, nb, 16): low 4 bits of scales 0..15
        hi = _bits(s[..., 8:12], 2).reshape(rows, nb, 16)  # top 2 bits
        sc = (lo | (hi << 4)).astype(np.int16) - 32
        scale = d[..., None] * sc.astype(np.float32)
        low = _bits(qs.reshape(rows, nb, 2, 32), 2).reshape(rows, nb, QK)
        # a set hmask bit means no offset; a clear one subtracts 4
        high = _bits(hmask, 1).reshape(rows, nb, QK)
        q = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
        sub = 16
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _k_scales(blk[..., 4:16])
        scale = d[..., None] * sc.astype(np.float32)  # (rows, nb, 8)
        bias = -(dmin[..., None] * mn.astype(np.float32))
        qs = blk[..., 48:176] if kind == "Q5_K" else blk[..., 16:144]
        # four chunks of 32 bytes: low nibbles are one sub-block, high nibbles the next
        q = _nibbles(qs.reshape(rows, nb, 4, 32)).astype(np.int16)
        if kind == "Q5_K":
            high = _bits(blk[..., 16:48], 1).reshape(rows, nb, 4, 64)
            q = q | (high.astype(np.int16) << 4)
        sub = 32
    elif kind == "Q6_K":
        ql, qh, s = blk[..., 0:128], blk[..., 128:192], blk[..., 192:208]
        d = _f16(blk[..., 208:210])
        scale = d[..., None] * s.view(np.int8).astype(np.float32)  # (rows, nb, 16)
        # two halves of 128: low nibbles of 64 bytes, then their high nibbles; the top two
        # bits in successive 2-bit fields of 32 bytes
        low = _nibbles(ql.reshape(rows, nb, 2, 64)).reshape(rows, nb, QK)
        high = _bits(qh.reshape(rows, nb, 2, 32), 2).reshape(rows, nb, QK)
        q = (low | (high << 4)).astype(np.int16) - 32
        sub = 16
    else:  # IQ4_XS
        d = _f16(blk[..., 0:2])
        sh = np.ascontiguousarray(blk[..., 2:4]).view("<u2")  # (rows, nb, 1)
        hi = (sh >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # (rows, nb, 8)
        lo = np.stack([blk[..., 4:8] & 15, blk[..., 4:8] >> 4], axis=-1).reshape(rows, nb, 8)
        sc = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
        scale = d[..., None] * sc.astype(np.float32)
        q = IQ4_TABLE[_nibbles(blk[..., 8:136].reshape(rows, nb, 8, 16))].astype(np.int16)
        sub = 32
    n = nb * per
    scale = np.broadcast_to(scale.reshape(rows, nb, -1), (rows, nb, per // sub))
    return Decoded(
        q.reshape(rows, n),
        np.ascontiguousarray(scale.reshape(rows, n // sub), dtype=np.float32),
        None if bias is None else np.ascontiguousarray(bias.reshape(rows, n // sub)),
        sub,
    )


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """GGUF rows (uint8 [rows, nblocks * block_bytes]) -> float32 [rows, n]; equal to
    `gguf.quants.dequantize` bit for bit."""
    dec = decode(raw, kind)
    rows, n = dec.codes.shape
    q = dec.codes.reshape(rows, -1, dec.sub).astype(np.float32)
    w = dec.scales[..., None] * q
    if dec.biases is not None:
        w = w + dec.biases[..., None]
    return w.reshape(rows, n)


def to_affine(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF rows -> canonical affine (weight uint32 [rows, n*bits/32], scales, biases
    [rows, n/32] in `AFFINE[kind]`'s dtype) with `scales * q + biases` equal to `dequantize`.

    Signed codes move to unsigned by a power-of-two offset folded into the bias (-8d, -16d,
    -128d: exact in fp16 short of overflow, which raises MlxrunError)."""
    bits, sdt = AFFINE[kind]
    dec = decode(raw, kind)
    off = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}.get(kind, 0)
    q = (dec.codes + off).astype(np.uint8)
    np_dt = np.float16 if sdt == "F16" else np.float32
    scales = dec.scales.astype(np_dt)
    with np.errstate(over="ignore"):  # checked just below
        biases = dec.biases.astype(np_dt) if dec.biases is not None else -off * scales
    if not np.isfinite(biases[np.isfinite(scales)]).all():
        raise MlxrunError(
            f"a {kind} block scale is so large that its offset overflows float16; the file "
            "is probably corrupt"
        )
    if bits in (4, 8):  # byte-aligned: value 2k in the low nibble of byte k
        w = q if bits == 8 else q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
        w = np.ascontiguousarray(w).view(np.uint32)
    else:
        w = pack(q, bits)
    return w, np.ascontiguousarray(scales), np.ascontiguousarray(biases)


def mxfp4_to_mlx(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 rows -> MLX's mxfp4 (weight uint32 [rows, n/8], scales uint8 [rows, n/32]),
    the same numbers: ggml's codes are twice the E2M1 values times half the E8M0 scale
    (MXFP4_TABLE), so the codes and the scale byte carry over; only the nibble order moves
    (ggml: value j low and j+16 high in byte j; MLX: value i at bit 4i)."""
    nbytes, _ = BLOCKS["MXFP4"]
    blk = _blocks(raw, "MXFP4", nbytes)
    q = _nibbles(blk[..., 1:])  # (rows, nb, 32) in value order
    w = (q[..., 0::2] | (q[..., 1::2] << np.uint8(4))).reshape(blk.shape[0], -1)
    return np.ascontiguousarray(w).view(np.uint32), np.ascontiguousarray(blk[..., 0])


# K-quant types whose blocks the CUDA kernels read (quant/triton_kquant.py): type ->
# (code bits, weights per sub-block)
KQUANTS: dict[str, tuple[int, int]] = {"Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16)}


@dataclass
class KFields:
    """The integer fields of K-quant rows, each weight `d * sc * q - dmin * m` (Q4_K, Q5_K) or
    `d * sc * (q - 32)` (Q6_K) in float32, as `dequantize` computes it.

    codes uint8 [rows, n] (unsigned q); sc [rows, n/S] (uint8 6-bit, or int8 for Q6_K);
    mins uint8 [rows, n/S] or None; d, dmin float16 [rows, n/256] (dmin None for Q6_K)."""

    codes: np.ndarray
    sc: np.ndarray
    mins: np.ndarray | None
    d: np.ndarray
    dmin: np.ndarray | None


def k_fields(raw: np.ndarray, kind: str) -> KFields:
    """GGUF rows (uint8 [rows, nblocks * block_bytes]) of a `KQUANTS` type -> `KFields`."""
    if kind not in KQUANTS:
        raise MlxrunError(f"{kind} is not one of {', '.join(KQUANTS)}")
    nbytes = BLOCKS[kind][0]
    blk = _blocks(raw, kind, nbytes)
    rows, nb = blk.shape[:2]

    def f16(b):
        return np.ascontiguousarray(b).view(np.float16)[..., 0]

    if kind == "Q6_K":
        ql, qh = blk[..., 0:128], blk[..., 128:192]
        low = _nibbles(ql.reshape(rows, nb, 2, 64)).reshape(rows, nb, QK)
        high = _bits(qh.reshape(rows, nb, 2, 32), 2).reshape(rows, nb, QK)
        sc = np.ascontiguousarray(blk[..., 192:208]).view(np.int8)
        return KFields(
            (low | (high << 4)).reshape(rows, -1), sc.reshape(rows, -1), None,
            f16(blk[..., 208:210]), None,
        )  # fmt: skip
    sc, mn = _k_scales(blk[..., 4:16])
    qs = blk[..., 48:176] if kind == "Q5_K" else blk[..., 16:144]
    q = _nibbles(qs.reshape(rows, nb, 4, 32))
    if kind == "Q5_K":
        q = q | (_bits(blk[..., 16:48], 1).reshape(rows, nb, 4, 64) << 4)
    return KFields(
        q.reshape(rows, -1), sc.reshape(rows, -1), mn.reshape(rows, -1),
        f16(blk[..., 0:2]), f16(blk[..., 2:4]),
    )  # fmt: skip
