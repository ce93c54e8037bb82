"""The models `mlxrun bench` measures, and what a decode step reads of them.

`shape:NAME` models are a real model's shapes (SHAPES) with random weights made on the device
(no host copy), dense or packed in any format (a QuantSpec, or a GGUF K-quant mix); any other
model is a checkpoint the loader opens. Bytes read per token, for the roofline: every weight
once per step (packed words, scales and biases included; the backend's prepared copy where it
made one), an untied embedding by the rows it gathers, the KV cache at the mean context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .errors import MlxrunError
from .model import Layer, Transformer
from .moe import Experts

# Shapes of real models, weights random. Llama-3-8B is DESIGN.md's reference shape.
# fmt: off
SHAPES: dict[str, dict] = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama3.1-8b": dict(  # 128k context through llama3 rope scaling
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "llama3-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama3-1b": dict(  # Llama 3.2 1B
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "smollm2": dict(  # SmolLM2-135M
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "qwen3-30b-a3b": dict(  # Qwen3-30B-A3B: 128 experts, 8 a token (3.3B of 30.5B active)
        model_type="qwen3_moe",
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    # Qwen1.5-MoE-A2.7B (its config.json as published, from memory): 60 experts, 4 a token,
    # and a shared expert of 5632 every token runs (2.7B of 14.3B active)
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe",
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        norm_topk_prob=False, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(  # gpt-oss-20b: 32 experts, 4 a token (3.6B of 20.9B active)
        model_type="gpt_oss",
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        vocab_size=201088, attention_bias=True, sliding_window=128, rms_norm_eps=1e-5,
        rope_theta=150000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
    ),
    "tiny-moe": dict(  # for tests: the qwen3_moe code path at the tiny shape
        model_type="qwen3_moe",
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "tiny": dict(  # for tests: builds and runs in milliseconds; untied to cover both heads
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}
# fmt: on
SHAPE_PREFIX = "shape:"
WEIGHT_STD = 0.02  # random dense weights ~ N(0, 0.02), the usual init


@dataclass(frozen=True)
class KQuantMix:
    """A GGUF K-quant file's layout for the random weights of a `shape:` model (`--quant
    q4_k_m` / `q6_k`): each matrix in the block type llama.cpp's quantizer gives it
    (quant/gguf_encode.kquant_type), read by the CUDA K-quant kernels as stored."""

    name: str
    group_size: int = 256  # a super-block: what a tensor-parallel split keeps whole

    @property
    def label(self) -> str:
        return self.name.upper()


KQUANT_MIXES = ("q4_k_m", "q6_k")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- models --------------------------------------------------------------------------------


def shape_config(name: str) -> ModelConfig:
    """`llama3-8b` (or `shape:llama3-8b`) -> a ModelConfig with that model's shapes."""
    key = name.removeprefix(SHAPE_PREFIX)
    if key not in SHAPES:
        known = ", ".join(SHAPE_PREFIX + k for k in SHAPES)
        raise MlxrunError(f"unknown model shape {name!r}: use one of {known}")
    return ModelConfig.from_dict({"model_type": "llama", **SHAPES[key]})  # llama unless named


def _u8(be, words):
    """uint32 array (..., n) -> its bytes as uint8 (..., 4n), on the device."""
    if be.name == "mlx":
        import mlx.core as mx  # noqa: PLC0415

        return words.view(mx.uint8)
    import torch  # noqa: PLC0415

    return words.view(torch.uint8)


def _finite_e4m3(be, words):
    """Clear bit 6 of every byte: E4M3 codes with exponent < 8, so never the NaN code 0x7F
    (|value| < 2). Random E2M1 nibbles need no such care: all 16 codes are finite."""
    if be.name == "mlx":
        import mlx.core as mx  # noqa: PLC0415

        return words & mx.array(0xBFBFBFBF, dtype=mx.uint32)
    import torch  # noqa: PLC0415

    # torch has no bitwise ops on uint32: work on the same bits as int32.
    return (words.view(torch.int32) & (0xBFBFBFBF - (1 << 32))).view(torch.uint32)


def _wrap_quantized(be, weight, scales, biases, spec, embedding: bool):
    """Device arrays in the canonical format -> the backend's QuantizedWeight, through the
    backend's own `quantized` (so it prepares its kernels, e.g. the Triton repack on CUDA,
    exactly as for a loaded checkpoint)."""
    return be.quantized(
        weight, scales, biases, spec.mode, spec.bits, spec.group_size, embedding=embedding
    )


class _RandomWeights:
    """Makes each tensor of a shape model on the backend, one seed per tensor."""

    def __init__(self, be, spec, seed: int):
        self.be, self.spec, self.seed = be, spec, seed

    def _next(self) -> int:
        self.seed += 1
        return self.seed

    def vector(self, n: int):
        # Norm weights: ones (a (n,) host array is a few KB).
        return self.be.array(np.ones((n,), np.float32))

    def matrix(
        self,
        out: int,
        inp: int,
        embedding: bool = False,
        lead: tuple[int, ...] = (),
        kind: str | None = None,
    ):
        """(out, inp) weight, or a stack (*lead, out, inp) of them (experts): dense
        N(0, WEIGHT_STD), or random packed codes with small scales in the asked format
        (layers whose input does not divide by the group stay dense); under a KQuantMix,
        random blocks of GGUF type `kind` (the mix's type of this one)."""
        be, q = self.be, self.spec
        if isinstance(q, KQuantMix):
            from mlxrun.quant.triton_kquant import random_kquant  # noqa: PLC0415

            return be.kquant(random_kquant(kind, out, inp, be.device, self._next()))
        if q is None or inp % q.group_size:
            return be.random_normal((*lead, out, inp), WEIGHT_STD, self._next())
        groups = inp // q.group_size
        out = (*lead, out)  # a shape prefix from here on
        embedding = embedding or bool(lead)  # experts are gathered by row too
        w = be.random_bits((*out, inp * q.bits // 32), self._next())
        if q.mode == "mxfp8":
            w = _finite_e4m3(be, w)
        if q.mode == "affine":
            # w = s*q + b with q in [0, 2^bits): s ~ 0.01, b = -2^(bits-1) s centres it on 0.
            s = be.random_normal((*out, groups), 0.001, self._next()) + 0.01
            return _wrap_quantized(be, w, s, s * float(-(2 ** (q.bits - 1))), q, embedding)
        # 8-bit scale codes: E8M0 120..123 is 2^-7..2^-4; E4M3 4..11 is 0.0078..0.027.
        words = be.random_bits((*out, -(-groups // 4)), self._next())
        base = 4 if q.mode == "nvfp4" else 120
        s = _u8(be, words)[..., :groups] % (8 if q.mode == "nvfp4" else 4) + base
        return _wrap_quantized(be, w, s, None, q, embedding)

    def experts(self, c: ModelConfig) -> Experts:
        """A MoE layer: a dense router (the loader keeps routers as stored) and stacked
        experts in the asked format; biases where the architecture has them."""
        o, H = c.moe, c.hidden_size
        E, I = o.num_experts, o.intermediate_size
        e = Experts(
            self.be.random_normal((E, H), WEIGHT_STD, self._next()),
            self.matrix(I, H, lead=(E,)),
            self.matrix(I, H, lead=(E,)),
            self.matrix(H, I, lead=(E,)),
        )
        if o.bias:
            e.router_bias = self.be.random_normal((E,), WEIGHT_STD, self._next())
            e.gate_bias, e.up_bias = (self.be.random_normal((E, I), WEIGHT_STD, self._next())
                                      for _ in range(2))  # fmt: skip
            e.down_bias = self.be.random_normal((E, H), WEIGHT_STD, self._next())
        if o.shared_intermediate_size:  # as stored, like the router
            e.shared_gate = self.be.random_normal((1, H), WEIGHT_STD, self._next())
        return e


def build_random(cfg: ModelConfig, be, spec=None, seed: int = 0, vocab=None) -> Transformer:
    """A Transformer of `cfg`'s shapes with random weights made on `be` (QuantSpec `spec`
    packs every matrix whose input divides by its group, embedding and head included);
    `vocab` (shard.VocabShard): only this rank's rows of the embedding and head."""
    r = _RandomWeights(be, spec, seed)
    c = cfg
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size if vocab is None else vocab.rows
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    n, tied = c.num_hidden_layers, c.tie_word_embeddings
    if isinstance(spec, KQuantMix):
        from mlxrun.quant.gguf_encode import kquant_type  # noqa: PLC0415

        def kind(name, cols):
            if cols % 256:  # llama.cpp falls back to Q5_0 / Q8_0 there; not laid out here
                raise MlxrunError(f"{spec.label} needs inputs of whole 256-weight blocks")
            return kquant_type(spec.name, name, n, tied)
    else:

        def kind(name, cols):
            return None

    embed = r.matrix(V, H, True, kind=kind("token_embd.weight", H))  # gathered (tied: head)
    be.eval(*_arrays(embed))
    layers = []
    for i in range(n):
        moe = c.moe is not None and c.moe.is_moe(i)
        # the dense MLP: the layer's, or in a MoE layer its shared expert (Qwen2-MoE)
        width = c.moe.shared_intermediate_size if moe else I
        ffn = "ffn_{}_shexp" if moe else "ffn_{}"

        def mat(out, inp, role, i=i):
            return r.matrix(out, inp, kind=kind(f"blk.{i}.{role}.weight", inp))

        L = Layer(
            input_layernorm=r.vector(H),
            post_attention_layernorm=r.vector(H),
            q_proj=mat(q_out, H, "attn_q"),
            k_proj=mat(kv_out, H, "attn_k"),
            v_proj=mat(kv_out, H, "attn_v"),
            o_proj=mat(H, q_out, "attn_output"),
            gate_proj=mat(width, H, ffn.format("gate")) if width else None,
            up_proj=mat(width, H, ffn.format("up")) if width else None,
            down_proj=mat(H, width, ffn.format("down")) if width else None,
            moe=r.experts(c) if moe else None,
        )
        if c.attention_bias:
            L.q_bias, L.k_bias, L.v_bias = r.vector(q_out), r.vector(kv_out), r.vector(kv_out)
        if c.o_bias:
            L.o_bias = r.vector(H)
        if c.attention_sinks:
            L.sinks = r.vector(c.num_attention_heads)
        be.eval(*_arrays(*_layer_arrays(L)))  # one layer at a time bounds MLX's lazy graph
        layers.append(L)
    head = embed if tied else r.matrix(V, H, kind=kind("output.weight", H))
    norm = r.vector(H)
    be.eval(*_arrays(head, norm))
    return Transformer(cfg, be, embed, layers, norm, head, vocab)


@dataclass
class _Source:
    model: str
    shape: bool
    config: ModelConfig
    source: str
    stored: dict | None  # the checkpoint's quantization block when it is stored quantized


def _open_source(model: str) -> _Source:
    if model.startswith(SHAPE_PREFIX):
        cfg = shape_config(model)
        return _Source(model, True, cfg, f"random weights, {model} shapes", None)
    from .loader import open_checkpoint  # noqa: PLC0415

    ckpt = open_checkpoint(model)
    return _Source(model, False, ckpt.config, ckpt.source, ckpt.config.quantization)


def _format_name(w, dtype: str) -> str:
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    if isinstance(w, QuantizedWeight):
        return f"int{w.bits} g{w.group_size}" if w.mode == "affine" else w.mode
    return dtype


def _weights_label(model: Transformer, how: str = "") -> str:
    """What ran: the layers' format, the head's where it differs (GGUF often keeps the
    embedding in 8 bits), and how the weights got there ("stored", "dequantized ...")."""
    dt = model.be.dtype
    body = _format_name(model.layers[0].q_proj if model.layers else model.head, dt)
    head = _format_name(model.head, dt)
    label = body if head == body else f"{body}, head {head}"
    return f"{label} ({how})" if how else label


def _dequantized(model: Transformer) -> Transformer:
    """The same model with every packed weight expanded to the compute dtype (the tied
    head stays one array)."""
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    be = model.be

    def dense(w):
        return be.dequantize(w) if isinstance(w, QuantizedWeight) else w

    layers = []
    for L in model.layers:
        L = dataclasses.replace(
            L, **{f.name: dense(getattr(L, f.name)) for f in dataclasses.fields(Layer)}
        )
        be.eval(*_arrays(*_layer_arrays(L)))
        layers.append(L)
    embed = dense(model.embed)
    head = embed if model.head is model.embed else dense(model.head)
    be.eval(*_arrays(embed, head))
    return Transformer(model.config, be, embed, layers, model.norm, head)


# --- bytes read per token ------------------------------------------------------------------


def _arrays(*ws) -> list:
    """Weights (dense arrays or QuantizedWeights; None skipped) -> their canonical arrays."""
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    out = []
    for w in ws:
        if isinstance(w, QuantizedWeight):
            out += [a for a in (w.weight, w.scales, w.biases) if a is not None]
        elif w is not None:
            out.append(w)
    return out


def _layer_arrays(L: Layer) -> list:
    """The layer's weights (an Experts' parts included)."""
    out = []
    for f in dataclasses.fields(Layer):
        w = getattr(L, f.name)
        out += list(vars(w).values()) if isinstance(w, Experts) else [w]
    return out


def _canonical_bytes(w) -> int:
    return sum(int(a.nbytes) for a in _arrays(w))


def _kernel_bytes(w) -> int | None:
    """Bytes of a backend's prepared copy of a quantized weight (QuantizedWeight.kernel, e.g.
    the Triton repack, which reports its `nbytes`), None where it made none."""
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    if isinstance(w, QuantizedWeight) and w.kernel is not None:
        return int(w.kernel.nbytes)
    return None


def _read_bytes(w) -> int:
    """Bytes a matmul reads of weight `w`: the prepared copy where there is one."""
    k = _kernel_bytes(w)
    return _canonical_bytes(w) if k is None else k


def _held_bytes(w) -> int:
    return _canonical_bytes(w) + (_kernel_bytes(w) or 0)


def weight_bytes(model: Transformer, batch: int = 1) -> tuple[int, int]:
    """(bytes the weights hold, bytes one decode step of `batch` sequences reads of them).

    A step reads every layer, the final norm and the head in full once, whatever the batch;
    an untied embedding only by the rows it gathers (nbytes / vocab per sequence); a tied
    one is the head, counted once. Quantized weights count packed codes, scales and biases.
    """
    parts = [w for L in model.layers for w in _layer_arrays(L)] + [model.norm, model.head]
    held = sum(_held_bytes(w) for w in parts)
    read = sum(_read_bytes(w) for w in parts)
    o = model.config.moe
    if o is not None:  # a step reads only the experts its tokens picked (mlxrun/moe.py)
        from .moe import experts_read  # noqa: PLC0415

        unread = 1 - experts_read(o, batch) / o.num_experts
        for L in model.layers:
            if L.moe is not None:
                e = L.moe
                stacked = (e.gate, e.up, e.down, e.gate_bias, e.up_bias, e.down_bias)
                read -= round(unread * sum(_read_bytes(w) for w in stacked))
    if model.embed is not model.head:
        held += _held_bytes(model.embed)
        rows = model.config.vocab_size if model.vocab is None else model.vocab.rows
        read += batch * (_read_bytes(model.embed) // rows)
    return held, read


def kv_bytes_per_position(cfg: ModelConfig, dtype: str) -> int:
    """K and V of every layer for one position of one sequence."""
    c = cfg
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * DTYPE_BYTES[dtype]


def kv_read_bytes(cfg: ModelConfig, dtype: str, ctx: float) -> float:
    """K and V one decode step of one sequence reads at context `ctx`: every cached position
    of a full-attention layer, at most the window of a sliding one."""
    per_layer = kv_bytes_per_position(cfg, dtype) / cfg.num_hidden_layers
    return per_layer * sum(
        ctx if w is None else min(ctx, w) for w in map(cfg.window, range(cfg.num_hidden_layers))
    )


def kv_ratio(model: Transformer) -> float:
    """Bytes of the model's KV cache format (scales included) over the compute dtype's."""
    from .kvquant import kv_bytes_per_value  # noqa: PLC0415

    item = DTYPE_BYTES[model.be.dtype]
    per = kv_bytes_per_value(model.kv_quant, model.config.head_dim, item, model.be.name)
    return per / item


def mean_context(prompt_tokens: int, gen_tokens: int) -> float:
    """Mean number of cached positions a timed decode step attends over.

    The timed steps are forwards 2..N (token 1 comes from prefill); forward i feeds token
    i-1 and attends over prompt + i - 1 positions, whose mean over i = 2..N is prompt + N/2.
    """
    return prompt_tokens + gen_tokens / 2
