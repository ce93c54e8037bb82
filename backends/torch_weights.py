"""The weight half of the PyTorch backend (TorchWeights, which TorchBackend extends): arrays
onto the device, packed and GGUF K-quant weights (and the Triton repacks the CUDA kernels
read), and the products over them: linear, the joint q/k/v and gate/up products, the gated
MLP with its fused SiLU epilogue, and embedding rows.

Separate from torch_backend.py, which holds the rest of the backend interface (norms, rope,
attention, caches, captured steps, timing; the collectives are torch_parallel.py): how a
weight is held and multiplied is one question, what runs around the products another. The
methods read the backend's `_dt`, `_dev`, `triton_kernels` and `_derived`, which
TorchBackend.__init__ sets."""

from __future__ import annotations

import os
import weakref

import numpy as np

from mlxrun.backends.base import QuantizedWeight
from mlxrun.weights import Tensor

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # reported by get_backend with the extra to install
    torch = None

# MLXRUN_SILU_IN_GEMV=0 runs SiLU-multiply as its own kernel again (for A/B timing)
_SILU_IN_GEMV = os.environ.get("MLXRUN_SILU_IN_GEMV", "1") != "0"
# MLXRUN_BIAS_IN_GEMV=0 adds a quantized linear's bias after its GEMV, one kernel a bias (for
# A/B timing); on, the GEMV's epilogue adds it (q/k/v and o of gpt-oss and Qwen2)
_BIAS_IN_GEMV = os.environ.get("MLXRUN_BIAS_IN_GEMV", "1") != "0"
# MLXRUN_DENSE_GEMV=0 leaves batch-1 bf16/fp16 products to cuBLAS (for A/B timing)
_DENSE_GEMV = os.environ.get("MLXRUN_DENSE_GEMV", "1") != "0"


# transformers' hidden_act names (config.ACTIVATIONS); gelu_new is the tanh approximation
_ACT = {
    "silu": lambda x: F.silu(x),
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": lambda x: F.relu(x),
}


def _rows(t, ids):
    # CUDA has no indexing kernel for uint32: gather the same bits as int32.
    if t.dtype == torch.uint32:
        return t.view(torch.int32)[ids].view(torch.uint32)
    return t[ids]


def _qmatmul(x, kernel, out_dtype=None, bias=None):
    """x @ W^T (+ bias) through the Triton kernel of W's prepared form (QLinear or
    KQLinear); a QLinear's GEMV adds the bias in its epilogue unless MLXRUN_BIAS_IN_GEMV=0."""
    from mlxrun.quant.triton_kquant import KQLinear, kqmatmul  # noqa: PLC0415

    if isinstance(kernel, KQLinear):  # (tensor-parallel ranks hold K-quants as affine)
        y = kqmatmul(x, kernel)
        y = y if out_dtype is None else y.to(out_dtype)
        return y if bias is None else y + bias
    from mlxrun.quant.triton_kernels import qmatmul  # noqa: PLC0415

    if bias is not None and not _BIAS_IN_GEMV:
        return qmatmul(x, kernel, out_dtype=out_dtype) + bias
    return qmatmul(x, kernel, out_dtype=out_dtype, bias=bias)


class TorchWeights:
    """Weights on the device and the products over them (see the module's docstring)."""

    def array(self, t, keep_dtype: bool = False):
        if isinstance(t, Tensor):
            # A memory map (read-only) is copied out once; an array converted at load time
            # (GGUF blocks) is ours already and is shared, not held twice.
            d = t.data
            a = torch.from_numpy(np.ascontiguousarray(d) if d.flags.writeable else np.array(d))
            if t.dtype == "BF16":
                a = a.view(torch.bfloat16)
        elif isinstance(t, torch.Tensor):  # made on the device already (random weights)
            a = t
        else:
            a = torch.from_numpy(np.ascontiguousarray(t))
        if not keep_dtype and a.is_floating_point():
            a = a.to(self._dt)
        return a.to(self._dev)

    def quantized(self, weight, scales, biases, mode, bits, group_size, embedding=False):
        # Scales of the float modes are 8-bit codes; affine scales/biases keep their dtype.
        w = self.array(weight, keep_dtype=True)
        s = self.array(scales, keep_dtype=True)
        b = None if biases is None else self.array(biases, keep_dtype=True)
        if not self.triton_kernels:
            return QuantizedWeight(w, s, b, mode, bits, group_size)
        from mlxrun.quant.triton_kernels import prepare  # noqa: PLC0415

        # The Triton kernels read a load-time repack of the same bytes; the canonical copy
        # is kept only where rows are gathered (the embedding, maybe tied to the head).
        if embedding:  # a tied head gets its repack on first use (_kernel): untied, never
            return QuantizedWeight(w, s, b, mode, bits, group_size)
        kern = prepare(w, s, b, mode, bits, group_size)
        return QuantizedWeight(None, None, None, mode, bits, group_size, kern)

    def kquant(self, kq) -> QuantizedWeight:
        """A GGUF K-quant weight for the Triton kernels: `kq` is a kquant_layout.KQLinear
        already on the device, or GGUF rows (uint8 [out, row bytes]) as a Tensor whose
        `block` names the type."""
        from mlxrun.quant.triton_kquant import KQLinear, prepare_kquant  # noqa: PLC0415

        if not isinstance(kq, KQLinear):
            kq = prepare_kquant(np.asarray(kq.data), kq.block, self._dev)
        return QuantizedWeight(None, None, None, kq.mode, kq.bits, kq.group_size, kq)

    def quantize(self, w, mode, bits, group_size, embedding=False):
        from mlxrun.quant.formats import QuantSpec  # noqa: PLC0415
        from mlxrun.quant.reference import quantize  # noqa: PLC0415 (numpy, only when asked)

        parts = quantize(w.float().cpu().numpy(), QuantSpec(mode, bits, group_size))
        biases = parts.get("biases")
        return self.quantized(
            Tensor.from_numpy(parts["weight"]),
            Tensor.from_numpy(parts["scales"]),
            None if biases is None else Tensor.from_numpy(biases),
            mode,
            bits,
            group_size,
            embedding,
        )

    def dequantize(self, q: QuantizedWeight):
        from mlxrun.quant.torch_dequant import dequantize  # noqa: PLC0415

        return dequantize(q.weight, q.scales, q.biases, q.mode, q.bits, q.group_size, self._dt)

    def linear(self, x, w, bias=None, out_dtype=None):
        """x @ w^T + bias. out_dtype float32: the product's fp32 sums, not rounded to the
        model's dtype first (tensor-parallel partial sums, torch_tp)."""
        if isinstance(w, QuantizedWeight):
            kernel = self._kernel(w)
            if kernel is not None:
                return _qmatmul(x, kernel, out_dtype, bias)
            # No fused kernel on this device: expand a few MB of rows at a time, so even the
            # (often tied) vocabulary head never exists in full precision.
            from mlxrun.quant.torch_linear import packed_linear  # noqa: PLC0415

            dt, xs = (self._dt, x) if out_dtype is None else (out_dtype, x.to(out_dtype))
            y = packed_linear(xs, w.weight, w.scales, w.biases, w.mode, w.bits, w.group_size, dt)
            return y if bias is None else y + bias
        if self._dense_gemv(x, w):
            from .cuda_ops import dense_gemv  # noqa: PLC0415

            y = dense_gemv(x, w, out_dtype=out_dtype)
            return y if bias is None else y + bias
        if out_dtype is None or out_dtype == x.dtype:
            return F.linear(x, w, bias)
        if x.is_cuda:  # cuBLAS sums in fp32 anyway; this keeps its result unrounded
            y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=out_dtype)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        else:
            y = F.linear(x.to(out_dtype), w.to(out_dtype))
        return y if bias is None else y + bias

    def _dense_gemv(self, x, w) -> bool:
        """Whether x @ w^T (w a dense matrix) runs cuda_ops.dense_gemv: a few rows of x (decode)
        on CUDA, in the model's 16-bit dtype."""
        from mlxrun.quant.triton_kernels import GEMV_MAX_M  # noqa: PLC0415

        return (
            _DENSE_GEMV
            and self.triton_kernels
            and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype
            and w.stride(-1) == 1
            and 0 < x.numel() // x.shape[-1] <= GEMV_MAX_M
        )

    def linears(self, x, ws, biases=None):
        biases = biases or (None,) * len(ws)
        fused = self._joint(ws) if self.triton_kernels else None
        if fused is None:
            return [self.linear(x, w, b) for w, b in zip(ws, biases)]
        if isinstance(fused, torch.Tensor):
            sizes = [w.shape[0] for w in ws]
            y = self.linear(x, fused, self._joint_bias(biases, sizes, fused.dtype))
        else:
            sizes = [w.kernel.n for w in ws]
            y = _qmatmul(x, fused, bias=self._joint_bias(biases, sizes, x.dtype))
        return list(y.split(sizes, dim=-1))

    def _joint_bias(self, biases, sizes, dtype):
        """The biases of linears run as one (`_joint`), end to end (zeros for a linear
        without one), made on first use; None when none has a bias. One add, in the GEMV's
        epilogue where it takes one, instead of one kernel a bias."""
        first = next((b for b in biases if b is not None), None)
        if first is None:
            return None

        # memo'd under the first bias, by the whole set: (k, v) alone (a last-row pass) and
        # (q, k, v) may share it where q has none
        made = self._memo(first, dict)
        key = (*(id(b) for b in biases), *sizes, dtype)
        if key not in made:
            parts = [b if b is not None else first.new_zeros(n) for b, n in zip(biases, sizes)]
            made[key] = torch.cat([p.reshape(-1).to(dtype) for p in parts])
        return made[key]

    def _kernel(self, w: QuantizedWeight):
        """The Triton-ready weight of `w`; an embedding used as the head is repacked once,
        on its first use as a matrix."""
        if w.kernel is not None or not self.triton_kernels:
            return w.kernel
        from mlxrun.quant.triton_kernels import prepare  # noqa: PLC0415

        return self._memo(
            w, lambda: prepare(w.weight, w.scales, w.biases, w.mode, w.bits, w.group_size)
        )

    def _memo(self, obj, make):
        """make(), computed once per live `obj` (held weakly: the entry goes with the model)."""
        key = id(obj)
        hit = self._derived.get(key)
        if hit is not None and hit[0]() is obj:
            return hit[1]
        value = make()
        self._derived[key] = (weakref.ref(obj, lambda _, d=self._derived: d.pop(key, None)), value)
        return value

    def _joint(self, ws):
        """One weight for linears of the same input (q, k, v; gate, up), made on first use:
        one launch instead of two or three, and the small k/v products alone cannot keep the
        GPU streaming. The parts become views of it (no second copy)."""
        from mlxrun.quant.triton_kernels import QLinear, concat, join_rows  # noqa: PLC0415
        from mlxrun.quant.triton_kquant import KQLinear  # noqa: PLC0415
        from mlxrun.quant.triton_kquant import concat as kq_concat  # noqa: PLC0415

        def make():
            if all(isinstance(w, QuantizedWeight) and w.kernel is not None for w in ws):
                kernels = [w.kernel for w in ws]
                if all(isinstance(k, QLinear) for k in kernels):
                    return concat(kernels)
                if all(isinstance(k, KQLinear) for k in kernels):
                    return kq_concat(kernels)
                return None
            if all(isinstance(w, torch.Tensor) and w.dtype == ws[0].dtype for w in ws):
                return join_rows(list(ws))
            return None

        return self._memo(ws[0], make)

    def embedding(self, ids, w):
        if isinstance(w, QuantizedWeight) and w.weight is None:  # a K-quant: its rows, expanded
            from mlxrun.quant.triton_kquant import dequantize_kquant, rows  # noqa: PLC0415

            return dequantize_kquant(rows(w.kernel, ids.reshape(-1)), self._dt).reshape(
                *ids.shape, -1
            )
        if isinstance(w, QuantizedWeight):
            # one kernel on CUDA; CPU runs of the CUDA code path keep the torch version (the
            # kernel's test checks the two against each other under the interpreter)
            if self.triton_kernels and ids.is_cuda:
                from .cuda_ops import embed_rows  # noqa: PLC0415

                return embed_rows(ids, w, self._dt)
            from mlxrun.quant.torch_dequant import dequantize  # noqa: PLC0415

            return dequantize(
                _rows(w.weight, ids),
                _rows(w.scales, ids),
                None if w.biases is None else _rows(w.biases, ids),
                w.mode,
                w.bits,
                w.group_size,
                self._dt,
            )
        return F.embedding(ids, w)

    def silu_gated(self, x, gate, up):
        """silu(x @ gate^T) * (x @ up^T). Where the joint gate/up runs a GEMV (batch 1-4:
        quantized weights, or bf16/fp16 on CUDA), each tile holds gate rows and their up rows
        and applies the SiLU-multiply in its epilogue: no launch of its own."""
        joint = self._joint((gate, up)) if self.triton_kernels else None
        if isinstance(joint, torch.Tensor) and _SILU_IN_GEMV and self._dense_gemv(x, joint):
            from .cuda_ops import dense_gemv  # noqa: PLC0415

            return dense_gemv(x, joint, silu=True)
        if joint is not None and not isinstance(joint, torch.Tensor):
            from mlxrun.quant.triton_kernels import QLinear, qmatmul, silu_fusable  # noqa: PLC0415

            if isinstance(joint, QLinear) and silu_fusable(x, joint) and _SILU_IN_GEMV:
                return qmatmul(x, joint, silu=True)
            from mlxrun.quant import triton_kquant as kq  # noqa: PLC0415

            if isinstance(joint, kq.KQLinear) and kq.silu_fusable(x, joint) and _SILU_IN_GEMV:
                return kq.kqmatmul(x, joint, silu=True)
        return self.silu_mul(*self.linears(x, (gate, up)))

    def gated_mlp(self, x, gate, up, act, biases=None):
        """act(x @ gate^T + bg) * (x @ up^T + bu). SiLU without biases takes silu_gated (its
        fused epilogues); other activations run the products, then the torch activation."""
        if act == "silu" and biases is None:
            return self.silu_gated(x, gate, up)
        g, u = self.linears(x, (gate, up), biases)
        return _ACT[act](g) * u
