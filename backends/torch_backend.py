"""PyTorch backend, one implementation for cuda, mps and cpu.

Weights on the device and the products over them (linear, the fused MLP, embedding rows)
are in torch_weights.py, whose TorchWeights this backend extends."""

from __future__ import annotations

import contextlib
import os
import resource
import sys

import numpy as np

from mlxrun.backends.base import ring_capacity
from mlxrun.backends.torch_parallel import TorchParallel
from mlxrun.backends.torch_weights import TorchWeights
from mlxrun.errors import MlxrunError

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # reported by get_backend with the extra to install
    torch = None
if torch is not None:
    from mlxrun.backends.cuda_graph import GraphDecoder
    from mlxrun.backends.slot_graph import RowMask, SlotRows
    from mlxrun.backends.torch_cache import CAUSAL as CAUSAL
    from mlxrun.backends.torch_cache import StaticCache
    from mlxrun.backends.torch_kv import ROPE_FUSED, QuantKV, RopeStep, dequantize, take_rows
    from mlxrun.backends.torch_tp import Partial

_DTYPES = ("float32", "bfloat16", "float16")


def _expandable_segments() -> None:
    """Let the CUDA caching allocator grow segments in place instead of carving fixed ones.

    With fixed segments, a generation at the planned maximum batch (an 8B model, batch 198 x
    2048 tokens on an H100) ran out of memory with memory "reserved but unallocated" (split
    segments) while the tensors fitted; expandable segments ran it at +0.3% of the plan.
    vLLM turns it on by default for the same reason. A setting the user gave is kept.
    """
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" not in conf:
        # newer torch names it per accelerator (2.11 warns that the CUDA name is deprecated)
        setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        setting = setting or torch.cuda.memory._set_allocator_settings
        with contextlib.suppress(RuntimeError):  # a platform without virtual memory management
            setting("expandable_segments:True")


_NOTED: set[str] = set()


def _note_once(msg: str) -> None:
    if msg not in _NOTED:
        _NOTED.add(msg)
        print(f"mlxrun: note: {msg}", file=sys.stderr)


def _sink_attention(q, k, v, scale, mask, sinks):
    """Attention whose softmax has one more logit per head, `sinks` (NH,), joined to every
    query's scores and dropped after (gpt-oss): the weights of the keys sum to less than 1.
    q (B, NH, T, D), k, v (B, NKV, S, D); mask CAUSAL (queries aligned to the last keys),
    bool (B or 1, 1, T, S) with True = may attend, or None. Softmax in float32."""
    B, NH, T, _ = q.shape
    S, rep = k.shape[2], NH // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)).float() * scale  # (B, NH, T, S)
    if isinstance(mask, str):
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, NH, 1, 1).expand(B, NH, T, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return p.to(v.dtype) @ v


class TorchBackend(TorchWeights, TorchParallel):
    name = "torch"
    short_queries = False  # q, k, v run together: one GEMM and one rope_qkv kernel on CUDA

    def __init__(self, device: str = "cpu", dtype: str | None = None, cuda_graphs: bool = True):
        if torch is None:
            raise MlxrunError("the PyTorch backends need torch: pip install 'mlxrun[torch]'")
        if device == "cuda" and not torch.cuda.is_available():
            raise MlxrunError(
                f"--backend cuda: no CUDA GPU is visible to torch "
                f"{torch.__version__}; use --backend cpu or mlx"
            )
        if device == "mps" and not torch.backends.mps.is_available():
            raise MlxrunError(
                "--backend mps: the Metal (MPS) device is not available here "
                "(it needs Apple Silicon and macOS 12.3+); use --backend cpu or mlx"
            )
        if device == "cuda":
            _expandable_segments()
        self.device = device
        self.dtype = dtype or {"cpu": "float32", "cuda": "bfloat16", "mps": "float16"}[device]
        if self.dtype not in _DTYPES:
            raise MlxrunError(f"unknown dtype {self.dtype!r}: use one of {', '.join(_DTYPES)}")
        self._dt = getattr(torch, self.dtype)
        self._dev = torch.device(device)
        self.cuda_graphs = cuda_graphs and device == "cuda"
        self.memory_kind = {"cuda": "cuda", "mps": "apple"}.get(device, "cpu")  # planner's kind
        self.group = None  # mlxrun.distributed.Group when the model is split over processes
        self._all_sum = None  # its all-reduce (torch_tp.AllSum), made on first use
        # Fused Triton kernels (packed-weight matmuls, norms, rope, SiLU): CUDA only in use; a
        # test may turn them on for the CPU under TRITON_INTERPRET to run the CUDA code path.
        self.triton_kernels = device == "cuda"
        # GGUF K-quant linears read as stored by quant/triton_kquant.py (CUDA only)
        self.gguf_blocks = ("Q4_K", "Q5_K", "Q6_K") if self.triton_kernels else ()
        # The last graph-decode session, kept for the next generation of the same shape: a
        # capture costs three decode passes, which would otherwise land in every TTFT.
        self._session: GraphDecoder | None = None
        self._derived: dict = {}  # id(weight) -> (weakref to it, joint or repacked weight)
        self._zero_rows: dict = {}  # shape -> zeros (tensor parallel's first residual)
        self.timeline: list | None = None  # CUDA events of start(), while a bench sets it
        # Speculative decoding's fixed-shape passes (spec_graph.py), kept for the next
        # generation; `spec_rows` runs them where the Triton kernels are off (CPU tests).
        self._spec: list = []
        self.spec_rows = False
        self._copies: list = []  # (tensor, pinned host copy, event) queued by start()

    def describe(self) -> str:
        if self.device == "cuda":
            where = torch.cuda.get_device_name()
        elif self.device == "cpu":
            where = f"cpu, {torch.get_num_threads()} threads"
        else:
            where = "Apple GPU"
        tp = "" if self.group is None else f", {self.group.label}"
        return f"torch {torch.__version__} on {self.device} ({where}), {self.dtype}{tp}"

    def ids(self, ids: np.ndarray):
        return torch.from_numpy(ids.astype(np.int64)).to(self._dev)

    def to_numpy(self, x) -> np.ndarray:
        for i, (t, host, done) in enumerate(self._copies):
            if t is x:  # start() already queued its copy: wait for that alone
                del self._copies[i]
                done.synchronize()
                return host.float().numpy()
        return x.detach().float().cpu().numpy()

    def release(self) -> None:
        """Drop the graph session, which holds its model: a caller about to drop a model and
        load another on this backend frees the first one's memory with it."""
        self._session = None
        self._derived.clear()
        self._zero_rows.clear()

    def add_rms_norm(self, h, y, w, eps):
        """(h + y, rms_norm(h + y)): the residual add and the norm after it. y may be
        linear_sum's Partial: summed over the ranks in the same kernel."""
        if isinstance(h, Partial) and y is None:  # embedding_sum's: the sum onto zeros
            y, h = h, self._zeros(h.y.shape)
        if isinstance(y, Partial):
            from .cuda_allreduce import sum_add_rms_norm  # noqa: PLC0415

            return sum_add_rms_norm(y.y, h, w, eps, self._all_sum.peers(h.shape[-1]))
        if self.triton_kernels:
            from .cuda_ops import add_rms_norm  # noqa: PLC0415

            return add_rms_norm(h, y, w, eps)
        if y is not None:
            h = h + y.to(h.dtype)  # an fp32 y (linear_sum) rounds as one device's product
        return h, self.rms_norm(h, w, eps)

    def rms_norm(self, x, w, eps):
        if isinstance(x, Partial):  # an out-norm before the residual add (Gemma 2/3)
            x = x.total()
        if self.triton_kernels:
            return self.add_rms_norm(x, None, w, eps)[1]
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        # Half precision: normalise in fp32 and round once before the weight, as HF does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return w * x32.to(x.dtype)

    def rope_table(self, inv_freq: np.ndarray):
        return torch.from_numpy(inv_freq.astype(np.float32)).to(self._dev)

    def rope(self, x, positions, table):
        # x (B, H, T, D); positions (B or 1, T). Rotate-half layout, as HF Llama.
        ang = positions.to(torch.float32).unsqueeze(-1) * table  # (B, T, D/2)
        ang = torch.cat([ang, ang], dim=-1).unsqueeze(1)  # (B, 1, T, D)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def rope_and_cache(self, q, k, v, positions, table, cache, layer):
        if self.triton_kernels and isinstance(cache, StaticCache):
            from .cuda_rope import rope_qkv  # noqa: PLC0415

            T = k.shape[2]
            kd, vd, slot = cache.slots(layer, T)  # a quantized cache: stored quantized
            # done by decode_attention's kernel (attention below), for a plain cache: one
            # H100 layer at context 512, batch 1: 6.8 -> 5.7 us (bf16), 7.6 -> 7.7 (int8),
            # 8.0 -> 8.2 (fp8), so a quantized cache keeps the separate launch
            if T == 1 and ROPE_FUSED and not isinstance(kd, QuantKV):
                step = RopeStep(q, k, v, positions, table, kd, vd, slot)
                return step, *cache.fetch(layer, T, stored=True)
            q = rope_qkv(q, k, v, positions, table, kd, vd, slot)
            # one new token: decode_attention reads the codes; a prompt: expanded for SDPA
            return q, *cache.fetch(layer, T, stored=T == 1)
        if self.triton_kernels and isinstance(cache, SlotRows):  # the engine's decode step
            from .cuda_rope import rope_qkv  # noqa: PLC0415

            kd, vd = cache.buffers(layer)
            rows = cache.rows_for(layer)  # a ring layer's dummies: its scratch row
            # Not fused here: the same captured steps run a prompt's last chunk (and
            # speculative decoding's verify, spec_graph.py) as rows of one sequence, where a
            # row reads keys that other rows' programs store in the same launch (a race on
            # a GPU; the interpreter runs programs in order and cannot show it)
            q = rope_qkv(q, k, v, positions, table, kd, vd, cache.pos, rows=rows)
            return q, kd, vd
        k, v = cache.update_and_fetch(layer, self.rope(k, positions, table), v)
        return self.rope(q, positions, table), k, v

    def attention(self, q, k, v, scale, mask, sinks=None):
        rope = q if isinstance(q, RopeStep) else None  # rope_and_cache's work still to do
        q = q if rope is None else rope.q
        causal = isinstance(mask, str)  # CAUSAL
        D = q.shape[-1]
        rows = None
        if isinstance(mask, RowMask):  # k, v: a slot cache's whole buffers; row b reads rows[b]
            mask, rows = mask
        if self.triton_kernels and q.shape[2] == 1 and not causal and D >= 16 and D & (D - 1) == 0:
            from .cuda_attention import decode_attention  # noqa: PLC0415

            return decode_attention(q, k, v, scale, mask, sinks, rows=rows, rope=rope)
        if rope is not None:
            q = rope.run()
        if rows is not None:
            k, v = take_rows(k, rows), take_rows(v, rows)
        k, v = dequantize(k, q.dtype), dequantize(v, q.dtype)  # a quantized cache's QuantKV
        if sinks is not None:  # SDPA has no sink logit: the plain path for these layers
            return _sink_attention(q, k, v, scale, mask, sinks)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal else mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def silu_mul(self, gate, up):
        if self.triton_kernels:
            from .cuda_ops import silu_mul  # noqa: PLC0415

            return silu_mul(gate, up)
        return F.silu(gate) * up

    def sigmoid(self, x):
        return torch.sigmoid(x)

    def moe(self, x, logits, experts, opts):
        """The top-k experts of each token, weighted and summed (backends/torch_moe.py)."""
        from .torch_moe import moe  # noqa: PLC0415

        return moe(x, logits, experts, opts, kernel=self.triton_kernels, linear=self.linear)

    def argmax(self, logits):
        if self.triton_kernels and logits.dim() == 2:
            from .cuda_ops import argmax  # noqa: PLC0415

            return argmax(logits)
        return logits.argmax(-1)

    def finite_rows(self, logits):
        if self.triton_kernels and logits.dim() == 2:
            # the argmax kernel's flags: one launch over ~32 programs a row, where torch's
            # isfinite + all reduces a 128k row in one block (~15 us on an H100)
            from .cuda_ops import argmax  # noqa: PLC0415

            ok = torch.empty(logits.shape[:1], dtype=torch.bool, device=logits.device)
            argmax(logits, ok=ok)
            return ok
        return torch.isfinite(logits).all(-1)

    def make_cache(self, num_layers, batch, kv_heads, head_dim, max_len, windows=None, chunk=None,
                   kv_quant=None):  # fmt: skip
        s = self._session
        if s is not None and not s.busy:
            c = s.cache
            caps = [ring_capacity(w, max_len, chunk) for w in windows or [None] * num_layers]
            shape = (len(c.keys), *c.keys[0].shape[:2], c.keys[0].shape[3], c.max_len, c.kv_quant)
            want = (num_layers, batch, kv_heads, head_dim, max_len, kv_quant)
            if shape == want and c.caps == caps:
                c.reset()
                return c
            self._session = s = c = None  # another shape: free it before allocating the new one
            torch.cuda.empty_cache()
        return StaticCache(
            num_layers, batch, kv_heads, head_dim, max_len, self._dt, self._dev, self.triton_kernels,
            windows, chunk, kv_quant,
        )  # fmt: skip

    def make_slot_cache(
        self, num_layers, slots, kv_heads, head_dim, max_len, windows=None, chunk=None,
        kv_quant=None,
    ):  # fmt: skip
        """A cache whose rows hold sequences of their own lengths (the serving engine's)."""
        from .slots import TorchSlotCache  # noqa: PLC0415

        return TorchSlotCache(
            num_layers, slots, kv_heads, head_dim, max_len, self._dt, self._dev, windows, chunk,
            kv_quant,
        )  # fmt: skip

    def thread_binder(self):
        """A function that gives another thread the calling thread's current CUDA device:
        CUDA's current device is per thread and a new thread starts on GPU 0, while a
        tensor-parallel rank's work belongs on its own GPU."""
        if self.device != "cuda":
            return lambda: None
        index = torch.cuda.current_device()
        return lambda: torch.cuda.set_device(index)

    def slot_decoder(self, model, cache, max_batch: int):
        """The engine's decode steps over `cache`'s rows with fixed shapes (slot_graph.py):
        captured per batch-size bucket on CUDA; run as they are where the Triton kernels are
        on without graphs (a CPU test under the interpreter). None: the engine runs eagerly."""
        if not self.triton_kernels:
            return None
        from .slot_graph import SlotDecoder  # noqa: PLC0415

        return SlotDecoder(model, cache, max_batch, capture=self.cuda_graphs)

    def spec_passes(self, model, max_len: int, sizes):
        """Speculative decoding's passes over n of one sequence's tokens at any offset (n up
        to max(sizes)), over their own batch-1 cache of at least `max_len` positions (its
        `cache`, to prefill): captured per size on CUDA (spec_graph.py), or None to run
        passes eagerly. The caller calls its close() when the generation ends."""
        if not (self.triton_kernels or self.spec_rows) or model.config.rope_dynamic:
            return None  # (dynamic rope: frequencies of each pass's length, as decode_step)
        if self.group is not None:
            return None  # tensor parallel: not tried with collectives in these graphs yet
        from .spec_graph import passes_for  # noqa: PLC0415

        return passes_for(self, model, max_len, sizes)

    def sampler(self, plan, state):
        """A device sampler (`mlxrun.sampling`) for logits on this backend's device."""
        from .torch_sampling import TorchSampler  # noqa: PLC0415

        return TorchSampler(plan, state, self._dev, triton=self.triton_kernels)

    def decode_step(self, model, cache, batch: int, pads, sampler=None):
        """A captured decode step (CUDA), greedy or through `sampler`, or None to run steps
        eagerly. The step samples with the returned decoder's `sampler`, which holds
        `sampler`'s state. The caller calls its close() when the generation ends."""
        if not self.cuda_graphs or model.config.rope_dynamic:
            # dynamic (NTK) rope changes its frequencies every step past the trained context:
            # a captured step would replay the first step's
            return None
        moe = model.config.moe
        if moe is not None and not self.triton_kernels:
            from .torch_moe import GATHER_MAX_SLOTS  # noqa: PLC0415

            if batch * moe.top_k > GATHER_MAX_SLOTS:
                # without the Triton kernels, the grouped expert path reads its per-expert
                # counts on the host, which a captured graph cannot do: steps run eagerly
                _note_once("MoE decode past batch 1-2 runs without a CUDA graph")
                return None
        s = self._session
        plan = None if sampler is None else sampler.plan
        if s is not None and s.cache is cache and s.model is model and not s.busy:
            if s.plan == plan:
                cache.enter_graph(pads)
                if sampler is not None:
                    s.sampler.load_from(sampler)
                s.busy = True
                return s
            self._session = None  # another sampling plan: a new capture over the same cache
        s = GraphDecoder(model, cache, batch, pads, sampler)
        if self._session is None or not self._session.busy:
            self._session = s
        return s

    def random_normal(self, shape, std, seed):
        """Random weights made on the device (speed runs of big shapes need no host copy)."""
        g = torch.Generator(self._dev).manual_seed(seed)
        return (torch.randn(shape, generator=g, device=self._dev) * std).to(self._dt)

    def random_bits(self, shape, seed):
        """Random uint32 words: packed quantized weights of random values."""
        g = torch.Generator(self._dev).manual_seed(seed)
        return torch.randint(
            -(2**31), 2**31 - 1, shape, generator=g, device=self._dev, dtype=torch.int32
        ).view(torch.uint32)

    def wired(self, nbytes: int):
        return contextlib.nullcontext()  # only unified memory on MLX needs wiring

    def start(self, *xs) -> None:
        # CUDA and MPS queue work asynchronously already. While a benchmark keeps a timeline
        # (CUDA), each call marks on the device's stream the point where xs are computed.
        if self.timeline is not None:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            self.timeline.append(mark)
        for x in xs:
            if self.device == "cuda" and x.numel() <= 1 << 16:
                # Queue x's copy to the host now, so that to_numpy(x) waits for x alone: the
                # decode loop queues the next step before it reads this token, and a plain
                # .cpu() queued after that step would wait for it too, leaving the GPU idle
                # until the host launches the one after (H100, 8B int4 bench: 2.46 -> 2.32
                # ms a token).
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                host.copy_(x.detach(), non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                # x kept: its id stays unique; two steps of (token, flag, logprobs)
                self._copies = [*self._copies[-15:], (x, host, done)]

    def queue(self, *xs) -> None:
        pass  # eager: the kernels were queued as the ops ran

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        elif self.device == "mps":
            torch.mps.synchronize()

    def peak_memory(self) -> int:
        if self.device == "cuda":
            return int(torch.cuda.max_memory_allocated())
        if self.device == "mps":
            return int(torch.mps.driver_allocated_memory())
        # CPU: the process's resident high-water mark (bytes on macOS, KiB on Linux).
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)

    def reset_peak_memory(self) -> None:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def eval(self, *xs) -> None:
        pass
