"""Calibrated quantization of a mixture-of-experts layer's experts (quant/calibrate.py runs
the rest of the model, layer by layer, and calls this for a layer of experts).

Each expert is calibrated on the inputs of the tokens the router sends to it: the layer's
MoE input x (the post-attention norm's output) and router logits are recorded while the
calibration text runs through the full-precision layer, each token's top k experts are
taken from the logits (every routing rule mlxrun runs picks the k largest logits), and
expert e's gate/up see x of its tokens, its down the gated activations those tokens make
in it. Per expert, as calibrate.py does for a dense MLP: down's AWQ scales (folded into
the expert's own up rows), the clip search against each projection's H, and GPTQ codes when
asked. gate/up get no AWQ scales: their input norm is shared by the router and every
expert, so a scale folded into it would be every expert's at once. gpt-oss's experts
(biases, the clamped SwiGLU) run with their biases and clamp; their down gets no AWQ
scales either, since the clamp on up's output does not commute with a scale folded into up.

An expert that sees fewer than `min_tokens` calibration tokens has too few rows for an H
worth fitting to: it is rounded to nearest, and the caller reports how many were.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mlxrun.moe import MoEOptions

PROJ = ("gate_proj", "up_proj", "down_proj")


def routed(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Router logits (N, E) -> each token's experts (N, k): the k largest logits (softmax
    is monotonic, so softmax-then-top-k and top-k-then-softmax pick the same ones)."""
    return np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]


def _act(g: np.ndarray, u: np.ndarray, o: MoEOptions) -> np.ndarray:
    """The experts' gated activation (torch_moe.expert_act in numpy): silu(g) * u, or
    gpt-oss's (clip(u, +-limit) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit)."""
    if o.act == "silu":
        return g / (1.0 + np.exp(-g)) * u
    g = np.minimum(g, o.swiglu_limit)
    u = np.clip(u, -o.swiglu_limit, o.swiglu_limit)
    return (u + 1) * g / (1.0 + np.exp(-o.swiglu_alpha * g))


def experts(
    w: dict[str, np.ndarray],
    x: np.ndarray,
    logits: np.ndarray,
    o: MoEOptions,
    codes: Callable,
    search: Callable,
    min_tokens: int,
) -> tuple[dict[str, dict[str, np.ndarray]], int]:
    """Quantize one layer's stacked experts.

    w: float32 {"gate_proj": (E, I, H), "up_proj": (E, I, H), "down_proj": (E, H, I)},
    and "gate_bias"/"up_bias" (E, I) where the experts have biases (kept as they are);
    x (N, H): the layer's MoE inputs on the calibration text; logits (N, E): its router's.
    codes(w, h, proj) -> (Grid, codes) for one matrix [out, in] of projection `proj`
    (its width may differ from the others': --target-bpw): calibrated against the input
    Gram matrix h [in, in] / tokens, or rounded to nearest when h is None.
    search(w, rows, mean_abs) -> AWQ scales [in] for w on input rows (calibrate's
    search_scales with the spec bound).
    Returns ({proj: {"weight": (E, ...), "scales": ..., ["biases": ...]}} with every
    expert's stored parts stacked, float32 scales and biases; how many experts were
    rounded to nearest for want of tokens)."""
    awq = o.act == "silu" and not o.bias  # down's scales fold into up only through SiLU's u
    ids = routed(logits, o.top_k)
    parts: dict[str, list] = {k: [] for k in PROJ}
    few = 0
    for e in range(o.num_experts):
        g, u, d = (w[k][e] for k in PROJ)
        rows = np.nonzero((ids == e).any(axis=-1))[0]
        if len(rows) < min_tokens:
            few += 1
            got = {k: codes(m, None, k) for k, m in zip(PROJ, (g, u, d), strict=True)}
        else:
            xe = x[rows]  # (n, H): this expert's tokens
            h_gu = (xe.T.astype(np.float64) @ xe / len(xe)).astype(np.float32)
            gx, ux = xe @ g.T, xe @ u.T
            if "gate_bias" in w:
                gx, ux = gx + w["gate_bias"][e], ux + w["up_bias"][e]
            act = _act(gx, ux, o)  # (n, I): what down sees
            h_d = (act.T.astype(np.float64) @ act / len(act)).astype(np.float32)
            s = np.ones(act.shape[1], np.float32)
            if awq:
                s = search(d, act[:: max(1, len(act) // 512)][:512], np.abs(act).mean(0))
                u = u / s[:, None]  # down's scales, folded into this expert's up rows
            got = {
                "gate_proj": codes(g, h_gu, "gate_proj"),
                "up_proj": codes(u, h_gu, "up_proj"),
                "down_proj": codes(d * s, h_d / np.outer(s, s), "down_proj"),
            }
        for k, (grid, q) in got.items():
            parts[k].append(grid.tensors(q))
    out = {k: {n: np.stack([p[n] for p in ps]) for n in ps[0]} for k, ps in parts.items()}
    return out, few
