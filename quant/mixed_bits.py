"""Per-layer bit widths from measured sensitivity (`convert --calibrate ... --target-bpw X`).

Each linear's sensitivity at b bits (b in BITS) is measured by mixed_specs, layer by layer
through calibration's dense pass (calib_layers.py): the error rounding that linear alone
causes in its layer's output, relative to that output. The widths minimise the sum of
those errors over all linears subject to the file's bits per weight (codes, scales and
biases of every quantized matrix, the embedding and head included) staying at or under the
target: a Lagrangian sweep (each linear takes the width minimising error + lam * bytes,
lam bisected to the budget), then the leftover bytes spent greedily on the upgrades that
remove the most error per byte. The chosen widths go into config.json's per-layer
overrides (mlx-lm's format).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mlxrun.errors import MlxrunError
from mlxrun.quant.calib_layers import LINEARS, _layer, _run
from mlxrun.quant.calib_search import fake_quant
from mlxrun.quant.formats import QuantSpec

BITS = (3, 4, 5, 6, 8)  # affine widths MLX's kernels take, from the smallest useful one


def matrix_bytes(shape: tuple[int, int], spec: QuantSpec, dtype: str) -> float:
    """Stored bytes of an [out, in] matrix in `spec`: packed codes plus per-group scale
    (and bias, affine) in the checkpoint's float dtype (float32: 4 bytes, else 2)."""
    out, inp = shape
    groups = out * (inp // spec.group_size)
    per = 2 * (4 if dtype == "float32" else 2) if spec.mode == "affine" else 1
    return out * inp * spec.bits / 8 + groups * per


def allocate(
    errs: dict[str, dict[int, float]],
    shapes: dict[str, tuple[int, int]],
    spec: QuantSpec,
    dtype: str,
    target_bpw: float,
    fixed_bytes: float,
    fixed_weights: int,
) -> dict[str, int]:
    """Bits per linear (keys of `errs`) with the least summed error whose total bits per
    weight, counting `fixed_bytes` over `fixed_weights` of matrices outside the choice (the
    embedding, the head), is at most `target_bpw`."""
    names = list(errs)
    weights = fixed_weights + sum(o * i for o, i in shapes.values())
    budget = target_bpw / 8 * weights - fixed_bytes
    cost = {
        n: {
            b: matrix_bytes(shapes[n], QuantSpec(spec.mode, b, spec.group_size), dtype)
            for b in BITS
        }
        for n in names
    }
    least = sum(cost[n][BITS[0]] for n in names)
    if least > budget:
        reach = 8 * (least + fixed_bytes) / weights
        raise MlxrunError(
            f"--target-bpw {target_bpw} is below the smallest size reachable at group size "
            f"{spec.group_size} ({reach:.3f} bits per weight, every linear at {BITS[0]} "
            "bits); give a larger --target-bpw or a larger --group-size"
        )

    def pick(lam: float) -> dict[str, int]:
        return {n: min(BITS, key=lambda b, n=n: errs[n][b] + lam * cost[n][b]) for n in names}

    def total(choice: dict[str, int]) -> float:
        return sum(cost[n][b] for n, b in choice.items())

    lo, hi = 0.0, 1.0
    while total(pick(hi)) > budget:  # raise lam until the choice fits
        lo, hi = hi, hi * 10
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(pick(mid)) > budget else (lo, mid)
    choice = pick(hi) if total(pick(lo)) > budget else pick(lo)
    left = budget - total(choice)
    while True:  # spend what is left on the upgrade that removes the most error per byte
        best, gain = None, 0.0
        for n in names:
            i = BITS.index(choice[n])
            for b in BITS[i + 1 :]:
                extra = cost[n][b] - cost[n][choice[n]]
                g = (errs[n][choice[n]] - errs[n][b]) / extra
                if extra <= left and g > gain:
                    best, gain = (n, b), g
        if best is None:
            return choice
        left -= cost[best[0]][best[1]] - cost[best[0]][choice[best[0]]]
        choice[best[0]] = best[1]


def mixed_specs(load, shell, hs, chunk, cfg, spec, espec, dtype, opts, progress):
    """Per-linear specs {path: QuantSpec} (only those off `spec`'s width) meeting
    `opts.target_bpw`. A linear's sensitivity at b bits is the error its rounding alone
    causes in its layer's output, mean((h' - h)^2) / mean(h^2), on the first `chunk`
    calibration windows carried through the dense model: the residual stream is where
    every linear's error lands, so errors of q (through the softmax), gate (through the
    activation) and down compare on one scale. A layer of experts' stacked projections
    (gate/up/down of every expert, mlx-lm's `switch_mlp.gate_proj` ...) are one tensor
    each: one width for all its experts (as mlx-lm's per-layer overrides store it), its
    bytes counted over every expert, its error from rounding all of them at once."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    if spec.mode != "affine":
        raise MlxrunError(
            f"--target-bpw mixes affine widths; {spec.label} has one width: use --quant int4"
        )
    be = shell.be
    errs, shapes = {}, {}
    sub = hs[:chunk]
    for i in tqdm(range(cfg.num_hidden_layers), "measuring sensitivity", disable=not progress):
        names, _, w, ln_in, ln_post, extra = load(i)
        base, _ = _run(shell, _layer(be, w, ln_in, ln_post, extra), sub, chunk, None, i)
        energy = max(float(np.mean(base.astype(np.float64) ** 2)), 1e-30)

        def err(wq, ex, sub=sub, base=base, energy=energy, ln_in=ln_in, ln_post=ln_post, i=i):
            got, _ = _run(shell, _layer(be, wq, ln_in, ln_post, ex), sub, chunk, None, i)
            return float(np.mean((got - base).astype(np.float64) ** 2)) / energy

        for k, n in names.items():
            errs[n], shapes[n] = {}, w[k].shape
            for b in BITS:
                wq = dict(w)
                wq[k] = fake_quant(w[k], QuantSpec(spec.mode, b, spec.group_size), dtype)
                errs[n][b] = err(wq, extra)
        if "experts" in w:  # a layer of experts: each stacked projection as one tensor
            from mlxrun.moe import expert_names  # noqa: PLC0415

            ew, stacked = w["experts"], expert_names(cfg.model_type, f"model.layers.{i}").stacked
            for proj in LINEARS[4:]:
                n, (E, out, inp) = f"{stacked}.{proj}", ew[proj].shape
                errs[n], shapes[n] = {}, (E * out, inp)  # bytes and weights of all experts
                for b in BITS:
                    sp = QuantSpec(spec.mode, b, spec.group_size)
                    q = {**ew, proj: fake_quant(ew[proj].reshape(-1, inp), sp, dtype)}
                    q[proj] = q[proj].reshape(E, out, inp)
                    ex = dataclasses.replace(
                        extra["moe"], **{k[:-5]: be.array(q[k]) for k in LINEARS[4:]}
                    )  # the projections rounded; the router and biases as they are
                    errs[n][b] = err(w, {**extra, "moe": ex})
        sub = base
    vocab = cfg.vocab_size * cfg.hidden_size
    heads = 1 if cfg.tie_word_embeddings else 2
    fixed = heads * matrix_bytes((cfg.vocab_size, cfg.hidden_size), espec, dtype)
    bits = allocate(errs, shapes, spec, dtype, opts.target_bpw, fixed, heads * vocab)
    return {n: QuantSpec(spec.mode, b, spec.group_size) for n, b in bits.items() if b != spec.bits}
