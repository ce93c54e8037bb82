"""Model configuration: a small frozen dataclass built from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import rope
from .errors import MlxrunError
from .moe import MOE_KEYS, MoEOptions, moe_options
from .validate import REQUIRED_SIZES, check_config

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gpt_oss",
    "gemma3_text",
)

# hidden_act values the model runs, under transformers' names; gelu_new is the same tanh
# approximation as gelu_pytorch_tanh, swish another name for silu.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")

# Keys that change the arithmetic in other families (Gemma, Granite, Cohere, Phi, ...) and
# that no family mlxrun runs implements: a value other than the neutral one means the
# checkpoint computes something mlxrun would not, so it is refused rather than ignored.
_FOREIGN = {
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "partial_rotary_factor": (None, 1, 1.0),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "use_parallel_residual": (None, False),
    "parallel_attn": (None, False),
    "norm_type": (None, "rms_norm", "rmsnorm"),
    "hidden_activation": (None,),
    "moe_intermediate_size": (None,),
    "num_local_experts": (None, 0, 1),
    "num_experts": (None, 0, 1),
    "num_experts_per_tok": (None,),
    "shared_expert_intermediate_size": (None, 0),
}


@dataclass(frozen=True)
class ModelConfig:
    """The fields the forward pass needs; everything else in config.json is ignored.

    Built with `ModelConfig.from_dict(config_json)`. Derived fields (head_dim, the list of
    EOS ids, the q/k/v bias and q/k norm switches) are filled in by `from_dict` from the
    model type, so the model code never looks at `model_type`.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2, Llama option)
    o_bias: bool = False  # the attention output projection carries a bias (Llama option)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama option)
    hidden_act: str = "silu"  # the gate's activation: one of ACTIVATIONS
    qk_norm: bool = False  # RMSNorm on each head of q and k before rope (Qwen3)
    # a learned logit per head (self_attn.sinks) joins each query's softmax (gpt-oss)
    attention_sinks: bool = False
    # Per layer: the attention window (a query sees the `w` latest keys, itself included),
    # or None for full causal attention. Empty means no layer slides.
    layer_windows: tuple[int | None, ...] = ()
    moe: MoEOptions | None = None  # mixture-of-experts layers (mlxrun/moe.py); None: dense
    # Gemma: norms scale by (1 + weight) (folded into the weights at load), the embedding
    # output is scaled, attention scores use query_pre_attn_scalar^-0.5, the attention and
    # MLP outputs are normalised before their residual adds (sandwich_norms), and sliding
    # layers rotate with their own unscaled base (local_rope_theta)
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim^-0.5
    sandwich_norms: bool = False
    local_rope_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    quantization: dict | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict; raises MlxrunError on unknown, incomplete or
        ill-typed configs (the value checks live in `validate.check_config`)."""
        check_config(d)
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise MlxrunError(
                f"unsupported model_type {mt!r}: mlxrun runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and k != "extra"}
        for req in REQUIRED_SIZES:
            if req not in kw:
                raise MlxrunError(f"config.json has no {req!r}; is this a {mt} checkpoint?")
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        if kw["num_attention_heads"] % kw["num_key_value_heads"]:
            raise MlxrunError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if not kw.get("head_dim"):
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        # Newer configs (transformers >= 4.56) nest rope settings in `rope_parameters`.
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            if "rope_theta" in rp:
                kw["rope_theta"] = rp["rope_theta"]
            if rope.rope_type(rp) != "default":
                kw["rope_scaling"] = rp
        kw["rope_scaling"] = rope.normalise(kw.get("rope_scaling"), d)
        eos = d.get("eos_token_id")
        kw["eos_token_id"] = (
            tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        )
        kw.update(_arch_options(mt, d, kw["num_hidden_layers"]))
        if "quantization" not in kw and "quantization_config" in d:
            kw["quantization"] = d["quantization_config"]
        method = (kw.get("quantization") or {}).get("quant_method")
        if method == "mxfp4" and mt == "gpt_oss":
            # OpenAI's release: the experts in MXFP4 (E2M1 values, E8M0 scales, groups of
            # 32: MLX's mxfp4 bytes, read as stored), everything else unquantized
            kw["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        elif method is not None:
            raise MlxrunError(
                f"config.json quantization_config has quant_method {method!r}, a transformers "
                "format mlxrun does not read; use the full-precision checkpoint (mlxrun "
                "quantizes it with --quant) or an MLX-format quantized copy"
            )
        kw["extra"] = {k: v for k, v in d.items() if k not in names}
        return cls(**kw)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (keys a query sees, itself included), or None."""
        return self.layer_windows[layer] if self.layer_windows else None

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def rope_freqs(self, seq_len: int | None = None, *, local: bool = False) -> np.ndarray:
        """Inverse frequencies (head_dim/2,) float32 with the rope scaling applied; for
        "dynamic" (NTK) rope, those of a forward pass whose largest position is seq_len - 1;
        `local`: those of Gemma's sliding layers (their own base, local_rope_theta, unscaled)."""
        if local:
            return rope.inv_freq(
                self.local_rope_theta, self.head_dim, None, self.max_position_embeddings, None
            )
        return rope.inv_freq(
            self.rope_theta, self.head_dim, self.rope_scaling, self.max_position_embeddings, seq_len
        )

    @property
    def context_length(self) -> int:
        """The longest sequence the model runs: max_position_embeddings, times the factor of
        "dynamic" rope (its config names the trained context; NTK stretches past it)."""
        if self.rope_dynamic:
            return int(self.max_position_embeddings * self.rope_scaling["factor"])
        return self.max_position_embeddings

    @property
    def rope_dynamic(self) -> bool:
        """The inverse frequencies depend on the pass's length ("dynamic" NTK rope)."""
        return rope.rope_type(self.rope_scaling) == "dynamic"

    @property
    def attention_scale(self) -> float:
        """The softmax scale: head_dim^-0.5, times the square of YaRN's attention factor
        (transformers scales cos and sin by it, so q and k each carry it)."""
        return self.head_dim**-0.5 * rope.attention_factor(self.rope_scaling) ** 2


def _refuse(option: str, value: Any, why: str) -> MlxrunError:
    return MlxrunError(f"config.json {option} = {value!r}: {why}; mlxrun refuses the model")


def _window_value(d: dict, default: int | None) -> int | None:
    w = d.get("sliding_window", default)
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise _refuse("sliding_window", w, "expected a positive integer or null")
    return w


def _layer_types(d: dict, n: int, default: list[str]) -> list[str]:
    lt = d.get("layer_types") or default
    if not isinstance(lt, list) or len(lt) != n:
        raise _refuse("layer_types", lt, f"expected a list of {n} entries, one per layer")
    for t in lt:
        if t not in ("full_attention", "sliding_attention"):
            raise _refuse("layer_types", t, "mlxrun runs full_attention and sliding_attention")
    return lt


def _gemma3(d: dict[str, Any], n: int) -> dict[str, Any]:
    """Gemma 3 (text) options, as transformers' Gemma3TextModel reads its config: layer
    types from `layer_types` (or every `sliding_window_pattern`-th layer global), rope from
    the per-type `rope_parameters` (transformers >= 5) or rope_theta / rope_scaling (global)
    and rope_local_base_freq (sliding)."""
    if d.get("attention_bias", False):
        raise _refuse("attention_bias", True, "mlxrun's gemma3_text has no attention biases")
    pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
    default = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
    ]
    w = _window_value(d, 4096)
    types = _layer_types(d, n, default)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        full, local = rp["full_attention"], rp.get("sliding_attention", {})
        theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
        scaling = full if full.get("rope_type", "default") != "default" else None
        if local.get("rope_type", "default") != "default":
            raise _refuse("rope_parameters.sliding_attention", local, "it must be unscaled")
    else:
        theta = d.get("rope_theta", 1e6)
        local_theta = d.get("rope_local_base_freq", 1e4)
        scaling = d.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "linear":
        raise _refuse("rope_scaling", scaling, "mlxrun's gemma3_text scales rope linearly")
    return dict(
        attention_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, norm_offset=1.0,
        embed_scale=float(d["hidden_size"]) ** 0.5, sandwich_norms=True,
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        rope_theta=float(theta), rope_scaling=scaling, local_rope_theta=float(local_theta),
        windows=[w if t == "sliding_attention" else None for t in types],
    )  # fmt: skip


def _arch_options(mt: str, d: dict[str, Any], n: int) -> dict[str, Any]:
    """The options of `model_type` mt that change the arithmetic, read as transformers'
    modeling code for that family reads them; anything else that would change it is refused
    with one line naming the option and its value."""
    moe = moe_options(mt, d, n)
    own = ("query_pre_attn_scalar", "hidden_activation") if mt == "gemma3_text" else ()
    for key, neutral in _FOREIGN.items():
        if moe is not None and key in MOE_KEYS:
            continue
        v = d.get(key)
        if v not in neutral and key not in own:
            raise _refuse(key, v, f"mlxrun's {mt} model has no such option")
    act = d.get("hidden_activation" if mt == "gemma3_text" else "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise _refuse("hidden_act", act, f"mlxrun runs {', '.join(ACTIVATIONS)}")
    opts: dict[str, Any] = {"hidden_act": "silu" if act == "swish" else act, "moe": moe}
    bias = d.get("attention_bias", False) is True
    if mt == "llama":  # biases on every attention projection, and optionally the MLP
        opts.update(attention_bias=bias, o_bias=bias, mlp_bias=d.get("mlp_bias", False) is True)
        if d.get("sliding_window") is not None:
            why = "Llama has no sliding window (a Mistral checkpoint says model_type mistral)"
            raise _refuse("sliding_window", d["sliding_window"], why)
        windows: list[int | None] = [None] * n
    elif mt == "mistral":  # fixed: no biases; the window (4096 if unset) on every layer
        opts.update(attention_bias=False, o_bias=False, mlp_bias=False)
        windows = [_window_value(d, 4096)] * n
    elif mt == "mixtral":  # Mistral's attention; the window on every layer, none if unset
        opts.update(attention_bias=False, o_bias=False, mlp_bias=False)
        windows = [_window_value(d, None)] * n
    elif mt == "qwen3_moe":  # Qwen3's attention; with use_sliding_window, every layer slides
        opts.update(attention_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
        slide = d.get("use_sliding_window", False) is True
        windows = [_window_value(d, 4096) if slide else None] * n
    elif mt == "qwen2_moe":  # Qwen2's attention: q/k/v biased (qkv_bias), o never
        qkv = d.get("qkv_bias", True) is True
        opts.update(attention_bias=qkv, o_bias=False, mlp_bias=False)
        if d.get("use_sliding_window", False) is True:
            why = "mlxrun's qwen2_moe runs full attention on every layer (as released)"
            raise _refuse("use_sliding_window", True, why)
        windows = [None] * n
    elif mt == "gpt_oss":  # biases on q/k/v/o, a sink per head, windows by layer_types
        opts.update(attention_bias=bias, o_bias=bias, mlp_bias=False, attention_sinks=True)
        w = _window_value(d, 128)
        default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        windows = [w if t == "sliding_attention" else None for t in _layer_types(d, n, default)]
    elif mt in ("qwen2", "qwen3"):
        if mt == "qwen2":  # q/k/v always biased, o never
            opts.update(attention_bias=True, o_bias=False, mlp_bias=False)
        else:  # biases on all four as attention_bias says; q/k RMSNorm per head
            opts.update(attention_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
        slide = d.get("use_sliding_window", False) is True
        w = _window_value(d, 4096) if slide else None
        first = d.get("max_window_layers", 28)
        default = [
            "sliding_attention" if w is not None and i >= first else "full_attention"
            for i in range(n)
        ]
        windows = [w if t == "sliding_attention" else None for t in _layer_types(d, n, default)]
    elif mt == "gemma3_text":
        opts.update(_gemma3(d, n))
        windows = list(opts.pop("windows"))
    else:  # pragma: no cover (from_dict checked the type)
        raise AssertionError(mt)
    rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if isinstance(rs, dict) and rs.get("partial_rotary_factor", 1.0) != 1.0:
        why = "mlxrun rotates the whole head"
        raise _refuse("rope partial_rotary_factor", rs["partial_rotary_factor"], why)
    opts["layer_windows"] = tuple(windows) if any(w is not None for w in windows) else ()
    return opts
