"""Checks on config.json values before any of them reaches the model.

A checkpoint's config is data from outside: a string where a number belongs, a zero or
negative count, or sizes that do not divide would otherwise surface as a TypeError or an
IndexError deep in loading. `check_config` answers each with one line naming the field,
its value and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import MlxrunError

# Larger values are no real model's and would overflow the int32 sizes kernels index with.
INT_MAX = 2**31 - 1

# Sizes every supported model_type must give (num_key_value_heads and head_dim default).
REQUIRED_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
OPTIONAL_SIZES = ("num_key_value_heads", "max_position_embeddings")


def _fail(field: str, value: Any, allowed: str) -> MlxrunError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return MlxrunError(f"config.json: {field} is {shown}, but it must be {allowed}; fix the config")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _size(d: dict, field: str, allowed: str = "a positive integer") -> int:
    v = d[field]
    if not _is_int(v) or not 1 <= v <= INT_MAX:
        raise _fail(field, v, allowed)
    return v


def _positive_float(d: dict, field: str, where: str = "") -> float:
    v = d[field]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _fail(where + field, v, "a positive finite number")
    return float(v)


def _token_ids(field: str, v: Any) -> None:
    ids = v if isinstance(v, list) else [v]
    if not ids or not all(_is_int(i) and 0 <= i <= INT_MAX for i in ids):
        raise _fail(field, v, "a token id (an integer >= 0), a list of them, or null")


def _rope_scaling(field: str, rs: Any) -> None:
    if not isinstance(rs, dict):
        raise _fail(field, rs, 'an object like {"rope_type": "llama3", "factor": 8.0} or null')
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype is not None and not isinstance(rtype, str):
        raise _fail(f"{field}.rope_type", rtype, "a string such as 'llama3' or 'linear'")
    if rtype in (None, "default"):
        return
    for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
              "attention_factor", "mscale", "mscale_all_dim"):  # fmt: skip
        if rs.get(k) is not None:
            _positive_float(rs, k, f"{field}.")
    if rs.get("original_max_position_embeddings") is not None:
        _size(rs, "original_max_position_embeddings")
    if "truncate" in rs and not isinstance(rs["truncate"], bool):
        raise _fail(f"{field}.truncate", rs["truncate"], "true or false")
    if rtype == "llama3":
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        if high <= low:  # the smoothing between the two divides by (high - low)
            raise _fail(f"{field}.high_freq_factor", high, f"greater than low_freq_factor ({low})")


def _quantization(field: str, q: Any) -> None:
    if not isinstance(q, dict):
        raise _fail(field, q, 'an object like {"group_size": 64, "bits": 4} or null')
    mode = q.get("mode", "affine")
    if not isinstance(mode, str):
        raise _fail(f"{field}.mode", mode, "a string such as 'affine'")
    from mlxrun.quant.formats import from_config  # noqa: PLC0415

    from_config(q)  # bits, group size and mode against what the format allows
    for path, entry in q.items():
        if isinstance(entry, dict):
            m = entry.get("mode", "affine")
            if not isinstance(m, str):
                raise _fail(f"{field}[{path!r}].mode", m, "a string such as 'affine'")
            from_config(entry)


def check_config(d: Any) -> None:
    """Raise MlxrunError, naming the field, its value and what is allowed, for any value of
    config.json that the model uses and that has the wrong type, range or divisibility.

    d: the parsed config.json (GGUF metadata arrives here in the same form). Fields the
    model does not read are not looked at.
    """
    if not isinstance(d, dict):
        raise MlxrunError(
            f"config.json must hold a JSON object, not {type(d).__name__}; re-download it"
        )
    present = {k for k in (*REQUIRED_SIZES, *OPTIONAL_SIZES) if k in d}
    for k in present:
        _size(d, k)
    heads = d.get("num_attention_heads")
    kv = d.get("num_key_value_heads", heads)
    if heads is not None and kv is not None and heads % kv:
        raise _fail("num_key_value_heads", kv, f"a divisor of num_attention_heads ({heads})")
    hd = d.get("head_dim")
    if hd is not None and hd != 0:  # 0 / null: derived from hidden_size
        _size(d, "head_dim", "a positive even integer")
        if hd % 2:
            raise _fail("head_dim", hd, "even (rotary embedding rotates pairs)")
    elif heads is not None and "hidden_size" in d:
        hidden = d["hidden_size"]
        if hidden % heads or (hidden // heads) % 2:
            raise _fail(
                "hidden_size",
                hidden,
                f"a multiple of 2 x num_attention_heads ({2 * heads}) when head_dim is not given",
            )
    if "rms_norm_eps" in d:
        _positive_float(d, "rms_norm_eps")
    if "rope_theta" in d:
        _positive_float(d, "rope_theta")
    rp = d.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, dict):
            raise _fail("rope_parameters", rp, 'an object like {"rope_theta": 10000.0}')
        if "rope_theta" in rp:
            _positive_float(rp, "rope_theta", "rope_parameters.")
        _rope_scaling("rope_parameters", rp)
    if d.get("rope_scaling") is not None:
        _rope_scaling("rope_scaling", d["rope_scaling"])
    if "tie_word_embeddings" in d and not isinstance(d["tie_word_embeddings"], bool):
        raise _fail("tie_word_embeddings", d["tie_word_embeddings"], "true or false")
    for k in ("bos_token_id", "eos_token_id"):
        if d.get(k) is not None:
            _token_ids(k, d[k])
    # ModelConfig reads "quantization", or "quantization_config" only in its absence.
    k = "quantization" if "quantization" in d else "quantization_config"
    if d.get(k) is not None:
        _quantization(k, d[k])
