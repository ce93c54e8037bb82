"""Opening a GGUF file and turning its key/value metadata into a Hugging Face config.json.

Each architecture stores the same hyperparameters under its own prefix (`llama.block_count`,
`qwen2.block_count`, ...); `names.ARCHS` says which architectures are read and how.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MlxrunError


def open_reader(path: Path):
    import gguf

    if not path.is_file():
        raise MlxrunError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise MlxrunError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError):
        # the reader fails inside numpy on a short read; its message would not help
        raise MlxrunError(f"{path}: corrupt or truncated GGUF file; re-download it") from None
    except OSError as e:
        raise MlxrunError(f"cannot read {path}: {e.strerror or e}") from None
    if reader.byte_order != "I":
        raise MlxrunError(
            f"{path}: big-endian GGUF files are not supported; use a little-endian one"
        )
    if "general.architecture" not in reader.fields:
        raise MlxrunError(f"{path}: corrupt GGUF (no general.architecture); re-download it")
    return reader


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# What the keys mlxrun reads must hold; a file is data from outside, so a string where a
# count belongs ends in one line, not a ValueError from int().
_STRINGS = ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre")
_LISTS = {
    "tokenizer.ggml.tokens": (str,),
    "tokenizer.ggml.merges": (str,),
    "tokenizer.ggml.token_type": (int,),
    "tokenizer.ggml.scores": (int, float),
}
_FREE = ("general", "tokenizer", "quantize", "split")  # prefixes of non-numeric keys


class Meta:
    """Typed access to GGUF key/value metadata: numbers where mlxrun reads numbers (the
    architecture's `{arch}.*` keys, token ids), strings and lists of the right element type
    elsewhere."""

    def __init__(self, reader, path: Path | None = None):
        self.fields = reader.fields
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        if f is None:
            return default
        try:
            v = f.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            raise self.bad(key, "unreadable") from None
        if (
            key in _STRINGS
            or key.startswith("tokenizer.chat_template")
            or key.endswith(".scaling.type")
        ):
            ok = isinstance(v, str)
        elif key in _LISTS:
            ok = isinstance(v, list) and all(
                isinstance(x, _LISTS[key]) and not isinstance(x, bool) for x in v
            )
        elif key.split(".")[0] not in _FREE or key.endswith("_token_id"):
            ok = (
                _is_num(v)
                or isinstance(v, bool)  # flags: attention.causal, rope.scaling.finetuned
                or (isinstance(v, list) and bool(v) and all(map(_is_num, v)))
            )
        else:
            ok = True
        if not ok:
            raise self.bad(key, repr(v)[:40])
        return v

    def bad(self, key: str, shown: str) -> MlxrunError:
        return MlxrunError(
            f"{self.path}: GGUF metadata {key} is {shown}, which is not what a GGUF of this "
            "architecture holds there; the file is corrupt or not such a model: re-download it"
        )


# {arch}.* metadata keys that mlxrun reads into the config (or that do not change the
# arithmetic: context_length, vocab_size, rope.scaling.finetuned), and keys that are inert
# at one value (no experts, causal attention, scales of 1, no capping). Any other
# {arch}.* key, or one of these at another value, changes the computation in a way the import would
# drop, so the file is refused (llama.cpp's LLM_KV names).
_READ_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "rope.dimension_count", "rope.freq_base", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
}  # fmt: skip
_NEUTRAL_KEYS = {
    "expert_count": (0,), "expert_used_count": (0,), "attention.causal": (True,),
    "logit_scale": (1.0,), "embedding_scale": (1.0,), "residual_scale": (1.0,),
    "attn_logit_softcapping": (0.0,), "final_logit_softcapping": (0.0,),
    "attention.clamp_kqv": (0.0,), "attention.max_alibi_bias": (0.0,),
    "attention.sliding_window": (0,), "rope.scale_linear": (1.0,), "use_parallel_residual": (False,),
    "pooling_type": (0,),
}  # fmt: skip


def check_keys(path: Path, meta: Meta, arch: str, reads: tuple[str, ...] = ()) -> None:
    """Refuse a file whose metadata asks for arithmetic the import would not carry over;
    `reads`: the `{arch}.*` keys beyond _READ_KEYS that the architecture's import reads."""
    for key in meta.fields:
        if not key.startswith(arch + "."):
            continue  # general.*, tokenizer.*, quantize.*, split.*: no effect on the math
        sub = key[len(arch) + 1 :]
        v = meta.get(key)
        if sub in _READ_KEYS or sub in reads or v in _NEUTRAL_KEYS.get(sub, ()):
            continue
        if sub == "attention.value_length" and v == _key_length(meta, arch):
            continue  # values as wide as keys: what the model assumes
        raise MlxrunError(
            f"{path}: GGUF metadata {key} = {v!r} changes the computation in a way mlxrun "
            "does not implement; mlxrun refuses the file (use a safetensors checkpoint of "
            "this model if mlxrun runs its config)"
        )


def _key_length(meta: Meta, arch: str) -> int | None:
    k = meta.get(f"{arch}.attention.key_length")
    if k is not None:
        return int(k)
    heads, width = meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.embedding_length")
    return int(width) // int(heads) if isinstance(heads, int) and width else None


def one(path: Path, meta: Meta, key: str, default: Any = None) -> Any:
    """A per-model value that GGUF may also store per layer (an array): all must agree."""
    v = meta.get(key, default)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise MlxrunError(f"{path}: {key} differs between layers; mlxrun needs one value")
        v = v[0]
    if v is None:
        raise MlxrunError(f"{path}: GGUF metadata has no {key}; is this a complete GGUF?")
    return v


def config(path: Path, meta: Meta, raw: dict, arch: str, hf) -> dict:
    """HF config.json from `{arch}.*` keys; hf: the `names.Arch` it runs as."""
    heads = int(one(path, meta, f"{arch}.attention.head_count"))
    hidden = int(one(path, meta, f"{arch}.embedding_length"))
    for key, v in ((f"{arch}.attention.head_count", heads), (f"{arch}.embedding_length", hidden)):
        if v < 1:
            raise meta.bad(key, str(v))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rot = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise MlxrunError(
            f"{path}: partial rotary embedding (rope dims {rot} of {head_dim}) is not supported"
        )
    if "token_embd.weight" not in raw:
        raise MlxrunError(f"{path}: GGUF has no token_embd.weight; re-download it")
    vocab = int(raw["token_embd.weight"].shape[1])  # GGUF shapes are [in, out]
    cfg = {
        "architectures": [hf.hf_class],
        "model_type": hf.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(one(path, meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(one(path, meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(one(path, meta, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": float(one(path, meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in raw,
        "hidden_act": "silu",
        "attention_bias": any(n.endswith(".attn_q.bias") for n in raw),
        "mlp_bias": False,
    }
    # rms_norm_eps is stored as float32: 1e-5 reads back as 9.9999997e-06; undo that.
    cfg["rms_norm_eps"] = float(
        np.format_float_positional(np.float32(cfg["rms_norm_eps"]), unique=True)
    )
    rs = _rope_scaling(path, meta, raw, cfg, arch)
    if rs:
        cfg["rope_scaling"] = rs
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[name] = int(v)
    eos = eos_ids(meta)
    if len(eos) > 1:
        cfg["eos_token_id"] = eos
    if hf.model_type == "gemma3_text":
        cfg.update(_gemma3(meta, arch, cfg))
    if hf.norm_topk is not None:
        cfg.update(moe_config(path, meta, arch, hf.model_type, hf.norm_topk))
    if hf.model_type == "gpt_oss" and rs and rs["rope_type"] == "yarn":
        # gpt-oss's config.json ramps over the unrounded dimensions (llama.cpp rounds the
        # ramp's ends outward); mlxrun runs the model as shipped, as transformers does
        rs.update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    dense = [t.tensor_type.name for t in raw.values() if len(t.shape) == 2]
    cfg["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16"}.get(
        Counter(dense).most_common(1)[0][0] if dense else "F16", "float16"
    )
    return cfg


def _gemma3(meta: Meta, arch: str, cfg: dict) -> dict:
    """Gemma 3's config keys that GGUF does not store, as llama.cpp (src/llama-model.cpp)
    fixes them: every 6th layer global, the rest sliding with rope base 10000; attention
    scaled by head_dim^-0.5, except the 62-layer 27B model's (hidden / heads)^-0.5."""
    n = cfg["num_hidden_layers"]
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    big = n == 62
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window or None,
        "layer_types": [
            "sliding_attention" if window and (i + 1) % 6 else "full_attention" for i in range(n)
        ],
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"]
        if big
        else cfg["head_dim"],
    }
    cfg.pop("hidden_act")
    cfg.pop("mlp_bias")
    return out


def moe_config(path: Path, meta: Meta, arch: str, model_type: str, norm_topk: bool) -> dict:
    """The MoE keys of config.json from llama.cpp's `{arch}.expert_*` keys: experts, top k,
    an expert's width (and a shared expert's, where the architecture has one), and whether
    the k routing weights are renormalised (`norm_topk` unless the file says)."""
    norm = bool(meta.get(f"{arch}.expert_weights_norm", norm_topk))
    if model_type == "gpt_oss":  # as llama.cpp fixes what the file does not store
        if norm:
            raise MlxrunError(
                f"{path}: {arch}.expert_weights_norm is true, but gpt-oss takes a softmax "
                "over the top-k logits; mlxrun refuses the file"
            )
        window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
        return {
            "num_local_experts": int(one(path, meta, f"{arch}.expert_count")),
            "num_experts_per_tok": int(one(path, meta, f"{arch}.expert_used_count")),
            "intermediate_size": int(one(path, meta, f"{arch}.expert_feed_forward_length")),
            "attention_bias": True,
            # sliding and full layers alternate, the first sliding (llama.cpp's swa pattern 2)
            "sliding_window": window or None,
            "layer_types": [
                "sliding_attention" if window and i % 2 == 0 else "full_attention"
                for i in range(int(one(path, meta, f"{arch}.block_count")))
            ],
        }
    if model_type == "mixtral":  # an expert as wide as feed_forward_length; always normalised
        if not norm:
            raise MlxrunError(
                f"{path}: {arch}.expert_weights_norm is false, but mlxrun's Mixtral always "
                "renormalises the top-k weights; mlxrun refuses the file"
            )
        width = meta.get(f"{arch}.expert_feed_forward_length")
        out = {
            "num_local_experts": int(one(path, meta, f"{arch}.expert_count")),
            "num_experts_per_tok": int(one(path, meta, f"{arch}.expert_used_count")),
        }
        if width is not None:
            out["intermediate_size"] = int(width)
        return out
    out = {
        "num_experts": int(one(path, meta, f"{arch}.expert_count")),
        "num_experts_per_tok": int(one(path, meta, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(one(path, meta, f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": norm,
    }
    shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def eos_ids(meta: Meta) -> list[int]:
    """End-of-generation ids: EOS, plus end-of-turn/message where the file names them."""
    out = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in out:
            out.append(int(v))
    return out


def _rope_scaling(path: Path, meta: Meta, raw: dict, cfg: dict, arch: str) -> dict | None:
    """HF rope_scaling from GGUF keys, or from llama.cpp's rope_freqs tensor (Llama 3.x)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        rs = {"rope_type": "yarn", "factor": float(factor)}
        old = int(meta.get(f"{arch}.rope.scaling.original_context_length", 0))
        if old:  # else the context length, as transformers defaults it
            rs["original_max_position_embeddings"] = old
        return rs
    if "rope_freqs.weight" not in raw:
        return None
    # llama.cpp stores llama3 scaling as one divisor per frequency (head_dim/2,): 1 for short
    # wavelengths, `factor` for long ones, 1/((1-s)/factor + s) between, s linear in 1/wavelength.
    # The three HF parameters enter only through that line, so recover it and check the fit.
    f = np.asarray(raw["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
    dim = cfg["head_dim"]
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    fac = float(f.max())
    mid = (f > 1 + 1e-4) & (f < fac - 1e-4 * fac)
    rs = None
    if fac > 1 and mid.sum() >= 2:
        s = (1 / f[mid] - 1 / fac) / (1 - 1 / fac)
        a, b = np.polyfit(inv[mid] / (2 * math.pi), s, 1)  # s = a/wavelen + b
        low = 1.0
        high = low - 1 / b
        rs = {
            "rope_type": "llama3",
            "factor": fac,
            "low_freq_factor": low,
            "high_freq_factor": round(float(high), 6),
            "original_max_position_embeddings": round(float(a * (high - low))),
        }
    elif fac == 1:
        return None
    if rs is not None:
        from ..config import ModelConfig  # noqa: PLC0415

        check = ModelConfig.from_dict({**cfg, "rope_scaling": rs}).rope_freqs()
        if np.allclose(check, inv / f, rtol=1e-4):
            return rs
    raise MlxrunError(
        f"{path}: its rope_freqs tensor is not a llama3 rope scaling that mlxrun "
        "recognizes; use a safetensors checkpoint of this model instead"
    )
