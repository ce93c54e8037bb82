"""MLX backend: Metal on Apple Silicon, CUDA with mlx-cuda, CPU elsewhere. Its KV cache is
in mlx_cache.py (quantized: mlx_kv.py), its device sampler in mlx_sampling.py."""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from mlxrun.backends.base import QuantizedWeight
from mlxrun.backends.mlx_cache import MLXCache
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


def _finite(logits):
    return mx.isfinite(logits).all(axis=-1)


# isfinite is seven elementwise ops over the whole vocabulary (a compare with each infinity,
# one of x with itself, two ors, a not), each its own kernel and (B, V) output every step;
# compiled they are one kernel before the reduction (mlx-lm's step has no such check).
_finite_fused = mx.compile(_finite, shapeless=True) if mx is not None else None


def _switch(x, w, idx, bias, srt):
    """x @ w[idx]^T for stacked expert weights w (E, out, in), dense or packed."""
    if isinstance(w, QuantizedWeight):
        y = mx.gather_qmm(x, w.weight, w.scales, w.biases, rhs_indices=idx, transpose=True,
                          group_size=w.group_size, bits=w.bits, mode=w.mode,
                          sorted_indices=srt)  # fmt: skip
    else:
        y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=srt)
    return y if bias is None else y + mx.expand_dims(bias[idx], -2)


class MLXBackend:
    name = "mlx"
    gguf_blocks: tuple[str, ...] = ()  # K-quants arrive as exact affine layers instead
    short_queries = True  # its linears are separate products: a q of one row costs one row

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
        cuda = getattr(mx, "cuda", None)
        if self.device == "gpu" and cuda is not None and cuda.is_available():
            # H100, mlx-cuda 0.32.4, 8B int4, 2048-token prompt (benchmarks/mlx_vs_mlxlm.py):
            # prefill 7,743 -> 14,898 tok/s expanding each weight for the pass; decode unchanged
            self.dense_rows = 64

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

    # Passes of at least this many rows (tokens x batch) multiply a packed weight by
    # expanding it to the compute dtype first (mx.dequantize, then a dense matmul), as
    # llama.cpp does for its large batches on CUDA; None: always MLX's quantized matmul.
    # On with mlx-cuda (see __init__), where MLX's quantized GEMM sets the prefill's pace;
    # off on Metal and the CPU, not measured there.
    dense_rows: int | None = None

    def linear(self, x, w, bias=None):
        if (
            isinstance(w, QuantizedWeight)
            and self.dense_rows is not None
            and (x.size // x.shape[-1] >= self.dense_rows and w.weight.ndim == 2)
        ):
            y = x @ self.dequantize(w).T  # the expanded copy lives for this matmul only
        elif isinstance(w, QuantizedWeight):
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
        skip = k.shape[2] - q.shape[2]  # q may be the pass's last rows alone (short_queries)
        k, v = cache.update_and_fetch(layer, self.rope(k, positions, freqs), v)
        return self.rope(q, positions + skip if skip else positions, freqs), k, v

    def attention(self, q, k, v, scale, mask, sinks=None):
        if not isinstance(k, mx.array):  # a quantized cache's packed keys (mlx_kv.MLXQuantKV)
            from .mlx_kv import quantized_attention  # noqa: PLC0415

            return quantized_attention(q, k, v, scale, mask, sinks)
        # sinks (NH,): one more logit per head in the softmax (gpt-oss), fused by MLX
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)

    def silu_mul(self, gate, up):
        return _swiglu_fused(gate, up)

    def silu_gated(self, x, gate, up):
        return self.silu_mul(*self.linears(x, (gate, up)))

    def all_sum(self, x):
        """x summed over the group's ranks (mx.distributed; lazy like every other op)."""
        if self.group is None:
            return x
        return mx.distributed.all_sum(x, group=self.group.handle)

    def all_gather(self, x, width):
        """(..., k) from each rank -> (..., width): rank r's x at [r*k, (r+1)*k), the
        padding past `width` cut (mx.distributed.all_gather stacks on the first axis)."""
        n, k = self.group.size, x.shape[-1]
        y = mx.distributed.all_gather(x[None], group=self.group.handle)  # (n, ..., k)
        y = mx.moveaxis(y, 0, -2).reshape(*x.shape[:-1], n * k)
        return y if width == n * k else y[..., :width]

    def embedding_sum(self, ids, w, start, rows, partial=False):
        """The rows of `ids` from a table split by vocabulary: this rank's rows [start,
        start+rows), zeros for the others' ids, summed over the ranks (one nonzero term a
        token: the sum is exact in any dtype)."""
        local = ids - start
        inside = (local >= 0) & (local < rows)
        e = self.embedding(mx.where(inside, local, 0), w)
        return self.all_sum(mx.where(inside[..., None], e, mx.zeros((), e.dtype)))

    def thread_binder(self):
        return lambda: None  # MLX's default device and stream are not per thread

    def linear_sum(self, x, w, bias=None):
        # mx.distributed sums the products in the model's dtype: on the CPU (float32) that
        # is exact enough; half-precision ranks round each partial once more than one
        # device would.
        y = self.all_sum(self.linear(x, w))
        return y if bias is None else y + bias

    def gated_mlp(self, x, gate, up, act, biases=None):
        if act == "silu" and biases is None:
            return self.silu_gated(x, gate, up)
        g, u = self.linears(x, (gate, up), biases)
        return _ACT[act](g) * u

    def moe_sum(self, x, logits, e, o, shared=None):
        """moe over experts split by their intermediate rows (mlxrun/shard.py), plus the
        scaled shared expert's down product when given, summed over the ranks in the
        model's dtype, as linear_sum's products are."""
        y = self.moe(x, logits, e, o)
        if shared is not None:
            a, down, scale = shared
            y = y + scale * self.linear(a, down)
        return self.all_sum(y)

    def sigmoid(self, x):
        return mx.sigmoid(x)

    def moe(self, x, logits, e, o):
        """x (B, T, H), router logits (B, T, E) -> the routing-weighted sum of each token's
        top-k experts (B, T, H), through mx.gather_mm / mx.gather_qmm as mlx-lm's
        SwitchGLU runs them (token slots sorted by expert when there are many)."""
        shape, k = x.shape, o.top_k
        if logits is None:
            logits = self.linear(x, e.router, e.router_bias)
        lg = logits.reshape(-1, logits.shape[-1])
        if o.routing == "softmax_topk":  # transformers' routers: softmax in float32
            p = mx.softmax(lg.astype(mx.float32), axis=-1)
            ids = mx.argpartition(-p, kth=k - 1, axis=-1)[:, :k]
            w = mx.take_along_axis(p, ids, axis=-1)
            if o.norm_topk:
                w = w / w.sum(axis=-1, keepdims=True)
        else:
            ids = mx.argpartition(-lg, kth=k - 1, axis=-1)[:, :k]
            w = mx.softmax(mx.take_along_axis(lg, ids, axis=-1).astype(mx.float32), axis=-1)
        xe = mx.expand_dims(x.reshape(-1, shape[-1]), (-2, -3))  # (N, 1, 1, H)
        srt = ids.size >= 64
        idx, inv = ids, None
        if srt:  # expert-ordered slots: each expert's rows are read once, in one run
            flat = ids.flatten()
            order = mx.argsort(flat)
            inv = mx.argsort(order)
            xe, idx = xe.flatten(0, -3)[order // k], flat[order]
        g = _switch(xe, e.gate, idx, e.gate_bias, srt)
        u = _switch(xe, e.up, idx, e.up_bias, srt)
        if o.act == "silu":
            h = _swiglu_fused(g, u)
        else:  # gpt-oss: gate clamped from above, up on both sides, and up shifted by one
            g = mx.minimum(g, o.swiglu_limit)
            u = mx.clip(u, -o.swiglu_limit, o.swiglu_limit)
            h = (u + 1) * (g * mx.sigmoid(g * o.swiglu_alpha))
        y = _switch(h, e.down, idx, e.down_bias, srt)  # (N, k, 1, H) or (N*k, 1, H)
        if srt:
            y = y[inv]
        y = y.reshape(*ids.shape, shape[-1])
        return (y * mx.expand_dims(w.astype(y.dtype), -1)).sum(axis=1).reshape(shape)

    def argmax(self, logits):
        return mx.argmax(logits, axis=-1)

    def finite_rows(self, logits):
        return _finite_fused(logits)

    def sampler(self, plan, state):
        """A device sampler (`mlxrun.sampling`) over lazy mlx arrays."""
        from .mlx_sampling import MLXSampler  # noqa: PLC0415

        return MLXSampler(plan, state)

    def decode_step(self, model, cache, batch: int, pads, sampler=None):
        return None  # MLX already overlaps steps through async_eval

    def make_cache(self, num_layers, batch, kv_heads, head_dim, max_len, windows=None, chunk=None,
                   kv_quant=None):  # fmt: skip
        if kv_quant is not None:  # packed by mx.quantize, read by mx.quantized_matmul
            from .mlx_kv import MLXQuantCache  # noqa: PLC0415

            return MLXQuantCache(num_layers, batch, kv_heads, head_dim, self._dt, max_len,
                                 windows, chunk, kv_quant)  # fmt: skip
        return MLXCache(num_layers, batch, kv_heads, head_dim, self._dt, max_len, windows, chunk)

    def make_slot_cache(
        self, num_layers, slots, kv_heads, head_dim, max_len, windows=None, chunk=None,
        kv_quant=None,
    ):  # fmt: skip
        """A cache whose rows hold sequences of their own lengths (the serving engine's)."""
        from .slots import MLXSlotCache  # noqa: PLC0415

        if kv_quant is not None:  # rows packed by mx.quantize, as MLXQuantCache
            from .mlx_kv import MLXQuantSlotCache  # noqa: PLC0415

            return MLXQuantSlotCache(num_layers, slots, kv_heads, head_dim, max_len, self._dt,
                                     windows, chunk, kv_quant)  # fmt: skip

        return MLXSlotCache(
            num_layers, slots, kv_heads, head_dim, max_len, self._dt, windows, chunk
        )

    def slot_decoder(self, model, cache, max_batch: int):
        return None  # the engine's eager steps: MLX builds its graphs lazily anyway

    def spec_passes(self, model, max_len: int, sizes):
        return None  # speculative decoding's passes run as they come: lazily built anyway

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

    def queue(self, *xs) -> None:
        mx.async_eval(*xs)

    def synchronize(self) -> None:
        mx.synchronize()

    def peak_memory(self) -> int:
        return int(mx.get_peak_memory())

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    def eval(self, *xs) -> None:
        mx.eval(*xs)
