"""mlx-lm as a peer in `mlxrun bench --compare mlx-lm`: mlx-lm's own model classes and its
own `generate_step`, run on the very arrays mlxrun loaded (no second copy of the weights),
so the two rows differ only in the code that runs them.

The model is built from mlx-lm's classes for the config's model type, quantized where our
weights are (each layer with its own bits, group size and mode, as GGUF files mix them),
and given our arrays with `load_weights(strict=True)`, which checks every name and shape.
"""

from __future__ import annotations

import importlib
import time

from .errors import MlxrunError
from .model import Transformer

NAME = "mlx-lm"


def _mlx_lm():
    try:
        return importlib.import_module("mlx_lm.generate"), importlib.import_module("mlx_lm.utils")
    except ImportError as e:
        raise MlxrunError(
            f"--compare mlx-lm needs mlx-lm: pip install mlx-lm ({type(e).__name__}: {e})"
        ) from e


def unavailable() -> str | None:
    """Why mlx-lm cannot run here, or None."""
    try:
        _mlx_lm()
    except MlxrunError as e:
        return str(e)
    return None


def version() -> str | None:
    try:
        from importlib.metadata import version as v  # noqa: PLC0415

        return v("mlx-lm")
    except Exception:  # not installed: the caller reports the import error instead
        return None


def _config(model: Transformer) -> dict:
    c = model.config
    d = {
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
    }
    return d


def _weights(model: Transformer) -> dict:
    """Checkpoint names -> our arrays (QuantizedWeight -> its packed parts)."""
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    out: dict = {}

    def put(name, a):
        if a is None:
            return
        if isinstance(a, QuantizedWeight):
            out[f"{name}.weight"], out[f"{name}.scales"] = a.weight, a.scales
            if a.biases is not None:
                out[f"{name}.biases"] = a.biases
        else:
            out[f"{name}.weight"] = a

    put("model.embed_tokens", model.embed)
    put("model.norm", model.norm)
    if model.head is not model.embed:
        put("lm_head", model.head)
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(f"{p}.self_attn.{n}", getattr(L, n))
        for n in ("gate_proj", "up_proj", "down_proj"):
            put(f"{p}.mlp.{n}", getattr(L, n))
        put(f"{p}.input_layernorm", L.input_layernorm)
        put(f"{p}.post_attention_layernorm", L.post_attention_layernorm)
        for n in ("q", "k", "v"):
            b = getattr(L, f"{n}_bias")
            if b is not None:
                out[f"{p}.self_attn.{n}_proj.bias"] = b
        if L.q_norm is not None:
            out[f"{p}.self_attn.q_norm.weight"] = L.q_norm
            out[f"{p}.self_attn.k_norm.weight"] = L.k_norm
    return out


def _formats(model: Transformer) -> dict[str, dict]:
    """Module path -> to_quantized() parameters, for every quantized weight."""
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    fmt = {}
    named = {"model.embed_tokens": model.embed, "lm_head": model.head}
    for i, L in enumerate(model.layers):
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            named[f"model.layers.{i}.self_attn.{n}"] = getattr(L, n)
        for n in ("gate_proj", "up_proj", "down_proj"):
            named[f"model.layers.{i}.mlp.{n}"] = getattr(L, n)
    for path, w in named.items():
        if isinstance(w, QuantizedWeight):
            fmt[path] = {"group_size": w.group_size, "bits": w.bits, "mode": w.mode}
    return fmt


def mlx_lm_model(model: Transformer):
    """mlx-lm's model for `model`'s config, holding `model`'s arrays (MLX backend only)."""
    if model.be.name != "mlx":
        raise MlxrunError("--compare mlx-lm runs on the mlx backend; add mlx to --backends")
    import mlx.nn as nn  # noqa: PLC0415

    _, utils = _mlx_lm()
    cfg = _config(model)
    try:
        cls, args_cls = utils._get_classes(cfg)
    except ValueError as e:
        raise MlxrunError(f"mlx-lm has no model class for {cfg['model_type']!r}: {e}") from e
    # mlx-lm builds its parameters lazily at random; they are replaced before any is computed.
    m = cls(args_cls.from_dict(cfg))
    fmt = _formats(model)
    if fmt:
        nn.quantize(m, class_predicate=lambda path, _: fmt.get(path, False))
    try:
        m.load_weights(list(_weights(model).items()), strict=True)
    except ValueError as e:  # a name or shape mlx-lm's class does not have
        raise MlxrunError(
            f"mlx-lm's {cfg['model_type']} model cannot take these weights: {e}"
        ) from e
    m.eval()
    return m


def run_once(mlm, prompt: list[int], gen: int) -> tuple[float, float]:
    """mlx-lm's own greedy generate_step on one prompt: (TTFT s, decode steps/s over tokens
    2..gen), clocked at each yield, which follows mlx-lm's `.item()` read of the token (a
    synchronisation), as `bench._run_once` clocks ours."""
    import mlx.core as mx  # noqa: PLC0415

    gen_mod, _ = _mlx_lm()
    mx.synchronize()
    t0 = time.perf_counter()
    times = []
    for _ in gen_mod.generate_step(mx.array(prompt), mlm, max_tokens=gen):
        times.append(time.perf_counter())
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0])
