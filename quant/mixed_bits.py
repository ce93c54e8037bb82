"""Per-layer bit widths from measured sensitivity (`convert --calibrate ... --target-bpw X`).

Each linear's sensitivity at b bits (b in BITS) is measured by the caller (calibrate.py:
the error rounding that linear alone causes in its layer's output, relative to that
output). The widths minimise the sum of those errors over all linears
subject to the file's bits per weight (codes, scales and biases of every quantized matrix,
the embedding and head included) staying at or under the target: a Lagrangian sweep
(each linear takes the width minimising error + lam * bytes, lam bisected to the budget),
then the leftover bytes spent greedily on the upgrades that remove the most error per
byte. The chosen widths go into config.json's per-layer overrides (mlx-lm's format).
"""

from __future__ import annotations

from mlxrun.errors import MlxrunError
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
