"""The layout of GGUF K-quant weights (Q4_K, Q5_K, Q6_K) for the CUDA kernels, host side.

A K-quant weight is `d * sc * q - dmin * m` (Q4_K, Q5_K: 4- or 5-bit q, sub-blocks of 32 with
6-bit sc and m) or `d * sc * (q - 32)` (Q6_K: 6-bit q, sub-blocks of 16 with int8 sc), d and
dmin fp16 per super-block of 256 (quant/gguf_blocks.py). `prepare_kquant` re-lays the file's
blocks out once at load, the same fields in planes the kernels load as whole tiles, per row
of K = 256 * nb weights:

- weight int32 [N, K/8 + K*HB/32]: the low 4 bits of every code, a sub-block of S weights
  (32; Q6_K 16) in WPS = S/8 words, weight i*WPS + w at nibble i of word w (the affine
  int4 kernels' group-transposed order), then the HB high bits (Q5_K 1, Q6_K 2), one word a
  sub-block, weight i*WPS + w at bits HB*(8w + i), or (Q6_K with hi_spread) in the spread
  order of hi_shifts, which the GEMV turns into byte fields without spreading them;
- scales uint8 [N, K/16]: (sc, m) of each sub-block of 32 (Q4_K, Q5_K), or int8 sc of each
  sub-block of 16 (Q6_K);
- biases float16 [N, 2*nb]: (d, dmin) of each super-block, or [N, nb]: d (Q6_K).

Bits per weight held, against the file: Q4_K 4.625 (4.5), Q5_K 5.625 (5.5), Q6_K 6.5625
(6.5625): the 6-bit sc/m pairs take a byte each instead of 12 bytes for 8 pairs. The scales
are exact in fp32 (d * sc: an 11-bit significand times a 6- or 8-bit integer), so a kernel's
result differs from the dequantized fp32 product only by the order of its fp32 sums.

Here: the weight (KQLinear), its layout from GGUF rows (numpy), random weights for speed
runs, the plain-PyTorch dequantization, row selection and joins, and kq_variant (the lane
GEMV's variant, MLXRUN_KQ_VARIANT), which also picks Q6_K's layout at load. The launches and
kqmatmul are quant/triton_kquant.py's (callers import these names from there too); the
kernels that read the layout: quant/kquant_lane.py with quant/kquant_decode.py (the GEMV),
quant/kquant_kernels.py (the tile GEMM) and quant/kquant_stream.py.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mlxrun.errors import MlxrunError
from mlxrun.quant import gguf_blocks as gb
from mlxrun.quant import triton_kernels as tk

torch = tk.torch


KINDS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}
HIGH_BITS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # bits of each code above the low nibble
QK = gb.QK


@dataclasses.dataclass(frozen=True)
class KQLinear:
    """A K-quant weight W [N, K] laid out for the kernels (see the module docstring). Its
    fields are named as QLinear's, so byte accounting reads both alike."""

    weight: torch.Tensor  # int32 [N, K/8 + K*HB/32]
    scales: torch.Tensor  # uint8 [N, K/16] (sc, m pairs) or int8 [N, K/16] (Q6_K)
    biases: torch.Tensor  # float16 [N, 2*K/256] (d, dmin) or [N, K/256] (Q6_K)
    kind: str
    n: int
    k: int
    hi_spread: bool = False  # Q6_K's high words in hi_shifts' spread order

    @property
    def mode(self) -> str:
        return self.kind.lower()

    @property
    def bits(self) -> int:
        return gb.KQUANTS[self.kind][0]

    @property
    def group_size(self) -> int:
        return QK

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read for the weight: codes, sub-block scales, super-block d."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.biases))


def _shapes(kind: str, n: int, k: int) -> dict[str, tuple[int, int]]:
    hb = HIGH_BITS[kind]
    nb = k // QK
    return {
        "weight": (n, k // 8 + k * hb // 32),
        "scales": (n, k // 16),
        "biases": (n, nb if kind == "Q6_K" else 2 * nb),
    }


def hi_shifts(kind: str, spread: bool, f=None):
    """Bit offsets in a sub-block's high word of its fields f = 8w + i (weight i*WPS + w;
    default every field, numpy uint32; a torch tensor of them gives a tensor on its device):
    HB*(8w + i), or for Q6_K spread (w of its 2 low words, i = 2j or 2j+1 of its 8 nibbles):
    8j + 4*(1-w) + 2*(i % 2 == 0). Spread, word 0's fields sit at bits 4-5 (odd i) and 6-7
    (even i) of byte j, word 1's at bits 0-1 and 2-3: one shift and one mask a half give the
    high bits of the byte fields kquant_decode._q6_bytes_spread builds (position 2j's or
    2j+1's 6-bit code in byte j), where HB*(8w + i) needs three shift-mask steps a word
    first."""
    if f is None:
        f = np.arange(gb.KQUANTS[kind][1], dtype=np.uint32)
    if not spread:
        return f * HIGH_BITS[kind]
    w, i = f // 8, f % 8
    return 8 * (i // 2) + 4 * (1 - w) + 2 * (1 - i % 2)


def kq_variant() -> int:
    """The lane GEMV's variant, MLXRUN_KQ_VARIANT (for A/B timing): 0 the previous loads
    (Q6_K's high words loaded once per low word they serve, the sub-block scales in a [8,
    lanes] tile; on Triton 3.6 that tile's layout has its threads along the rows, so acc is
    converted every k-step and Q6_K on 2 or 4 warps spills 856 B at 255 registers), Q6_K
    on one warp; 1 those loads built lanes-first (Q6_K on 2 warps: 128 registers, no
    spill; Q4_K on 4 warps 3.36 -> 3.06 instructions a weight) with Q6_K on 1, 2 or 4
    warps by shape (lane_config) and Q4_K's K <= 4096 on the previous loads (_loads); 2 as
    1, Q6_K on as many warps as Q4_K and Q4_K on the new loads at every K; 3 as 1, Q4_K's
    N <= 4096 on the new loads too; 4 as 3, Q6_K's codes decoded as byte fields
    (kquant_decode._q6_bytes: 5.51 -> 4.79 instructions a weight; H100, mlxrun bench
    shape:llama3-8b q6_k 265.9 -> 286.3 tok/s; benchmarks/KERNEL_NOTES.md, 2026-11-27); 5 as
    4, Q6_K's two-warp GEMV of K > 4096 (the down projection) capped at Q6K_MAXNREG too
    (_maxnreg); 6 as 5, Q6_K laid out at load with hi_spread (hi_shifts) and
    decoded from it (_loads: V 3, kquant_decode._q6_bytes_spread; 4.79 -> 4.04 instructions a
    weight; H100, kq_ab.py 4096x14336 25.3 -> 21.1 us, 28672x4096 42.9 -> 40.7; mlxrun bench
    shape:llama3-8b q4_k_m 377.8 -> 383.4 / 382.1 tok/s, one call); 7 as 6, Q4_K on 16
    rows a program where a warp has at most 2 k-steps (lane_config); 8 as 7, the first
    k-step's scales loaded before the PDL wait (cfg.early, as the int4 GEMV); 9 as 8, the
    scales loaded without masks where the tiles and k-steps are whole (Q6_K spread, 2 warps:
    1,034 -> 1,006 instructions a k-step, 163 -> 128 registers, Triton 3.6); 10 as 9, the
    scales early only where lane_config says (one k-step a program; Q6_K: and many row
    tiles); the default. mlxrun bench shape:llama3-8b (KERNEL_NOTES.md, 2026-11-27), one
    call each: H100 q4_k_m 6 385.6, 9 394.5 tok/s; H200 q4_k_m 6 430.3, 10 428.4, q6_k 6
    339.4, 10 354.4. The layout follows the variant at load time (q6_spread); a weight's
    decode follows its layout. lane_config, _loads, _maxnreg and Q6K_MAXNREG are
    quant/triton_kquant.py's."""
    v = os.environ.get("MLXRUN_KQ_VARIANT", "10")
    if v not in ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10"):
        raise MlxrunError(f"MLXRUN_KQ_VARIANT={v!r}: use 0 to 10")
    return int(v)


def q6_spread() -> bool:
    """Whether Q6_K weights are laid out with hi_spread: MLXRUN_KQ_VARIANT 6."""
    return kq_variant() >= 6


def _planes(codes: np.ndarray, kind: str, spread: bool = False) -> np.ndarray:
    """uint8 codes [rows, K] -> int32 words [rows, K/8 + K*HB/32] (the module docstring's
    order: in each sub-block of S weights, weight i*WPS + w at nibble i of word w and at
    field 8w + i of the high word, at hi_shifts' offset)."""
    rows, k = codes.shape
    sub = gb.KQUANTS[kind][1]
    wps = sub // 8
    c = codes.reshape(rows, k // sub, 8, wps).transpose(0, 1, 3, 2).astype(np.uint32)
    lo = np.bitwise_or.reduce((c & 15) << (np.arange(8, dtype=np.uint32) * 4), axis=-1)
    parts = [lo.reshape(rows, -1)]
    hb = HIGH_BITS[kind]
    if hb:
        h = (c >> 4).reshape(rows, k // sub, sub)  # field 8w + i
        parts.append(np.bitwise_or.reduce(h << hi_shifts(kind, spread), axis=-1))
    return np.concatenate(parts, axis=1).view(np.int32)


def layout(
    raw: np.ndarray, kind: str, spread: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF rows (uint8 [N, K/256 * block bytes]) of `kind` -> (weight, scales, biases) numpy
    arrays in the kernels' layout (module docstring; spread: Q6_K's hi_spread)."""
    f = gb.k_fields(raw, kind)
    weight = _planes(f.codes, kind, spread)
    if kind == "Q6_K":
        scales, biases = f.sc, f.d
    else:
        rows = f.sc.shape[0]
        scales = np.stack([f.sc, f.mins], axis=-1).reshape(rows, -1)
        biases = np.stack([f.d, f.dmin], axis=-1).reshape(rows, -1)
    return np.ascontiguousarray(weight), np.ascontiguousarray(scales), biases


def prepare_kquant(raw, kind: str, device=None, spread: bool | None = None) -> KQLinear:
    """GGUF rows (uint8 [N, K/256 * block bytes], numpy) of Q4_K, Q5_K or Q6_K -> KQLinear
    on `device`. Rows are laid out a few MB at a time (the numpy temporaries stay small).
    spread: Q6_K's high words in hi_shifts' spread order (None: q6_spread())."""
    tk._need_torch()
    if kind not in KINDS:
        raise MlxrunError(f"{kind} has no K-quant kernel: the kernels read {', '.join(KINDS)}")
    spread = kind == "Q6_K" and (q6_spread() if spread is None else spread)
    raw = np.asarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    k = raw.shape[1] // gb.BLOCKS[kind][0] * QK
    step = max(1, (1 << 22) // max(k, 1))
    chunks = [layout(raw[i : i + step], kind, spread) for i in range(0, n, step)]
    w, s, b = (torch.from_numpy(np.concatenate(p)).to(device) for p in zip(*chunks))
    return KQLinear(w, s, b, kind, n, k, spread)


def random_kquant(kind: str, n: int, k: int, device, seed: int = 0) -> KQLinear:
    """Random codes and small scales in the layout, made on `device` (for speed runs of a
    K-quant model's shapes): weights of about +-0.03."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    shapes = _shapes(kind, n, k)
    w = torch.randint(-(2**31), 2**31, shapes["weight"], generator=g, device=device,
                      dtype=torch.int64).to(torch.int32)  # fmt: skip
    if kind == "Q6_K":
        s = torch.randint(-64, 64, shapes["scales"], generator=g, device=device)
        s, d = s.to(torch.int8), torch.full(shapes["biases"], 2e-5, device=device)
    else:
        s = torch.randint(0, 64, shapes["scales"], generator=g, device=device).to(torch.uint8)
        d = torch.full(shapes["biases"], 6e-5, device=device)
    return KQLinear(w, s, d.to(torch.float16), kind, n, k, kind == "Q6_K" and q6_spread())


def dequantize_kquant(w: KQLinear, dtype=None) -> torch.Tensor:
    """Plain-PyTorch dequantization: KQLinear -> dense W [N, K] (float32 unless dtype),
    computed as gguf_blocks.dequantize does (so equal to it bit for bit in float32)."""
    hb = HIGH_BITS[w.kind]
    sub = gb.KQUANTS[w.kind][1]
    ns, wps = w.k // sub, sub // 8
    words = w.weight.to(torch.int64)
    sh = torch.arange(8, device=words.device) * 4
    q = (words[:, : w.k // 8, None] >> sh) & 15  # [N, K/8, 8]: word w, nibble i
    if hb:
        # on the device: a host copy here fails inside CUDA graph capture (the embedding)
        shh = hi_shifts(w.kind, w.hi_spread, torch.arange(sub, device=words.device))
        q = q | (((words[:, w.k // 8 :, None] >> shh) & ((1 << hb) - 1)).reshape(q.shape) << 4)
    q = q.reshape(w.n, ns, wps, 8).transpose(2, 3)  # weight i*WPS + w of each sub-block
    q = q.to(torch.float32).reshape(w.n, ns, sub)
    per_sb = QK // sub
    if w.kind == "Q6_K":
        d = w.biases.to(torch.float32).repeat_interleave(per_sb, 1)
        out = (d * w.scales.to(torch.float32))[..., None] * (q - 32)
    else:
        db = w.biases.to(torch.float32).view(w.n, -1, 2)
        d = db[..., 0].repeat_interleave(per_sb, 1)
        dmin = db[..., 1].repeat_interleave(per_sb, 1)
        sm = w.scales.view(w.n, ns, 2).to(torch.float32)
        out = (d * sm[..., 0])[..., None] * q + (-(dmin * sm[..., 1]))[..., None]
    out = out.reshape(w.n, w.k)
    return out if dtype is None else out.to(dtype)


def rows(w: KQLinear, ids: torch.Tensor) -> KQLinear:
    """The KQLinear of rows `ids` of w (an embedding's lookups)."""
    take = [t.index_select(0, ids) for t in (w.weight, w.scales, w.biases)]
    return KQLinear(*take, w.kind, int(ids.shape[0]), w.k, w.hi_spread)


def concat(parts: list[KQLinear]) -> KQLinear | None:
    """KQLinears of one kind that read the same x (q, k, v; gate, up) -> one of all their
    rows (the parts become views of it), or None where the kinds or widths differ."""
    p0 = parts[0]
    key = (p0.kind, p0.k, p0.hi_spread)
    if any(not isinstance(p, KQLinear) or (p.kind, p.k, p.hi_spread) != key for p in parts):
        return None
    joint = [tk.join_rows([getattr(p, f) for p in parts]) for f in ("weight", "scales", "biases")]
    return KQLinear(*joint, p0.kind, sum(p.n for p in parts), p0.k, p0.hi_spread)
