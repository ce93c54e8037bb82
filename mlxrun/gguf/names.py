"""The GGUF architectures mlxrun reads, and each one's tensor names in Hugging Face terms.

llama.cpp names tensors `blk.N.attn_q.weight`, `token_embd.weight`, ...; the HF checkpoint
names are `model.layers.N.self_attn.q_proj.weight`, ... Mistral models are written by
llama.cpp as `llama` files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MlxrunError

# GGUF tensor name (after "blk.N.") -> HF module path (after "model.layers.N.")
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Mixture-of-experts layers: the router and the experts stacked (E, out, in), experts first
# as llama.cpp stores them, under mlx-lm's switch_mlp names (mlxrun.moe.expert_names); a
# shared expert (Qwen2-MoE) and its gate, a vector [hidden] in the file
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_SHARED = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# the {arch}.* keys of the MoE architectures (read by meta.moe_config)
_MOE_KEYS = (
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_weights_norm",
)  # fmt: skip


@dataclass(frozen=True)
class Arch:
    """How one `general.architecture` maps onto a Hugging Face model type."""

    model_type: str
    hf_class: str
    # llama.cpp's llama converter interleaves the two rotary halves of each q/k head
    permute_qk: bool
    layer: dict[str, str]
    with_bias: tuple[str, ...] = ()  # GGUF layer tensors that also store a `.bias`
    # llama.cpp stores Gemma's norm weights as 1 + w; the HF weight is the stored one - 1
    norm_shift: float = 0.0
    reads: tuple[str, ...] = ()  # `{arch}.*` keys beyond meta._READ_KEYS that it reads
    # mixture of experts: how the router's weights are renormalised when the file does not
    # say ({arch}.expert_weights_norm), as llama.cpp runs the architecture; None: dense
    norm_topk: bool | None = None


_GEMMA3 = {
    **_LAYER,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", True, _LAYER),
    "qwen2": Arch(
        "qwen2", "Qwen2ForCausalLM", False, _LAYER, with_bias=("attn_q", "attn_k", "attn_v")
    ),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", False, {**_LAYER, **_QK_NORM}),
    # llama.cpp renormalises Qwen3-MoE's top-k weights (its config's norm_topk_prob), not
    # Qwen2-MoE's
    "qwen3moe": Arch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        False,
        {**_LAYER, **_QK_NORM, **_MOE},
        reads=_MOE_KEYS,
        norm_topk=True,
    ),
    "qwen2moe": Arch(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        False,
        {**_LAYER, **_MOE, **_SHARED},
        with_bias=("attn_q", "attn_k", "attn_v"),
        reads=(*_MOE_KEYS, "expert_shared_feed_forward_length"),
        norm_topk=False,
    ),
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        False,
        _GEMMA3,
        norm_shift=1.0,
        reads=("attention.sliding_window",),
    ),
}


# gpt-oss: its post-attention norm is the norm before the experts; a sink logit per head;
# biases on the attention, the router and the experts; the experts under mlp.experts
# (mlxrun.moe.expert_names: mlx-lm's gpt-oss layout)
_GPT_OSS = {
    **{k: v for k, v in _LAYER.items() if not k.startswith("ffn_")},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    **{k: v.replace("switch_mlp", "experts") for k, v in _MOE.items() if k != "ffn_gate_inp"},
}
ARCHS["gpt-oss"] = Arch(
    "gpt_oss",
    "GptOssForCausalLM",
    False,
    _GPT_OSS,
    with_bias=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps",
               "ffn_up_exps", "ffn_down_exps"),
    reads=(*_MOE_KEYS, "attention.sliding_window"),
    norm_topk=False,  # top k of the logits, softmax over those: nothing to renormalise
)  # fmt: skip

# llama.cpp writes Mixtral as `llama` with experts (`llama.expert_count`): Mistral's
# attention (q/k permuted as llama's), always-renormalised top-k routing, the experts under
# transformers' Mixtral block names
MIXTRAL = Arch(
    "mixtral",
    "MixtralForCausalLM",
    True,
    {**_LAYER, **{k: "block_sparse_moe." + v[len("mlp.") :] for k, v in _MOE.items()}},
    reads=_MOE_KEYS,
    norm_topk=True,
)


def arch_of(path: Path, name: str | None, experts: int = 0) -> Arch:
    """The `Arch` for a file's `general.architecture` (`experts`: its `{arch}.expert_count`),
    or MlxrunError naming those read."""
    if name == "llama" and experts:
        return MIXTRAL
    if name not in ARCHS:
        raise MlxrunError(
            f"{path}: GGUF architecture {name!r} is not supported: mlxrun reads "
            f"{', '.join(ARCHS)} GGUFs (Mistral's and Mixtral's are llama; gemma3 is Gemma 3's "
            "text model; qwen3moe, qwen2moe and gpt-oss are the mixture-of-experts Qwen3-MoE, "
            "Qwen2-MoE and gpt-oss)"
        )
    return ARCHS[name]


def hf_name(path: Path, arch: Arch, name: str) -> str:
    """GGUF tensor name -> HF tensor name, or MlxrunError for a tensor with no place."""
    parts = name.split(".")
    kind = parts[-1]
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in arch.layer:
        if parts[2] == "attn_sinks" and kind == "weight":  # a parameter of its own in HF
            return f"model.layers.{parts[1]}.{arch.layer[parts[2]]}"
        if kind == "weight" or (kind == "bias" and parts[2] in arch.with_bias):
            return f"model.layers.{parts[1]}.{arch.layer[parts[2]]}.{kind}"
    elif len(parts) == 2 and parts[0] in _TOP and kind == "weight":
        return f"{_TOP[parts[0]]}.{kind}"
    raise MlxrunError(
        f"{path}: tensor {name!r} has no place in a {arch.model_type} model; the file "
        "holds a variant mlxrun does not run"
    )


def unpermute_index(rows: int, n_head: int) -> np.ndarray:
    """Row gather index undoing llama.cpp's rope permutation of q/k (convert_hf_to_gguf.py).

    llama.cpp stores HF row (h, half, i) of each head at (h, i, half): it interleaves the two
    rotary halves. hf_rows = gguf_rows[index].
    """
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
