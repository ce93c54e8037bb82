"""GGUF tokenizer metadata -> a Hugging Face tokenizer.json, tokenizer_config and
generation_config (byte-level BPE for `gpt2` vocabularies, sentencepiece-style BPE for `llama`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ..errors import MlxrunError
from .meta import Meta, eos_ids

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


def tokenizer(path: Path, meta: Meta, cfg: dict) -> tuple[str, dict, dict]:
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
    ends = eos_ids(meta)
    if ends:
        gen["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        gen["pad_token_id"] = int(meta.get("tokenizer.ggml.padding_token_id"))
    return tk.to_str(), tok_config, gen
