"""Mixture-of-experts: the options each architecture sets, the expert weights of one layer,
and how a checkpoint stores them.

A MoE layer replaces the dense MLP: a router (a linear, hidden -> experts) scores the
experts for each token, the top k are run (each a gated MLP of its own) and their outputs
summed with the routing weights. The model calls one backend primitive for all of it after
the router's linear (`Backend.moe`); the options below say how the router's scores become
weights and which gate the experts use.

Expert weights are held stacked, one array per projection with the experts first:
gate/up (E, moe_intermediate, hidden), down (E, hidden, moe_intermediate) -- mlx-lm's
`switch_mlp` layout -- dense, or quantized in the canonical packed format with the same
leading E axis (weight (E, out, in*bits/32), scales/biases (E, out, in/G)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import MlxrunError

Array = Any

# Routing rules, by what transformers' routers compute from the logits (E,) of one token:
#   softmax_topk: p = softmax(logits); the k largest p (renormalised to sum 1 when the
#                 options say so): Mixtral (always), Qwen3-MoE and Qwen2-MoE (norm_topk_prob)
#   topk_softmax: the k largest logits, softmax over those k: gpt-oss
ROUTINGS = ("softmax_topk", "topk_softmax")
# Expert gates: silu(g) * u, or gpt-oss's clamped one: g' = min(g, limit),
# u' = clip(u, -limit, limit), (u' + 1) * g' * sigmoid(alpha * g')
EXPERT_ACTS = ("silu", "swiglu_clamped")

# config.json keys of the MoE families; other families refuse them (config._FOREIGN)
MOE_KEYS = (
    "moe_intermediate_size",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "swiglu_limit",
    "swiglu_alpha",
    "shared_expert_intermediate_size",
)


@dataclass(frozen=True)
class MoEOptions:
    """How the MoE layers of a model compute (ModelConfig.moe; None for dense models)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    routing: str = "softmax_topk"  # one of ROUTINGS
    norm_topk: bool = False  # softmax_topk: renormalise the k weights to sum 1
    act: str = "silu"  # one of EXPERT_ACTS
    bias: bool = False  # router and experts carry biases (gpt-oss)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP (False)
    # Qwen2-MoE: a shared expert, a dense gated MLP of this width that every token runs,
    # its output scaled by sigmoid(shared_expert_gate(x)) and added; 0: none
    shared_intermediate_size: int = 0

    def is_moe(self, layer: int) -> bool:
        return self.layers[layer] if self.layers else True


def _count(d: dict, key: str, *alts: str) -> int:
    for k in (key, *alts):
        v = d.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MlxrunError(
                    f"config.json: {k} is {v!r}, but it must be a positive integer; fix the config"
                )
            return v
    raise MlxrunError(f"config.json has no {key!r}, which a {d.get('model_type')} model needs")


def moe_options(mt: str, d: dict[str, Any], n: int) -> MoEOptions | None:
    """The MoE options of `model_type` mt read as transformers' modeling code reads them,
    or None for a dense family. One line naming the value for what mlxrun does not run."""
    if mt not in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"):
        return None
    experts = _count(d, "num_experts", "num_local_experts")
    k = _count(d, "num_experts_per_tok", "experts_per_token")
    if k > experts:
        raise MlxrunError(
            f"config.json: num_experts_per_tok ({k}) exceeds the number of experts ({experts})"
        )
    v = d.get("shared_expert_intermediate_size")
    if mt != "qwen2_moe" and v not in (None, 0):
        raise MlxrunError(
            f"config.json shared_expert_intermediate_size = {v!r}: mlxrun's {mt} model has no "
            "shared expert (qwen2_moe has); mlxrun refuses the model"
        )
    if mt in ("qwen3_moe", "qwen2_moe"):  # Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer
        step = d.get("decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise MlxrunError(f"config.json: decoder_sparse_step is {step!r}; fix the config")
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise MlxrunError(f"config.json: mlp_only_layers is {dense!r}; expected layer numbers")
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
        shared = _count(d, "shared_expert_intermediate_size") if mt == "qwen2_moe" else 0
        return MoEOptions(
            experts,
            k,
            _count(d, "moe_intermediate_size"),
            "softmax_topk",
            norm_topk=d.get("norm_topk_prob", False) is True,
            layers=() if all(layers) else layers,
            shared_intermediate_size=shared,
        )
    if mt == "mixtral":  # the k weights are always renormalised
        return MoEOptions(experts, k, _count(d, "intermediate_size"), "softmax_topk", True)
    limit, alpha = d.get("swiglu_limit", 7.0), d.get("swiglu_alpha", 1.702)
    for name, v in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise MlxrunError(f"config.json: {name} is {v!r}, but it must be a positive number")
    return MoEOptions(
        experts,
        k,
        _count(d, "intermediate_size"),
        "topk_softmax",
        act="swiglu_clamped",
        bias=True,
        swiglu_limit=float(limit),
        swiglu_alpha=float(alpha),
    )


@dataclass
class Experts:
    """One MoE layer's weights on a backend: router (E, hidden) and the stacked experts
    (see the module docstring); biases (E, out) where the architecture has them. A shared
    expert (Qwen2-MoE) is the layer's dense MLP (model.Layer's gate/up/down_proj); its gate
    (1, hidden), the logit of the sigmoid that scales it, is `shared_gate`."""

    router: Array
    gate: Array
    up: Array
    down: Array
    router_bias: Array | None = None
    gate_bias: Array | None = None
    up_bias: Array | None = None
    down_bias: Array | None = None
    shared_gate: Array | None = None

    def arrays(self) -> list:
        return [a for a in vars(self).values() if a is not None]


@dataclass(frozen=True)
class ExpertNames:
    """Where one layer's MoE tensors live in a checkpoint."""

    router: str  # the router linear: {router}.weight (and .bias)
    stacked: str  # mlx-lm's layout: {stacked}.gate_proj.weight (E, out, in), ...
    per_expert: str  # transformers' layout: {per_expert}.{e}.{name}.weight (out, in)
    names: dict[str, str]  # gate_proj/up_proj/down_proj -> the per-expert name
    shared: str = ""  # the shared expert's MLP: {shared}.gate_proj.weight ... (Qwen2-MoE)
    shared_gate: str = ""  # its sigmoid gate, a linear hidden -> 1: {shared_gate}.weight


# model_type -> (block, router, stacked, per-expert, per-expert projection names)
_LAYOUTS = {
    "qwen3_moe": ("mlp", "gate", "switch_mlp", "experts", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", "gate", "switch_mlp", "experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", "switch_mlp", "experts", ("w1", "w3", "w2")),
    # mlx-lm stacks gpt-oss's experts under mlp.experts; transformers fuses them there too
    # (fused_experts below)
    "gpt_oss": ("mlp", "router", "experts", "experts", ("gate_proj", "up_proj", "down_proj")),
}


def expert_names(mt: str, layer_prefix: str) -> ExpertNames:
    block, router, stacked, per, names = _LAYOUTS[mt]
    b = f"{layer_prefix}.{block}"
    ours = dict(zip(("gate_proj", "up_proj", "down_proj"), names, strict=True))
    sh = (f"{b}.shared_expert", f"{b}.shared_expert_gate") if mt == "qwen2_moe" else ("", "")
    return ExpertNames(f"{b}.{router}", f"{b}.{stacked}", f"{b}.{per}", ours, *sh)


def stack_per_expert(tensors: dict, n: ExpertNames, num_experts: int) -> list[str]:
    """Where the checkpoint holds one tensor per expert (transformers' layout), put their
    stack (E, ...) under the stacked name in `tensors` and return the per-expert names it
    consumed. One layer at a time: the caller pops the stacks once they are on the device."""
    import numpy as np  # noqa: PLC0415

    from .weights import Tensor  # noqa: PLC0415

    used: list[str] = []
    for ours, theirs in n.names.items():
        for suffix in ("weight", "scales", "biases", "bias"):
            if f"{n.per_expert}.0.{theirs}.{suffix}" not in tensors:
                continue
            parts = []
            for e in range(num_experts):
                name = f"{n.per_expert}.{e}.{theirs}.{suffix}"
                t = tensors.get(name)
                if t is None:
                    raise MlxrunError(
                        f"the checkpoint has no tensor {name!r} (config.json says "
                        f"{num_experts} experts); is the download complete?"
                    )
                if parts and (t.dtype, t.shape) != (parts[0].dtype, parts[0].shape):
                    raise MlxrunError(
                        f"tensor {name!r} is {t.dtype} {list(t.shape)} but expert 0's is "
                        f"{parts[0].dtype} {list(parts[0].shape)}: the checkpoint is corrupt"
                    )
                parts.append(t)
                used.append(name)
            stack = np.stack([np.asarray(t.data) for t in parts])
            tensors[f"{n.stacked}.{ours}.{suffix}"] = Tensor(parts[0].dtype, stack)
    return used


# --- accounting (memory planner, bench) ------------------------------------------------------


def layer_shapes(c, prefix: str, dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of one MoE layer's tensors in the stacked layout (`prefix`
    like "model.layers.3."), for a planner without a checkpoint."""
    o = c.moe
    E, I, H = o.num_experts, o.intermediate_size, c.hidden_size
    n = expert_names(c.model_type, prefix.rstrip("."))
    out = {f"{n.router}.weight": ((E, H), dtype)}
    for k, shape in (("gate_proj", (E, I, H)), ("up_proj", (E, I, H)), ("down_proj", (E, H, I))):
        out[f"{n.stacked}.{k}.weight"] = (shape, dtype)
        if o.bias:
            out[f"{n.stacked}.{k}.bias"] = (shape[:2], dtype)
    if o.bias:
        out[f"{n.router}.bias"] = ((E,), dtype)
    S = o.shared_intermediate_size
    if S:  # the shared expert, always run
        for k, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
            out[f"{n.shared}.{k}.weight"] = (shape, dtype)
        out[f"{n.shared_gate}.weight"] = ((1, H), dtype)
    return out


def experts_read(o: MoEOptions, batch: int) -> float:
    """Experts one decode step of `batch` tokens reads in a layer, expected: each token picks
    top_k of E; taken as uniform and independent, an expert is missed by all of them with
    probability (1 - k/E)^batch. Batch 1 reads exactly k; the bound is E."""
    E, k = o.num_experts, o.top_k
    return E * (1 - (1 - k / E) ** batch)


def fused_experts(tensors: dict, n: ExpertNames) -> list[str]:
    """gpt-oss's fused expert tensors -> the stacked layout, put in `tensors`; returns the
    names consumed. Two stored forms, both transformers':
    - full precision: gate_up_proj (E, hidden, 2I) (input first, gate and up interleaved
      along the last axis), down_proj (E, I, hidden), and their _bias (E, 2I) / (E, hidden);
    - OpenAI's MXFP4 release: *_blocks (E, out, in/32, 16) uint8, two E2M1 codes a byte, low
      nibble first, and *_scales (E, out, in/32) E8M0: MLX's mxfp4 bytes exactly, so the
      blocks are only viewed as uint32 words (as mlx-lm's sanitize does), never re-quantized.
    """
    import numpy as np  # noqa: PLC0415

    from .weights import Tensor  # noqa: PLC0415

    used: list[str] = []
    base = n.stacked

    def take(name):
        used.append(name)
        return tensors[name]

    def put(name, dtype, a):
        tensors[name] = Tensor(dtype, np.ascontiguousarray(a))

    if f"{base}.gate_up_proj" in tensors:
        t = take(f"{base}.gate_up_proj")
        put(f"{base}.gate_proj.weight", t.dtype, np.swapaxes(t.data[..., 0::2], 1, 2))
        put(f"{base}.up_proj.weight", t.dtype, np.swapaxes(t.data[..., 1::2], 1, 2))
    if f"{base}.down_proj" in tensors:
        t = take(f"{base}.down_proj")
        put(f"{base}.down_proj.weight", t.dtype, np.swapaxes(t.data, 1, 2))
    for proj in ("gate_up_proj", "down_proj"):
        if f"{base}.{proj}_blocks" in tensors:
            b, sc = take(f"{base}.{proj}_blocks"), take(f"{base}.{proj}_scales")
            words = np.ascontiguousarray(b.data).view(np.uint32).reshape(*b.shape[:2], -1)
            for k, rows in (
                (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))
                if proj == "gate_up_proj"
                else (("down_proj", slice(None)),)
            ):
                put(f"{base}.{k}.weight", "U32", words[:, rows])
                put(f"{base}.{k}.scales", sc.dtype, sc.data[:, rows])
        if f"{base}.{proj}_bias" in tensors:
            t = take(f"{base}.{proj}_bias")
            if proj == "gate_up_proj":
                put(f"{base}.gate_proj.bias", t.dtype, t.data[:, 0::2])
                put(f"{base}.up_proj.bias", t.dtype, t.data[:, 1::2])
            else:
                put(f"{base}.down_proj.bias", t.dtype, t.data)
    return used
