"""The benchmark instrument behind `mlxrun bench`: per backend and weight format, load time,
time to first token, prefill and decode speed, peak memory, and the fraction of the memory
roofline that batch decode reaches.

Decode is memory-bound, so its ceiling is (copy bandwidth) / (bytes read per token). Both
numbers come from this run: the bandwidth from a large device-to-device copy timed here (bytes
read + bytes written), the bytes from the model's actual arrays (every weight once per step,
packed words, scales and biases included; an untied embedding by the rows it gathers; the KV
cache at the mean context length). roofline = decode tok/s x bytes/token / bandwidth.

Models: anything `mlxrun.load` takes, or `shape:NAME`, a real model's shapes with random
weights made on the device (no host copy), for speed runs of models we do not download.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import bench_mlxlm
from .config import ModelConfig
from .errors import MlxrunError
from .generate import generate_step
from .memory import prefill_chunk_for
from .model import Layer, Transformer
from .moe import Experts
from .sampling import SamplingParams

GB = 1e9  # the report's unit for bytes, bandwidth and memory (decimal, as vendors quote)

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

# Bytes per copy-bandwidth trial: well past every cache; smaller on CPUs, whose copies are slow.
COPY_BYTES = {"cpu": 256 << 20, "gpu": 1 << 30}
COPY_TRIALS = 7  # timed, after 2 untimed
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPARE = ("transformers", "mlx-lm")


@dataclass
class BenchRow:
    """One measured configuration. Speeds in tokens/s summed over the batch; bytes in bytes.

    bytes_per_token = (weights read per decode step + KV read at the mean context, all
    sequences) / batch; roofline = decode_tps x bytes_per_token / bandwidth.
    """

    engine: str  # "mlxrun", "transformers" or "mlx-lm"
    backend: str  # mlx | cpu | cuda | mps, or the peer's name (transformers, mlx-lm)
    device: str  # short: "cpu, float32", "cuda (NVIDIA H100), bfloat16"
    quant: str  # as asked: none | int4 | ...
    weights: str  # as run: "float32", "int4 g64", "int4 g32, head int8 g32 (stored)"
    load_s: float
    ttft_ms: float  # median: prefill of the whole batch + first sample
    prefill_tps: float  # batch x prompt_tokens / TTFT
    decode_tps: float  # median over reps: batch x (N-1) / (t_N - t_1)
    decode_tps_min: float
    decode_tps_max: float
    decode_tps_reps: list[float]
    ttft_ms_reps: list[float]
    peak_memory_bytes: int
    weight_bytes: int  # every array the model holds (a tied head once)
    weight_bytes_per_step: int  # what one decode step reads of them
    kv_bytes_per_step: int  # KV cache read per step at the mean context, all sequences
    bytes_per_token: float
    memory: str  # the memory it streams from: "cpu", "cuda" or "apple-gpu"
    bandwidth_Bps: float = 0.0  # that memory's copy bandwidth measured in this run
    roofline: float = 0.0  # fraction (can pass 1 when caches hold part of the weights)
    description: str = ""  # the backend's full describe()
    notes: list[str] = field(default_factory=list)
    sampling: str = "greedy"  # or the sampled setting, e.g. "temp 0.7 top-p 0.9"
    kv_quant: str = "none"  # the KV cache's format (mlxrun/kvquant.py); its bytes as stored


@dataclass
class Skipped:
    backend: str
    quant: str  # "*" when the whole backend could not run
    reason: str


@dataclass
class BenchReport:
    model: str
    source: str
    config: dict  # hidden, layers, heads, ... of the model measured
    settings: dict  # prompt_tokens, gen_tokens, batch, reps, prefill_chunk per backend, dtype
    rows: list[BenchRow]
    skipped: list[Skipped]
    bandwidth: dict[str, dict]  # "torch:cpu" -> {"device", "median_Bps", "trials_Bps", ...}
    environment: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        return e


def build_random(cfg: ModelConfig, be, spec=None, seed: int = 0) -> Transformer:
    """A Transformer of `cfg`'s shapes with random weights made on `be` (QuantSpec `spec`
    packs every matrix whose input divides by its group, embedding and head included)."""
    r = _RandomWeights(be, spec, seed)
    c = cfg
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
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

        def mat(out, inp, role, i=i):
            return r.matrix(out, inp, kind=kind(f"blk.{i}.{role}.weight", inp))

        L = Layer(
            input_layernorm=r.vector(H),
            post_attention_layernorm=r.vector(H),
            q_proj=mat(q_out, H, "attn_q"),
            k_proj=mat(kv_out, H, "attn_k"),
            v_proj=mat(kv_out, H, "attn_v"),
            o_proj=mat(H, q_out, "attn_output"),
            gate_proj=None if moe else mat(I, H, "ffn_gate"),
            up_proj=None if moe else mat(I, H, "ffn_up"),
            down_proj=None if moe else mat(H, I, "ffn_down"),
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
    return Transformer(cfg, be, embed, layers, norm, head)


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
        read += batch * (_read_bytes(model.embed) // model.config.vocab_size)
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


# --- timing --------------------------------------------------------------------------------


def _device_key(be) -> str:
    """Which physical memory a backend streams from; rows on one share one bandwidth."""
    if be.device == "cpu":
        return "cpu"
    if be.device in ("mps",) or (be.name == "mlx" and sys.platform == "darwin"):
        return "apple-gpu"
    return "cuda"  # torch cuda, or mlx-cuda


def measure_bandwidth(be) -> list[float]:
    """Copy bandwidth (bytes read + written per second) of `be`'s device, one per trial.

    torch: dst.copy_(src), timed with CUDA events on CUDA; MLX: y = |x| (reads and writes
    every byte once), timed around mx.eval. Buffers are COPY_BYTES and freed after.
    """
    n = COPY_BYTES["cpu" if be.device == "cpu" else "gpu"]
    out = []
    if be.name == "mlx":
        import mlx.core as mx  # noqa: PLC0415

        x = mx.ones((n // 4,), mx.float32)
        mx.eval(x)
        for i in range(COPY_TRIALS + 2):
            mx.synchronize()
            t0 = time.perf_counter()
            y = mx.abs(x)
            mx.eval(y)
            mx.synchronize()
            dt = time.perf_counter() - t0
            del y
            if i >= 2:
                out.append(2 * n / dt)
        del x
        mx.clear_cache()
        return out
    import torch  # noqa: PLC0415

    src = torch.ones(n // 4, dtype=torch.float32, device=be.device)
    dst = torch.empty_like(src)
    for i in range(COPY_TRIALS + 2):
        if be.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            be.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            be.synchronize()
            dt = time.perf_counter() - t0
        if i >= 2:
            out.append(2 * n / dt)
    del src, dst
    if be.device == "cuda":
        torch.cuda.empty_cache()
    return out


def _run_once(
    model: Transformer, prompts: list[list[int]], gen: int, params: SamplingParams
) -> tuple[float, float]:
    """One generation: (TTFT s, decode steps per s over tokens 2..gen).

    On CUDA the times are device events: generate_step calls be.start() once each token is
    queued (the prefill's, then every step's), and the backend records an event there. The
    host is by then queueing the next step, so host clocks would measure launch, not work.
    Elsewhere each yield follows a device-to-host read of the new token (a synchronisation),
    so host clock times at the yields bound the device's work exactly.
    """
    be = model.be
    be.synchronize()
    if be.name == "torch" and be.device == "cuda":
        import torch  # noqa: PLC0415

        begin = torch.cuda.Event(enable_timing=True)
        be.timeline = marks = [begin]
        begin.record()
        try:
            for _ in generate_step(model, prompts, params, gen):
                pass
        finally:
            be.timeline = None
        torch.cuda.synchronize()
        # marks: begin, first token, then one per decode step (gen - 1 of them)
        ttft = begin.elapsed_time(marks[1]) / 1e3
        return ttft, (len(marks) - 2) / (marks[1].elapsed_time(marks[-1]) / 1e3)
    t0 = time.perf_counter()
    times = []
    for _ in generate_step(model, prompts, params, gen):
        times.append(time.perf_counter())
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0])


def _release(be) -> None:
    """Hand the previous row's memory back so the next row's peak is its own."""
    if be.name == "torch" and be.device == "cuda":
        be.release()  # its graph session holds the previous row's model
    gc.collect()
    if be.name == "mlx":
        import mlx.core as mx  # noqa: PLC0415

        mx.clear_cache()
    elif be.device == "cuda":
        import torch  # noqa: PLC0415

        torch.cuda.empty_cache()


def _short_device(be) -> str:
    if be.name == "torch" and be.device == "cuda":
        import torch  # noqa: PLC0415

        return f"cuda ({torch.cuda.get_device_name()}), {be.dtype}"
    return f"{be.device}, {be.dtype}"


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


@dataclass
class _Run:
    prompt_tokens: int
    gen_tokens: int
    batch: int
    reps: int
    progress: bool
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_quants: list = field(default_factory=lambda: [None])  # KV-cache formats, a row each

    def say(self, msg: str) -> None:
        if self.progress:
            print(f"bench: {msg}", file=sys.stderr, flush=True)

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = np.random.default_rng(0)
        return rng.integers(0, vocab, size=(self.batch, self.prompt_tokens)).tolist()


def _bench_model(
    run: _Run, model: Transformer, params: SamplingParams, peer=None
) -> tuple[dict, dict | None]:
    """Warm up, then time `reps` generations: the BenchRow fields measured on the model.

    `peer(prompt, gen) -> (TTFT s, decode steps/s)` is another engine on the same arrays
    (mlx-lm); its reps alternate with ours, so drifting load on the machine hits both alike.
    Returns (ours, the peer's or None).
    """
    be, cfg = model.be, model.config
    prompts = run.prompts(cfg.vocab_size)
    # Warm-up with the timed shapes: a shorter one leaves cache sizes, allocator blocks and
    # kernel choices of the first timed rep cold (seen on CUDA: TTFT 1.1 s, then 0.18 s).
    _run_once(model, prompts, run.gen_tokens, params)
    if peer is not None:
        peer(prompts[0], run.gen_tokens)
    samples, peer_samples, peak, peer_peak = [], [], 0, 0
    for _ in range(run.reps):
        be.reset_peak_memory()
        samples.append(_run_once(model, prompts, run.gen_tokens, params))
        peak = max(peak, be.peak_memory())
        if peer is not None:
            be.reset_peak_memory()
            peer_samples.append(peer(prompts[0], run.gen_tokens))
            peer_peak = max(peer_peak, be.peak_memory())
    held, per_step = weight_bytes(model, run.batch)
    ctx = mean_context(run.prompt_tokens, run.gen_tokens)
    kv = round(run.batch * kv_read_bytes(cfg, be.dtype, ctx) * kv_ratio(model))
    common = dict(
        weight_bytes=int(held),
        weight_bytes_per_step=int(per_step),
        kv_bytes_per_step=int(kv),
        bytes_per_token=(per_step + kv) / run.batch,
        memory=_device_key(be),
    )
    ours = (
        _timings(run, samples)
        | common
        | dict(peak_memory_bytes=int(peak), description=be.describe())
    )
    if peer is None:
        return ours, None
    return ours, _timings(run, peer_samples) | common | dict(peak_memory_bytes=int(peer_peak))


def _timings(run: _Run, samples: list[tuple[float, float]]) -> dict:
    """(TTFT s, decode steps/s) per rep -> medians, ranges, prefill speed."""
    ttft = [t for t, _ in samples]
    tps = [run.batch * steps for _, steps in samples]
    ttft_med, tps_med = statistics.median(ttft), statistics.median(tps)
    return dict(
        ttft_ms=1e3 * ttft_med,
        prefill_tps=run.batch * run.prompt_tokens / ttft_med,
        decode_tps=tps_med,
        decode_tps_min=min(tps),
        decode_tps_max=max(tps),
        decode_tps_reps=tps,
        ttft_ms_reps=[1e3 * t for t in ttft],
    )


# --- rows ----------------------------------------------------------------------------------


def sampling_label(p: SamplingParams) -> str:
    """The setting as bench prints it: greedy, or the options that differ from the defaults."""
    if p.greedy:
        return "greedy"
    parts = [f"temp {p.temperature:g}"]
    parts += [f"top-p {p.top_p:g}"] if p.top_p < 1 else []
    parts += [f"top-k {p.top_k}"] if p.top_k else []
    parts += [f"min-p {p.min_p:g}"] if p.min_p else []
    parts += [f"rep-pen {p.repetition_penalty:g}"] if p.repetition_penalty != 1 else []
    return " ".join(parts)


def _bench_mlxrun(
    run: _Run, src: _Source, name: str, be, qname: str, spec, dtype, mlx_lm: bool = False
) -> list[BenchRow]:
    """Load (or build) the model on `be` in format `qname`, and measure it: greedy, and
    with the run's sampling setting too where it has one (a row each, same loaded model);
    with `mlx_lm` (MLX backend, batch 1), also mlx-lm's greedy generate on the same arrays,
    reps alternating with ours."""
    from mlxrun.quant.formats import from_config  # noqa: PLC0415

    from .api import load  # noqa: PLC0415

    run.say(f"{be.name}:{be.device} {qname}: loading")
    notes: list[str] = []
    how = ""
    t0 = time.perf_counter()
    if src.shape:
        from .distributed import join  # noqa: PLC0415
        from .shard import check, shard_config  # noqa: PLC0415

        group = join(be)  # under a launcher each rank builds its shard only
        tp = 1 if group is None else group.size
        check(src.config, tp, set() if spec is None else {spec.group_size})
        model = build_random(shard_config(src.config, tp), be, spec)
        be.synchronize()
        load_s = time.perf_counter() - t0
    else:
        stored = src.stored is not None
        # A stored-quantized checkpoint loads as stored; `none` then expands it (below).
        m = load(
            src.model, backend=name, dtype=dtype, quant=None if stored else qname, progress=False
        )
        model, notes = m.transformer, list(m.notes)
        # MLX converts dtypes lazily: finish every weight so load time is all of it.
        t1 = time.perf_counter()
        model.be.eval(*_arrays(model.embed, model.norm, model.head))
        for L in model.layers:
            model.be.eval(*_arrays(*_layer_arrays(L)))
        if stored:
            how = "stored"
            if spec is None:
                how = f"dequantized from stored {_weights_label(model)}"
                model = _dequantized(model)
            elif spec.group_size != from_config(src.stored).group_size:
                notes.append(
                    f"runs the stored group size {from_config(src.stored).group_size}, not "
                    f"{spec.group_size}: re-quantizing stored weights would round them twice"
                )
        model.be.synchronize()
        load_s = m.load_time + time.perf_counter() - t1
        del m
    peer = None
    if mlx_lm:
        t1 = time.perf_counter()
        mlm = bench_mlxlm.mlx_lm_model(model)
        peer_load_s = load_s + time.perf_counter() - t1

        def peer(prompt, gen):
            return bench_mlxlm.run_once(mlm, prompt, gen)

    rows = []
    label = _weights_label(model, how)
    settings = [SamplingParams()] + ([] if run.sampling.greedy else [run.sampling])
    from .kvquant import kv_label  # noqa: PLC0415

    for params, kv in [(p, kv) for p in settings for kv in run.kv_quants]:
        mode = sampling_label(params)
        model.kv_quant = kv
        theirs = peer if params.greedy and kv is None else None  # mlx-lm's row: greedy, plain
        also = " (and mlx-lm, alternating)" if theirs else ""
        what = f"{qname} {mode}" + ("" if kv is None else f" kv-{kv}")
        run.say(f"{be.name}:{be.device} {what}: timing {run.reps} x {run.gen_tokens}{also}")
        fields, peer_fields = _bench_model(run, model, params, theirs)
        rows.append(
            BenchRow(
                engine="mlxrun",
                backend=name,
                device=_short_device(model.be),
                quant=qname,
                weights=label,
                load_s=load_s,
                notes=notes,
                sampling=mode,
                kv_quant=kv_label(kv),
                **fields,
            )
        )
        if peer_fields is not None:
            rows.append(
                BenchRow(
                    engine="mlx-lm",
                    backend="mlx-lm",
                    device=_short_device(model.be),
                    quant=qname,
                    weights=label,
                    load_s=peer_load_s,  # ours, plus building mlx-lm's model on the same arrays
                    description=f"mlx-lm {bench_mlxlm.version()} generate_step on mlxrun's arrays",
                    **peer_fields,
                )
            )
    return rows


def _hf_model(src: _Source, be):
    """The same model in transformers on `be`'s torch device and dtype."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()  # generation-config chatter, not results
    transformers.logging.disable_progress_bar()  # GGUF conversion bars would flood stderr
    dt = getattr(torch, be.dtype)
    if src.shape:
        cfg = transformers.LlamaConfig(**SHAPES[src.model.removeprefix(SHAPE_PREFIX)])
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dt)  # random init straight in the compute dtype
        try:
            with torch.device(be.device):
                return transformers.LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    from .loader import resolve_source  # noqa: PLC0415

    path = resolve_source(src.model)
    auto = transformers.AutoModelForCausalLM
    if path.suffix == ".gguf":  # transformers dequantizes GGUF blocks to `dt`
        return auto.from_pretrained(path.parent, gguf_file=path.name, dtype=dt).to(be.device)
    return auto.from_pretrained(path, dtype=dt).to(be.device)


class _PeerLoadError(Exception):
    """transformers could not build the peer model; the run lists it as skipped."""


class _StreamTimer:
    """transformers streamer that records when each generated token arrives (the first
    put is the prompt). put() receives tokens moved to the host, a synchronisation, so the
    device is idle there: a CUDA event recorded then marks the token's end on the device."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list = []
        self.prompt_seen = False

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch  # noqa: PLC0415

        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.marks.append(self.now())

    def end(self) -> None:
        pass

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _hf_once(hf, x, gen: int) -> tuple[float, float]:
    import torch  # noqa: PLC0415

    timer = _StreamTimer(x.device.type == "cuda")
    t0 = timer.now()
    with torch.no_grad():
        hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=gen,
            min_new_tokens=gen,
            do_sample=False,
            streamer=timer,
            pad_token_id=0,
        )
    if timer.cuda:
        torch.cuda.synchronize()
    t = timer.marks
    return timer.seconds(t0, t[0]), (len(t) - 1) / timer.seconds(t[0], t[-1])


def _bench_hf(run: _Run, src: _Source, be) -> BenchRow:
    """transformers' generate() on the same weights, device and dtype, timed like ours."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415, F401 (imported before the clock: not load time)

    run.say(f"transformers on {be.device}: loading")
    t0 = time.perf_counter()
    try:
        hf = _hf_model(src, be).eval()
    except Exception as e:  # the peer's own failure must not discard the rows measured
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _PeerLoadError(f"transformers could not load it: {type(e).__name__}: {msg}") from e
    be.synchronize()
    load_s = time.perf_counter() - t0
    cfg = src.config
    x = torch.tensor(run.prompts(cfg.vocab_size), device=be.device)
    run.say(f"transformers on {be.device}: timing {run.reps} x {run.gen_tokens} tokens")
    _hf_once(hf, x, run.gen_tokens)
    be.reset_peak_memory()
    samples = [_hf_once(hf, x, run.gen_tokens) for _ in range(run.reps)]
    peak = be.peak_memory()
    emb, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    held = sum(int(p.nbytes) for p in hf.parameters())  # shared (tied) parameters once
    per_step = held
    if emb.data_ptr() != head.data_ptr():  # untied: only the gathered rows are read
        per_step += run.batch * int(emb.nbytes) // emb.shape[0] - int(emb.nbytes)
    ctx = mean_context(run.prompt_tokens, run.gen_tokens)
    kv = round(run.batch * kv_read_bytes(cfg, be.dtype, ctx))
    gguf = not src.shape and src.source.endswith(".gguf")
    del hf
    _release(be)
    return BenchRow(
        engine="transformers",
        backend="transformers",
        device=_short_device(be),
        quant="none",
        weights=be.dtype + (" (from GGUF)" if gguf else ""),
        load_s=load_s,
        peak_memory_bytes=int(peak),
        weight_bytes=held,
        weight_bytes_per_step=per_step,
        kv_bytes_per_step=int(kv),
        bytes_per_token=(per_step + kv) / run.batch,
        memory=_device_key(be),
        description=f"transformers {_version('transformers')} generate(), torch on {be.device}",
        notes=["transformers dequantizes GGUF weights to a dense copy"] if gguf else [],
        **_timings(run, samples),
    )


# --- the run -------------------------------------------------------------------------------


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


def _version(module: str) -> str | None:
    m = sys.modules.get(module)
    return getattr(m, "__version__", None) if m is not None else None


def _check_args(backends, quants, prompt_tokens, gen_tokens, batch, reps, compare, paths):
    if reps < 1:
        raise MlxrunError(f"--reps must be at least 1, got {reps}")
    if gen_tokens < 2:
        raise MlxrunError(f"--gen-tokens must be at least 2 to time decoding, got {gen_tokens}")
    if prompt_tokens < 1:
        raise MlxrunError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    if batch < 1:
        raise MlxrunError(f"--batch must be at least 1, got {batch}")
    if not backends:
        raise MlxrunError("--backends is empty: name at least one of mlx, cpu, cuda, mps")
    if not quants:
        raise MlxrunError("--quant is empty: name at least one format, e.g. none,int4")
    for c in compare:
        if c not in COMPARE:
            raise MlxrunError(f"--compare {c!r} is not supported: use {', '.join(COMPARE)}")
    for p in paths:
        if p is not None and not Path(p).expanduser().resolve().parent.is_dir():
            raise MlxrunError(f"{p}: its directory does not exist; create it first")


def _quant_specs(quants: list[str]) -> dict:
    from mlxrun.quant.formats import resolve  # noqa: PLC0415

    specs = {}
    for q in quants:
        key = q.strip().lower()
        if key == "auto":
            raise MlxrunError("--quant auto is not measurable: list formats, e.g. none,int4,fp8")
        if key in KQUANT_MIXES:
            specs[key] = KQuantMix(key)
            continue
        specs[key] = None if key == "none" else resolve(key)
    return specs


def run_bench(
    model: str,
    backends: list[str],
    quants: list[str],
    *,
    prompt_tokens: int = 512,
    gen_tokens: int = 128,
    batch: int = 1,
    reps: int = 5,
    compare: list[str] | tuple[str, ...] = (),
    json_path: str | os.PathLike | None = None,
    plot_path: str | os.PathLike | None = None,
    dtype: str | None = None,
    progress: bool = True,
    sampling: SamplingParams | None = None,
    kv_quants: list[str | None] | None = None,
) -> BenchReport:
    """Measure `model` on each backend in each weight format; returns the report (and writes
    the JSON / PNG when paths are given).

    model: anything `mlxrun.load` takes, or `shape:llama3-8b` / `shape:llama3-1b` /
    `shape:smollm2` / `shape:tiny` (random weights made on the device). backends: mlx, cpu,
    cuda, mps (auto allowed); those that cannot run here are listed in `report.skipped`.
    quants: none, int4, int8, fp8, fp4, nvfp4; a checkpoint stored quantized (GGUF Q4_1,
    an MLX 4-bit model) runs dequantized to the compute dtype under `none`, as stored under
    its own format (int4 for affine 4-bit, whatever its group size), and skips the others.
    compare: "transformers" adds HF generate() on the first torch device listed; "mlx-lm"
    adds mlx-lm's generate_step beside each mlx row, on the same arrays (batch 1). The
    prompt is batch x prompt_tokens random ids; decoding is greedy for gen_tokens tokens,
    after one untimed warm-up generation. A non-greedy `sampling` adds a row of each
    mlxrun backend and format decoding with it (seeded), beside its greedy row.
    kv_quants: KV-cache formats (None, 'int8', 'fp8'), a row each per backend and format;
    the roofline counts the KV bytes as the format stores them.
    """
    from mlxrun.backends import get_backend, resolve_backend_name  # noqa: PLC0415

    _check_args(
        backends, quants, prompt_tokens, gen_tokens, batch, reps, compare, (json_path, plot_path)
    )
    if plot_path is not None:
        _matplotlib()  # fail before the run, not after it
    names = list(dict.fromkeys(resolve_backend_name(b.strip().lower()) for b in backends))
    specs = _quant_specs(quants)
    src = _open_source(model)
    if "mlx" in names:
        from .kvquant import check_head_dim  # noqa: PLC0415

        for kv in kv_quants or []:
            check_head_dim(kv, src.config.head_dim, "mlx")
    run = _Run(prompt_tokens, gen_tokens, batch, reps, progress, sampling or SamplingParams(),
               list(kv_quants or [None]))  # fmt: skip
    rows: list[BenchRow] = []
    skipped: list[Skipped] = []
    bandwidth: dict[str, dict] = {}
    torch_be = None
    chunks: dict[str, int] = {}
    # mlx-lm runs beside each MLX row, on its arrays; its generate_step takes one sequence.
    peer_mlx = ("mlx",) if "mlx-lm" in compare and batch == 1 else ()
    if "mlx-lm" in compare:
        if batch > 1:
            skipped.append(Skipped("mlx-lm", "*", "mlx-lm's generate_step runs batch 1 only"))
        elif "mlx" not in names:
            skipped.append(
                Skipped("mlx-lm", "*", "it runs on the mlx backend: add mlx to --backends")
            )
        elif (why := bench_mlxlm.unavailable()) is not None:
            skipped.append(Skipped("mlx-lm", "*", why))
            peer_mlx = ()
    for name in names:
        try:
            be = get_backend(name, dtype)
        except MlxrunError as e:
            skipped.append(Skipped(name, "*", str(e)))
            continue
        chunks[name] = prefill_chunk_for(be.name, be.memory_kind, batch)
        if be.name == "torch" and torch_be is None:
            torch_be = be
        key = f"{be.name}:{be.device}"
        if key not in bandwidth:
            run.say(f"{key}: measuring copy bandwidth")
            trials = measure_bandwidth(be)
            bandwidth[key] = dict(
                memory=_device_key(be), median_Bps=statistics.median(trials), trials_Bps=trials
            )
        for qname, spec in specs.items():
            why = _mix_skip(src, be, spec) if isinstance(spec, KQuantMix) else None
            why = why or _stored_skip(src, spec)
            if why is not None:
                skipped.append(Skipped(name, qname, why))
                continue
            try:
                rows += _bench_mlxrun(run, src, name, be, qname, spec, dtype, be.name in peer_mlx)
            except MlxrunError as e:
                skipped.append(Skipped(name, qname, str(e)))
            _release(be)
    if not rows:
        why = "; ".join(f"{s.backend} {s.quant}: {s.reason}" for s in skipped)
        raise MlxrunError(f"nothing could be measured here ({why})")
    if "transformers" in compare:
        if torch_be is None:
            skipped.append(
                Skipped(
                    "transformers",
                    "none",
                    "no torch backend (cpu, cuda, mps) ran; add cpu to --backends",
                )
            )
        elif src.stored is not None and not src.source.endswith(".gguf"):
            skipped.append(
                Skipped(
                    "transformers", "none", "transformers cannot load MLX-quantized checkpoints"
                )
            )
        else:
            try:
                rows.append(_bench_hf(run, src, torch_be))
            except _PeerLoadError as e:
                skipped.append(Skipped("transformers", "none", str(e)))
    _roofline(rows, bandwidth)
    report = BenchReport(
        model=model,
        source=src.source,
        config=_config_summary(src.config),
        settings=dict(
            prompt_tokens=prompt_tokens,
            gen_tokens=gen_tokens,
            batch=batch,
            reps=reps,
            prefill_chunk=chunks,  # per backend: its prefill chunk (tokens)
            dtype=dtype,
            mean_context=mean_context(prompt_tokens, gen_tokens),
            sampling=sampling_label(run.sampling),
        ),
        rows=rows,
        skipped=skipped,
        bandwidth=bandwidth,
        environment=_environment(),
    )
    if json_path is not None:
        write_json(report, json_path)
    if plot_path is not None:
        plot_report(report, plot_path)
    return report


def _mix_skip(src: _Source, be, spec: KQuantMix) -> str | None:
    """Why a K-quant mix cannot run here: it lays out a shape: model's random weights, for
    a backend with the K-quant kernels."""
    if not src.shape:
        return (
            f"{spec.name} lays out the random weights of a shape: model; a .gguf file runs "
            "its own types as stored (--quant none)"
        )
    if "Q4_K" not in be.gguf_blocks:
        return f"{spec.name} runs on the K-quant kernels of --backends cuda"
    return None


def _stored_skip(src: _Source, spec) -> str | None:
    """Why format `spec` cannot run on a checkpoint stored quantized; None where it can:
    `none` (dequantized) and the stored format itself (as stored)."""
    from mlxrun.quant.formats import USER_FORMATS, from_config  # noqa: PLC0415

    if src.stored is None or spec is None:
        return None
    st = from_config(src.stored)
    if (st.mode, st.bits) == (spec.mode, spec.bits):
        return None
    name = next(
        (k for k, v in USER_FORMATS.items() if (v.mode, v.bits) == (st.mode, st.bits)), None
    )
    runs = f"it runs as stored under {name} and " if name else "it runs "
    return (
        f"the checkpoint is stored quantized ({st.mode} {st.bits}-bit g{st.group_size}): {runs}"
        f"dequantized under none; re-quantizing it to {spec.label} would round the weights twice"
    )


def _roofline(rows: list[BenchRow], bandwidth: dict[str, dict]) -> None:
    """Each row's bandwidth: the best copy measured on its memory (frameworks differ: MLX's
    CPU copy runs on one thread, torch's on all), and its roofline fraction."""
    for r in rows:
        r.bandwidth_Bps = max(
            b["median_Bps"] for b in bandwidth.values() if b["memory"] == r.memory
        )
        r.roofline = r.decode_tps * r.bytes_per_token / r.bandwidth_Bps


def _config_summary(c: ModelConfig) -> dict:
    keys = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "quantization",
    )
    return {k: getattr(c, k) for k in keys}


def _environment() -> dict:
    return dict(
        python=platform.python_version(),
        platform=platform.platform(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        numpy=np.__version__,
        torch=_version("torch"),
        mlx=_mlx_version(),
        transformers=_version("transformers"),
    )


def _mlx_version() -> str | None:
    return _version("mlx.core")


# --- output --------------------------------------------------------------------------------


def format_report(report: BenchReport) -> str:
    """One table (a row per backend x format, transformers last) and the skipped list."""
    s = report.settings
    head = (
        f"{report.model} ({report.source}): batch {s['batch']}, {s['prompt_tokens']}-token "
        f"prompt, {s['gen_tokens']} tokens, median of {s['reps']} (GB = 1e9 bytes)"
    )
    sampled = any(r.sampling != "greedy" for r in report.rows)
    cols = [
        "backend",
        "device",
        "quant",
        "weights",
        *(["sampling"] if sampled else []),
        "load s",
        "TTFT ms",
        "prefill tok/s",
        "decode tok/s [min-max]",
        "peak GB",
        "bytes/tok GB",
        "BW GB/s",
        "roofline %",
    ]
    table = [cols]
    for r in report.rows:
        table.append(
            [
                r.backend,
                r.device,
                r.quant + ("" if r.kv_quant == "none" else f" kv-{r.kv_quant}"),
                r.weights,
                *([r.sampling] if sampled else []),
                f"{r.load_s:.2f}",
                f"{r.ttft_ms:.1f}",
                f"{r.prefill_tps:.1f}",
                f"{r.decode_tps:.1f} [{r.decode_tps_min:.1f}-{r.decode_tps_max:.1f}]",
                f"{r.peak_memory_bytes / GB:.3f}",
                f"{r.bytes_per_token / GB:.4f}",
                f"{r.bandwidth_Bps / GB:.1f}",
                f"{100 * r.roofline:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    right = set(range(5 if sampled else 4, len(cols)))
    lines = [head]
    for k, row in enumerate(table):
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    bw = ", ".join(f"{k} {v['median_Bps'] / GB:.1f}" for k, v in report.bandwidth.items())
    lines.append(
        f"copy bandwidth measured (GB/s, read+write): {bw}; each row uses its memory's best"
    )
    if any(r.backend in ("cpu", "transformers") and r.memory == "cpu" for r in report.rows):
        lines.append(
            "peak GB on torch CPU rows is the process's RSS high-water mark (earlier rows included)"
        )
    for r in report.rows:
        for n in r.notes:
            lines.append(f"note ({r.backend} {r.quant}): {n}")
    for sk in report.skipped:
        what = sk.backend if sk.quant == "*" else f"{sk.backend} {sk.quant}"
        lines.append(f"skipped {what}: {sk.reason}")
    return "\n".join(lines)


def _atomic_write(path: str | os.PathLike, write) -> None:
    """Write through a temporary file in the same directory, then rename over `path`."""
    path = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(report: BenchReport, path: str | os.PathLike) -> None:
    """Every number of the report as JSON (atomic)."""
    text = json.dumps(report.to_dict(), indent=2, allow_nan=False)
    _atomic_write(path, lambda f: f.write(text.encode() + b"\n"))


def _matplotlib():
    try:
        import matplotlib  # noqa: PLC0415, F401
    except ImportError:
        raise MlxrunError(
            "--plot needs matplotlib: pip install matplotlib (or mlxrun[plot])"
        ) from None
    from matplotlib.figure import Figure  # noqa: PLC0415 (no pyplot: no GUI backend state)

    return Figure


def plot_report(report: BenchReport, path: str | os.PathLike) -> None:
    """PNG of decode tok/s per row against its roofline: see mlxrun.bench_plot."""
    from .bench_plot import plot_report as draw  # noqa: PLC0415

    draw(report, path)
