"""Import a llama-architecture GGUF file (llama.cpp) as a Hugging Face-layout checkpoint.

`read_gguf` memory-maps the file and returns the config.json, the tensors under HF names, and
a tokenizer.json rebuilt from the GGUF metadata; `mlxrun.convert` writes them as a directory
that the safetensors loader (and mlx-lm) reads.

GGUF Q4_0, Q4_1 and Q8_0 blocks are affine groups of 32 values with an fp16 scale, so they
map without loss onto the canonical packed format (DESIGN.md): `w = scales * q + biases`.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import MlxrunError
from .weights import Tensor

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
GROUP = 32  # values per GGUF Q4_0/Q4_1/Q8_0 block = canonical group size

# GGUF block layout: (bytes per block, bits per value, has a stored min `m`)
_BLOCKS = {"Q4_0": (18, 4, False), "Q4_1": (20, 4, True), "Q8_0": (34, 8, False)}

# GGUF tensor name (after "blk.N.") -> HF module path (after "model.layers.N.")
_LAYER_NAMES = {
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
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# llama.* metadata keys that mlxrun reads into the config (or that do not change the
# arithmetic: context_length, vocab_size, rope.scaling.finetuned), and keys that are inert
# at one value (no experts, causal attention, scales of 1, no capping). Any other llama.*
# key, or one of these at another value, changes the computation in a way the import would
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


def _check_keys(path: Path, meta: _Meta, arch: str) -> None:
    """Refuse a file whose metadata asks for arithmetic the import would not carry over."""
    for key in meta.fields:
        if not key.startswith(arch + "."):
            continue  # general.*, tokenizer.*, quantize.*, split.*: no effect on the math
        sub = key[len(arch) + 1 :]
        v = meta.get(key)
        if sub in _READ_KEYS or v in _NEUTRAL_KEYS.get(sub, ()):
            continue
        if sub == "attention.value_length" and v == _key_length(meta, arch):
            continue  # values as wide as keys: what the model assumes
        raise MlxrunError(
            f"{path}: GGUF metadata {key} = {v!r} changes the computation in a way mlxrun "
            "does not implement; mlxrun refuses the file (use a safetensors checkpoint of "
            "this model if mlxrun runs its config)"
        )


def _key_length(meta: _Meta, arch: str) -> int | None:
    k = meta.get(f"{arch}.attention.key_length")
    if k is not None:
        return int(k)
    heads, width = meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.embedding_length")
    return int(width) // int(heads) if isinstance(heads, int) and width else None


@dataclass
class GGUFModel:
    """What a GGUF file holds, in Hugging Face terms (see `read_gguf`)."""

    config: dict
    tensors: dict[str, Tensor]
    tokenizer_json: str
    tokenizer_config: dict
    generation_config: dict


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Read a llama GGUF: HF config, tensors (memory-mapped where dense), tokenizer.

    Quantized linears `p` come back as `p.weight` uint32 [out, in*bits/32], `p.scales` and
    `p.biases` F16 [out, in/32]; dense tensors keep their GGUF dtype (F32, F16, BF16) and are
    views of the file, except q/k projections whose rows are un-permuted (a copy).
    """
    path = Path(path)
    reader = _open(path)
    meta = _Meta(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise MlxrunError(
            f"{path}: GGUF architecture {arch!r} is not supported: only llama GGUFs "
            "are; use a safetensors checkpoint of this model instead"
        )
    if meta.get("llama.expert_count", 0):
        raise MlxrunError(
            f"{path}: mixture-of-experts llama GGUFs are not supported; use a "
            "safetensors checkpoint of this model instead"
        )
    _check_keys(path, meta, arch)
    raw = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise MlxrunError(
                f"{path}: tensor {t.name!r} has GGUF type {t.tensor_type.name}; mlxrun reads "
                f"{', '.join(SUPPORTED_TYPES)}: re-quantize the model with llama.cpp's "
                "llama-quantize to Q4_0 or Q8_0"
            )
    config = _config(path, meta, raw)
    tensors, bits = _tensors(path, raw, config)
    quant = _quant_block(bits)
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    tok_json, tok_config, gen = _tokenizer(path, meta, config)
    return GGUFModel(config, tensors, tok_json, tok_config, gen)


def _open(path: Path):
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


class _Meta:
    """Typed access to GGUF key/value metadata."""

    def __init__(self, reader):
        self.fields = reader.fields

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.contents()


def _one(path: Path, meta: _Meta, key: str, default: Any = None) -> Any:
    """A per-model value that GGUF may also store per layer (an array): all must agree."""
    v = meta.get(key, default)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise MlxrunError(f"{path}: {key} differs between layers; mlxrun needs one value")
        v = v[0]
    if v is None:
        raise MlxrunError(f"{path}: GGUF metadata has no {key}; is this a complete llama GGUF?")
    return v


def _config(path: Path, meta: _Meta, raw: dict) -> dict:
    heads = int(_one(path, meta, "llama.attention.head_count"))
    hidden = int(_one(path, meta, "llama.embedding_length"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rot = meta.get("llama.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise MlxrunError(
            f"{path}: partial rotary embedding (rope dims {rot} of {head_dim}) is not supported"
        )
    if "token_embd.weight" not in raw:
        raise MlxrunError(f"{path}: GGUF has no token_embd.weight; re-download it")
    vocab = int(raw["token_embd.weight"].shape[1])  # GGUF shapes are [in, out]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_one(path, meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_one(path, meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_one(path, meta, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": float(_one(path, meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in raw,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    # rms_norm_eps is stored as float32: 1e-5 reads back as 9.9999997e-06; undo that.
    cfg["rms_norm_eps"] = float(
        np.format_float_positional(np.float32(cfg["rms_norm_eps"]), unique=True)
    )
    rs = _rope_scaling(path, meta, raw, cfg)
    if rs:
        cfg["rope_scaling"] = rs
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[name] = int(v)
    eos = _eos_ids(meta)
    if len(eos) > 1:
        cfg["eos_token_id"] = eos
    dense = [t.tensor_type.name for t in raw.values() if len(t.shape) == 2]
    cfg["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16"}.get(
        Counter(dense).most_common(1)[0][0] if dense else "F16", "float16"
    )
    return cfg


def _eos_ids(meta: _Meta) -> list[int]:
    """End-of-generation ids: EOS, plus end-of-turn/message where the file names them."""
    out = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in out:
            out.append(int(v))
    return out


def _rope_scaling(path: Path, meta: _Meta, raw: dict, cfg: dict) -> dict | None:
    """HF rope_scaling from GGUF keys, or from llama.cpp's rope_freqs tensor (Llama 3.x)."""
    kind = meta.get("llama.rope.scaling.type")
    factor = meta.get("llama.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(
                meta.get("llama.rope.scaling.original_context_length", 0)
            ),
        }
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
        from .config import ModelConfig

        check = ModelConfig.from_dict({**cfg, "rope_scaling": rs}).rope_freqs()
        if np.allclose(check, inv / f, rtol=1e-4):
            return rs
    raise MlxrunError(
        f"{path}: its rope_freqs tensor is not a llama3 rope scaling that mlxrun "
        "recognizes; use a safetensors checkpoint of this model instead"
    )


# ------------------------------------------------------------------------------------ tensors


def _hf_name(path: Path, name: str) -> str:
    parts = name.split(".")
    if parts[-1] != "weight":
        raise MlxrunError(
            f"{path}: tensor {name!r}: llama GGUFs with biases are not supported; use a "
            "safetensors checkpoint of this model instead"
        )
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise MlxrunError(
        f"{path}: tensor {name!r} has no place in a llama model; only plain "
        "llama GGUFs are supported"
    )


def _unpermute_index(rows: int, n_head: int) -> np.ndarray:
    """Row gather index undoing llama.cpp's rope permutation of q/k (convert_hf_to_gguf.py).

    llama.cpp stores HF row (h, half, i) of each head at (h, i, half): it interleaves the two
    rotary halves. hf_rows = gguf_rows[index].
    """
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def _tensors(path: Path, raw: dict, cfg: dict) -> tuple[dict[str, Tensor], dict[str, int | None]]:
    """HF tensors, and per quantizable module its bits (None when dense)."""
    out: dict[str, Tensor] = {}
    bits: dict[str, int | None] = {}
    for name, t in raw.items():
        if name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        hf = _hf_name(path, name)
        kind = t.tensor_type.name
        perm = None
        if name.endswith((".attn_q.weight", ".attn_k.weight")):
            n = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            perm = _unpermute_index(int(t.shape[-1]), n)
        module = hf.rsplit(".", 1)[0]
        if kind in _BLOCKS:
            w, scales, biases = unpack_blocks(np.asarray(t.data), kind)
            if perm is not None:
                w, scales, biases = w[perm], scales[perm], biases[perm]
            out[hf] = Tensor("U32", w)
            out[f"{module}.scales"] = Tensor("F16", scales)
            out[f"{module}.biases"] = Tensor("F16", biases)
            bits[module] = _BLOCKS[kind][1]
            continue
        data = np.asarray(t.data)
        if kind == "BF16":
            data = data.view(np.uint16)  # the reader maps BF16 as raw bytes [rows, 2*cols]
        data = data.reshape(
            tuple(int(d) for d in reversed(t.shape)) if len(t.shape) > 1 else (int(t.shape[0]),)
        )
        if perm is not None:
            data = data[perm]
        out[hf] = Tensor(kind, data)
        if data.ndim == 2:
            bits[module] = None
    return out, bits


def unpack_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_0/Q4_1/Q8_0 rows -> canonical affine (weight, scales, biases), bit-exact.

    raw: uint8 [rows, nblocks * block_bytes]. Returns weight uint32 [rows, in*bits/32] (value
    i at bit offset i*bits, least significant first), scales and biases F16 [rows, in/32].
    """
    nbytes, nbits, has_min = _BLOCKS[kind]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, nbytes)  # (rows, nb, block_bytes)
    nb = blocks.shape[1]
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).reshape(rows, nb)
    if kind == "Q8_0":
        # int8 q in [-128, 127] -> unsigned q+128 (flip the sign bit); w = d*q = d*u - 128*d
        qs = blocks[:, :, 2:] ^ np.uint8(0x80)
        packed = np.ascontiguousarray(qs).reshape(rows, nb * 32)
        biases = (np.float32(-128) * d.astype(np.float32)).astype(np.float16)
    else:
        qs = blocks[:, :, 4:] if has_min else blocks[:, :, 2:]  # (rows, nb, 16)
        # GGML: byte j holds element j (low nibble) and j+16 (high nibble); canonical: byte k
        # holds elements 2k (low) and 2k+1 (high).
        lo, hi = qs & np.uint8(0x0F), qs >> np.uint8(4)
        packed = np.concatenate(
            [
                lo[:, :, 0::2] | (lo[:, :, 1::2] << np.uint8(4)),
                hi[:, :, 0::2] | (hi[:, :, 1::2] << np.uint8(4)),
            ],
            axis=2,
        )
        packed = packed.reshape(rows, nb * 16)
        if has_min:
            biases = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).reshape(rows, nb)
        else:
            # w = d*(q-8) = d*q - 8*d; times a power of two is exact in fp16 short of overflow
            biases = (np.float32(-8) * d.astype(np.float32)).astype(np.float16)
    if not np.isfinite(biases[np.isfinite(d)]).all():
        raise MlxrunError(
            f"a {kind} block scale is too large to import without loss; "
            "re-quantize the model with llama.cpp to Q4_1"
        )
    return packed.view(np.uint32), np.ascontiguousarray(d), np.ascontiguousarray(biases)


def _quant_block(bits: dict[str, int | None]) -> dict | None:
    """config.json "quantization": the predominant bits, per-module overrides for the rest."""
    counts = Counter(b for b in bits.values() if b is not None)
    if not counts:
        return None
    main = counts.most_common(1)[0][0]
    q: dict[str, Any] = {"group_size": GROUP, "bits": main, "mode": "affine"}
    for module, b in bits.items():
        if b is None:
            q[module] = False
        elif b != main:
            q[module] = {"group_size": GROUP, "bits": b, "mode": "affine"}
    return q


# ---------------------------------------------------------------------------------- tokenizer

# Pre-tokenizer split patterns, by llama.cpp's `tokenizer.ggml.pre` name (as in each model's
# own tokenizer.json).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_CASED = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
    r"|{n}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = _CASED.replace("{c}", "").replace("{n}", r"\p{N}")
_GPT4O = _CASED.replace("{c}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?").replace("{n}", r"\p{N}{1,3}")
_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"), _LLAMA3
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O),
}
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"}
_GPT2_PRE = {None, "default", "gpt2", "gpt-2"}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level BPE tokens."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: best-scored merged piece first.

    Every split of a piece into two vocabulary pieces is a merge ranked by the piece's score
    (ties: longer left, then longer right part first), as transformers' LlamaTokenizer
    conversion does.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for tok, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [
            (tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in ids and tok[k:] in ids
        ]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        found += [(score, left, right) for left, right in pairs]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _tokenizer(path: Path, meta: _Meta, cfg: dict) -> tuple[str, dict, dict]:
    """(tokenizer.json text, tokenizer_config, generation_config) from GGUF metadata."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise MlxrunError(f"{path}: GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    if len(types) != len(tokens) or len(scores) != len(tokens):
        raise MlxrunError(
            f"{path}: corrupt GGUF tokenizer (token, type and score lists differ "
            "in length); re-download it"
        )
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]

    def tok_at(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos, unk, pad = (
        tok_at(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    )
    added = [
        AddedToken(t, special=ty == _CONTROL, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    if kind == "gpt2":
        chars = _byte_chars()
        alphabet = set(chars.values())
        # Normal tokens are spelled in the byte alphabet; added (control, user-defined) ones
        # are stored as plain text, which is how tokenizer.json keeps them too.
        vocab = {
            t
            if set(t) <= alphabet or ty in (_CONTROL, _USER_DEFINED)
            else "".join(chars[b] for b in t.encode()): i
            for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        }
        pre = meta.get("tokenizer.ggml.pre")
        tk = Tokenizer(
            models.BPE(
                vocab,
                merges,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre in _IGNORE_MERGES,
            )
        )
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _SPLITS:
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre == "smollm":  # SmolLM: single digits, then GPT-2's split
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            if pre not in _GPT2_PRE:
                warnings.warn(
                    f"{path}: unknown GGUF pre-tokenizer {pre!r}; splitting text the "
                    "GPT-2 way, which may tokenize differently",
                    stacklevel=3,
                )
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
        default_bos = False
    elif kind == "llama":
        if not merges:
            merges = _spm_merges(tokens, scores)
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tk.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tk.decoder = decoders.Sequence(steps)
        default_bos = True  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise MlxrunError(
            f"{path}: GGUF tokenizer type {kind!r} is not supported (mlxrun reads "
            "'gpt2' and 'llama'); use a safetensors checkpoint with tokenizer.json"
        )
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])
    if unk is not None and kind == "llama":
        tk.add_special_tokens([AddedToken(unk, special=True, normalized=False)])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [
        (t, int(meta.get(f"tokenizer.ggml.{k}")))
        for t, k, on in ((bos, "bos_token_id", add_bos), (eos, "eos_token_id", add_eos))
        if on
    ]
    tk.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
    }
    template = meta.get("tokenizer.chat_template")
    named = {
        k[len("tokenizer.chat_template.") :]: meta.get(k)
        for k in meta.fields
        if k.startswith("tokenizer.chat_template.")
    }
    if named:
        template = ([{"name": "default", "template": template}] if template else []) + [
            {"name": n, "template": t} for n, t in named.items()
        ]
    if template:
        tok_config["chat_template"] = template

    gen: dict[str, Any] = {}
    if cfg.get("bos_token_id") is not None:
        gen["bos_token_id"] = cfg["bos_token_id"]
    eos_ids = _eos_ids(meta)
    if eos_ids:
        gen["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        gen["pad_token_id"] = int(meta.get("tokenizer.ggml.padding_token_id"))
    return tk.to_str(), tok_config, gen
