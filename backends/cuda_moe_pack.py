"""The MoE experts' load-time repack for the packed per-slot kernel (`_moe_qgemv`,
backends/cuda_moe.py launches it): every expert's stacked gate and up joined, [gate_e; up_e],
and down, each prepared as the dense GEMV's layout (quant/triton_layout.py), made once per
layer on first use (`prepared`), and the views the byte accounting and the torch paths take
of it (`ExpertPart`, `_expert_rows`).
"""

from __future__ import annotations

import dataclasses

import torch

from mlxrun.backends.base import QuantizedWeight
from mlxrun.quant.triton_layout import _MODE_ID, SCALE_ROWS, QLinear, prepare


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """One projection of every expert, repacked for `_moe_qgemv`: `w` holds E*R rows, expert
    e's at e*R.. (gate/up: [gate_e; up_e], R = 2n; down: R = n); n outputs an expert, k
    inputs."""

    w: QLinear
    n: int
    k: int
    gated: bool


@dataclasses.dataclass(frozen=True)
class ExpertPart:
    """QuantizedWeight.kernel of one stacked projection (gate, up or down) once its layer is
    repacked: the layer's two PackedExperts, and which part of them this projection is.
    weight/scales/biases/nbytes/n/k as a QLinear reports them, for the byte accounting
    (mlxrun/bench.py, Transformer.weight_bytes, evaluate): gate and up share the joint
    repack's arrays (counted once by identity) and each reports half its bytes."""

    gate_up: PackedExperts
    down: PackedExperts
    part: str  # "gate", "up" or "down"

    @property
    def packed(self) -> PackedExperts:
        return self.down if self.part == "down" else self.gate_up

    @property
    def weight(self):
        return self.packed.w.weight

    @property
    def scales(self):
        return self.packed.w.scales

    @property
    def biases(self):
        return self.packed.w.biases

    @property
    def nbytes(self) -> int:
        w = self.packed.w
        return w.nbytes if self.part == "down" else w.nbytes // 2

    @property
    def n(self) -> int:  # rows of this projection over all experts
        return self.packed.w.n if self.part == "down" else self.packed.w.n // 2

    @property
    def k(self) -> int:
        return self.packed.k

    def dense(self, ids: torch.Tensor, dtype) -> torch.Tensor:
        """Experts `ids` (n,) of this projection as dense (n, out, in) (the torch paths)."""
        from mlxrun.quant.triton_kernels import dequantize_torch  # noqa: PLC0415

        p = self.packed
        rows = slice(p.n, 2 * p.n) if self.part == "up" else slice(0, p.n)
        return torch.stack(
            [dequantize_torch(_expert_rows(p, j), dtype)[rows] for j in ids.tolist()]
        )


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


def _prepare(e) -> tuple[PackedExperts, PackedExperts] | None:
    """(gate/up, down) repacked, or None where _moe_qgemv does not apply: dense experts,
    formats without a GEMV (quant/triton_kernels.py: affine 4/8-bit in groups of 32/64/128,
    mxfp4, nvfp4, mxfp8), or rows that do not fill the 8-row scale tiles."""
    ws = (e.gate, e.up, e.down)
    if not all(isinstance(w, QuantizedWeight) and w.weight is not None for w in ws):
        return None
    g, u, d = ws
    fmt = (g.mode, g.bits, g.group_size)
    if any((w.mode, w.bits, w.group_size) != fmt for w in ws) or g.mode not in _MODE_ID:
        return None
    if g.bits not in (4, 8) or (g.mode == "affine" and g.group_size not in (32, 64, 128)):
        return None
    E, I, H = g.shape
    if I % (SCALE_ROWS // 2) or H % SCALE_ROWS:
        return None

    def joined(parts):  # (E, n_i, c) each -> (E * sum n_i, c)
        if parts[0] is None:
            return None
        t = torch.cat([_words(p) for p in parts], dim=1)
        return t.reshape(-1, t.shape[-1])

    gu = prepare(joined([g.weight, u.weight]), joined([g.scales, u.scales]),
                 joined([g.biases, u.biases]), *fmt)  # fmt: skip
    dn = prepare(joined([d.weight]), joined([d.scales]), joined([d.biases]), *fmt)
    return PackedExperts(gu, I, H, True), PackedExperts(dn, H, I, False)


def prepared(e) -> tuple[PackedExperts, PackedExperts] | None:
    """The layer's (gate/up, down) repack, made on its first use (a warm-up pass, before any
    capture). The layer's stored experts are then replaced by it (QuantizedWeights holding
    only an ExpertPart kernel), as TorchBackend.quantized keeps only the repack of a dense
    linear: the packed experts are never held twice. None (nothing replaced) where the
    packed kernel does not apply."""
    k = getattr(e.gate, "kernel", None)
    if isinstance(k, ExpertPart):
        return k.gate_up, k.down
    pair = _prepare(e)
    if pair is None:
        return None
    for name in ("gate", "up", "down"):
        w = getattr(e, name)
        part = ExpertPart(*pair, name)
        setattr(e, name, QuantizedWeight(None, None, None, w.mode, w.bits, w.group_size, part))
    return pair


def _expert_rows(p: PackedExperts, j: int) -> QLinear:
    """Expert j's rows of a PackedExperts as a QLinear of its own (views, no copy)."""
    w = p.w
    r = 2 * p.n if p.gated else p.n
    t = r // SCALE_ROWS
    b = None if w.biases is None else w.biases[j * t : (j + 1) * t]
    return dataclasses.replace(w, weight=w.weight[j * r : (j + 1) * r],
                               scales=w.scales[j * t : (j + 1) * t], biases=b, n=r)  # fmt: skip
