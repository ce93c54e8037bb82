"""MLX backend: Metal on Apple Silicon, CUDA with mlx-cuda, CPU elsewhere."""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from mlxrun.backends.base import QuantizedWeight, causal_mask_np
from mlxrun.errors import MlxrunError
from mlxrun.weights import Tensor

try:
    import mlx.core as mx
except ImportError:  # reported by get_backend with the extra to install
    mx = None


def _gelu_tanh(x):
    return 0.5 * x * (1 + mx.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# transformers' hidden_act names (config.ACTIVATIONS)
_ACT = {
    "silu": lambda x: x * mx.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1 + mx.erf(x * 0.7071067811865476)),
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "relu": lambda x: mx.maximum(x, 0),
}


def _swiglu(gate, up):
    return gate * mx.sigmoid(gate) * up


# One fused elementwise kernel instead of three (sigmoid, two multiplies): a launch and two
# round trips of the (B, T, intermediate) activations fewer per layer, which mlx-lm also
# saves with its compiled swiglu. shapeless: one compile serves prefill and decode shapes.
_swiglu_fused = mx.compile(_swiglu, shapeless=True) if mx is not None else None


class MLXCache:
    """KV cache, per layer k, v: (B, kv_heads, capacity, D), written at `offset`.

    Generation knows its final length, so the buffers are allocated once at `max_len`: no
    step rounding and no copy-on-grow, which would briefly double the cache (mlx-lm grows
    in steps of 256 because it does not know the length). Past `max_len` it grows in
    steps, for callers that keep decoding.
    """

    step = 256

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, dtype,
                 max_len: int | None = None):  # fmt: skip
        self.offset = 0
        self._shape = (batch, kv_heads, 0, head_dim)
        self._dtype = dtype
        self._first = max_len
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers

    def mask(self, length, pads, window=None):
        if window is None and (pads is None or not pads.any()):
            # sdpa's own causal mode (queries aligned to the last keys, as the cache holds
            # them): no (T, offset+T) mask array to build, copy and read, and the fused
            # kernels that take no mask array stay in play (mlx-lm passes "causal" too).
            return None if length == 1 else "causal"
        m = causal_mask_np(self.offset, length, pads, window)
        return None if m is None else mx.array(m)

    def positions(self, length, pads):
        # mx.fast.rope takes the start offset: an int, or (B,) for left-padded batches.
        if pads is None or not pads.any():
            return self.offset
        return mx.array((self.offset - pads).astype(np.int32))

    def update_and_fetch(self, layer: int, k, v):
        end = self.offset + k.shape[2]
        cur = self.keys[layer]
        if cur is None or end > cur.shape[2]:
            need = end - self.offset
            if cur is None and self._first is not None and self._first >= end:
                grow = self._first
            else:
                grow = ((need + self.step - 1) // self.step) * self.step
            b, h, _, d = self._shape
            new_k = mx.zeros((b, h, grow, d), self._dtype)
            new_v = mx.zeros((b, h, grow, d), self._dtype)
            if cur is not None:
                new_k = mx.concatenate([cur[:, :, : self.offset], new_k], axis=2)
                new_v = mx.concatenate([self.values[layer][:, :, : self.offset], new_v], axis=2)
            self.keys[layer], self.values[layer] = new_k, new_v
        self.keys[layer][:, :, self.offset : end] = k
        self.values[layer][:, :, self.offset : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.offset += n


class MLXBackend:
    name = "mlx"
    gguf_blocks: tuple[str, ...] = ()  # K-quants arrive as exact affine layers instead

    def __init__(self, dtype: str | None = None, device: str | None = None):
        if mx is None:
            raise MlxrunError(
                "the mlx backend needs MLX: pip install 'mlxrun[mlx]' "
                "(mlx on a Mac, mlx[cpu] or mlx-cuda on Linux)"
            )
        if device is not None:
            mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
        self.device = "gpu" if mx.default_device() == mx.gpu else "cpu"
        # bf16 matmuls on MLX's CPU path are far slower than fp32, so CPU defaults to fp32.
        self.dtype = dtype or ("bfloat16" if self.device == "gpu" else "float32")
        self._dt = getattr(mx, self.dtype)
        self.memory_kind = "apple" if self.device == "gpu" else "cpu"  # the planner's kind
        self.group = None  # mlxrun.distributed.Group when the model is split over processes

    def describe(self) -> str:
        info = ""
        if self.device == "gpu":
            try:
                info = f" ({mx.device_info().get('device_name', '')})"
            except Exception:  # device_info is best-effort
                info = ""
        tp = "" if self.group is None else f", {self.group.label}"
        return f"mlx {mx.__version__} on {self.device}{info}, {self.dtype}{tp}"

    def array(self, t, keep_dtype: bool = False):
        if isinstance(t, Tensor):
            a = mx.array(np.ascontiguousarray(t.data))
            if t.dtype == "BF16":
                a = a.view(mx.bfloat16)
        else:
            a = mx.array(t)
        if not keep_dtype and mx.issubdtype(a.dtype, mx.floating):
            a = a.astype(self._dt)
        return a

    def quantized(self, weight, scales, biases, mode, bits, group_size, embedding=False):
        fp_mode = mode != "affine"
        # Scales of the floating-point modes are 8-bit codes (E8M0 / E4M3): keep the bytes.
        return QuantizedWeight(
            self.array(weight, keep_dtype=True),
            self.array(scales, keep_dtype=fp_mode),
            None if biases is None else self.array(biases),
            mode,
            bits,
            group_size,
        )

    def quantize(self, w, mode, bits, group_size, embedding=False):
        parts = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
        wq, scales = parts[0], parts[1]
        biases = parts[2] if len(parts) > 2 else None
        return QuantizedWeight(wq, scales, biases, mode, bits, group_size)

    def dequantize(self, q: QuantizedWeight):
        return mx.dequantize(
            q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits, mode=q.mode
        ).astype(self._dt)

    def ids(self, ids: np.ndarray):
        return mx.array(ids.astype(np.int32))

    def to_numpy(self, x) -> np.ndarray:
        if x.dtype == mx.bfloat16:
            x = x.astype(mx.float32)
        return np.array(x)

    def linear(self, x, w, bias=None):
        if isinstance(w, QuantizedWeight):
            y = mx.quantized_matmul(
                x,
                w.weight,
                w.scales,
                w.biases,
                transpose=True,
                group_size=w.group_size,
                bits=w.bits,
                mode=w.mode,
            )
        else:
            y = x @ w.T
        return y if bias is None else y + bias

    def embedding(self, ids, w):
        if isinstance(w, QuantizedWeight):
            return mx.dequantize(
                w.weight[ids],
                w.scales[ids],
                None if w.biases is None else w.biases[ids],
                group_size=w.group_size,
                bits=w.bits,
                mode=w.mode,
            ).astype(self._dt)
        return w[ids]

    def rms_norm(self, x, w, eps):
        return mx.fast.rms_norm(x, w, eps)

    def linears(self, x, ws, biases=None):
        return [self.linear(x, w, b) for w, b in zip(ws, biases or (None,) * len(ws))]

    def add_rms_norm(self, h, y, w, eps):
        """(h + y, rms_norm(h + y)): the residual add and the norm after it."""
        if y is not None:
            h = h + y
        return h, self.rms_norm(h, w, eps)

    def rope_table(self, inv_freq: np.ndarray):
        # mx.fast.rope takes wavelengths/2pi ("freqs" in MLX's words), not inverse frequencies.
        return mx.array((1.0 / inv_freq.astype(np.float64)).astype(np.float32))

    def rope(self, x, positions, freqs):
        # x (B, H, T, D); positions is the start offset, an int or (B,) array.
        return mx.fast.rope(
            x, x.shape[-1], traditional=False, base=None, scale=1.0, offset=positions, freqs=freqs
        )

    def rope_and_cache(self, q, k, v, positions, freqs, cache, layer):
        k, v = cache.update_and_fetch(layer, self.rope(k, positions, freqs), v)
        return self.rope(q, positions, freqs), k, v

    def attention(self, q, k, v, scale, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def silu_mul(self, gate, up):
        return _swiglu_fused(gate, up)

    def silu_gated(self, x, gate, up):
        return self.silu_mul(*self.linears(x, (gate, up)))

    def all_sum(self, x):
        """x summed over the group's ranks (mx.distributed; lazy like every other op)."""
        if self.group is None:
            return x
        return mx.distributed.all_sum(x, group=self.group.handle)

    def gated_mlp(self, x, gate, up, act, biases=None):
        if act == "silu" and biases is None:
            return self.silu_gated(x, gate, up)
        g, u = self.linears(x, (gate, up), biases)
        return _ACT[act](g) * u

    def argmax(self, logits):
        return mx.argmax(logits, axis=-1)

    def finite_rows(self, logits):
        return mx.isfinite(logits).all(axis=-1)

    def sampler(self, plan, state):
        """A device sampler (`mlxrun.sampling`) over lazy mlx arrays."""
        from .mlx_sampling import MLXSampler  # noqa: PLC0415

        return MLXSampler(plan, state)

    def decode_step(self, model, cache, batch: int, pads, sampler=None):
        return None  # MLX already overlaps steps through async_eval

    def make_cache(self, num_layers, batch, kv_heads, head_dim, max_len):
        return MLXCache(num_layers, batch, kv_heads, head_dim, self._dt, max_len)

    def make_slot_cache(self, num_layers, slots, kv_heads, head_dim, max_len):
        """A cache whose rows hold sequences of their own lengths (the serving engine's)."""
        from .slots import MLXSlotCache  # noqa: PLC0415

        return MLXSlotCache(num_layers, slots, kv_heads, head_dim, max_len, self._dt)

    def random_normal(self, shape, std, seed):
        """Random weights made on the device (speed runs of big shapes need no host copy)."""
        return (mx.random.normal(shape, key=mx.random.key(seed)) * std).astype(self._dt)

    def random_bits(self, shape, seed):
        """Random uint32 words: packed quantized weights of random values."""
        return mx.random.randint(0, 2**31 - 1, shape, dtype=mx.int32, key=mx.random.key(seed)).view(
            mx.uint32
        )

    @contextlib.contextmanager
    def wired(self, nbytes: int):
        """Raise MLX's wired-memory limit to `nbytes` for the duration of a call and restore
        it after, so macOS does not page the weights out mid-generation (Metal only)."""
        if self.device != "gpu" or not mx.metal.is_available():
            yield
            return
        ws = mx.device_info().get("max_recommended_working_set_size", 0)
        if ws and nbytes > 0.9 * ws:
            print(
                f"mlxrun: warning: the model needs {nbytes / 2**30:.1f} GiB, over 90% of "
                f"the GPU working set ({ws / 2**30:.1f} GiB); expect slowdowns",
                file=sys.stderr,
            )
        old = mx.set_wired_limit(min(nbytes, ws) if ws else nbytes)
        try:
            yield
        finally:
            mx.set_wired_limit(old)

    def start(self, *xs) -> None:
        mx.async_eval(*xs)

    def synchronize(self) -> None:
        mx.synchronize()

    def peak_memory(self) -> int:
        return int(mx.get_peak_memory())

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    def eval(self, *xs) -> None:
        mx.eval(*xs)
