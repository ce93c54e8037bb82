"""Model configuration: a small frozen dataclass built from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import MlxrunError
from .validate import check_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before rope (Qwen3)
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
        for req in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        ):
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
            if rp.get("rope_type", "default") != "default":
                kw["rope_scaling"] = rp
        rs = kw.get("rope_scaling")
        if rs is not None:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype in (None, "default"):
                kw["rope_scaling"] = None
            elif rtype not in ("llama3", "linear"):
                raise MlxrunError(
                    f"unsupported rope_scaling type {rtype!r}: "
                    "mlxrun supports 'llama3' and 'linear'"
                )
        eos = d.get("eos_token_id")
        kw["eos_token_id"] = (
            tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        )
        if mt == "qwen2":
            kw["attention_bias"] = True
        if mt == "qwen3":
            kw["qk_norm"] = True
        if "quantization" not in kw and "quantization_config" in d:
            kw["quantization"] = d["quantization_config"]
        kw["extra"] = {k: v for k, v in d.items() if k not in names}
        return cls(**kw)

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def rope_freqs(self) -> np.ndarray:
        """Inverse frequencies (head_dim/2,) float32, with llama3/linear scaling applied."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        rs = self.rope_scaling
        if rs is None:
            return inv.astype(np.float32)
        rtype = rs.get("rope_type", rs.get("type"))
        factor = float(rs.get("factor", 1.0))
        if rtype == "linear":
            return (inv / factor).astype(np.float32)
        # llama3: long wavelengths are slowed by `factor`, short ones kept, smooth in between.
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        scaled = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return scaled.astype(np.float32)
