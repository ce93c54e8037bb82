"""The memory plan: whether a model's footprint (mlxrun/model_footprint.py) plus its KV cache
and prefill workspace fit a device's budget (mlxrun/device_memory.py), and what would.

Backend-free at import (numpy and the standard library only). Every number the planner
assumes is a module constant (here, and the device reserves in device_memory.py), so the
README can quote them and measurements can recalibrate them in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig
from .device_memory import DeviceMemory, GiB, MiB, _fmt
from .device_memory import probe_device as probe_device
from .errors import MlxrunError
from .model_footprint import ModelFootprint
from .model_footprint import config_shapes as config_shapes
from .model_footprint import footprint as footprint
from .model_footprint import header_shapes as header_shapes

# --- Prefill workspace: fixed per-backend overhead on top of the activation formula --------
# PyTorch CPU is measured as process RSS (its budget is RAM), so its overhead is what loading
# leaves in the process besides the weights (the tokenizer, modules the loader imports: RSS
# after mlxrun.load - weight bytes = 23.6 MiB for SmolLM2 as stored, from safetensors; 25.2
# MiB with --quant int4) ...
TORCH_CPU_LOAD_RESIDUE = 24 * MiB
# ... + what glibc malloc keeps of freed tensors: its mmap threshold rises to the largest
# block freed (up to 32 MiB), so every smaller tensor comes from the heap, which is trimmed
# only when more than twice that (64 MiB) is free at its top and never below a live block.
# Peak RSS minus weights, load residue, KV cache, one dequantized block and the live tensors
# of the prefill (`_ws_per_seq_eager` of its 256 tokens x batch), SmolLM2 as stored, 256 +
# 32 tokens, two runs: 27-30, 36-39, 67-75, 114-144, 49-81 MiB at batch 4, 8, 16, 32, 64 and
# 52 / -1 MiB at 79 / 82 (from 64 on, every activation is over 32 MiB: mmapped, and returned
# when freed). 40 MiB is charged: the plan also charges the activations of the whole context
# (288 tokens here, 12.5% more) on this backend, even where it knows the prompt, which covers
# the rest at large batches (errors -6.5% to +7.7% at batch 1-82,
# benchmarks/memory_vs_plan.py --budget-gib 2 --prompt-tokens 256 --gen-tokens 32).
TORCH_CPU_HEAP_RETAINED = 40 * MiB
# Calibrate against mx.get_peak_memory / torch.cuda.max_memory_allocated (which does not count
# the CUDA context: probe_device reads free VRAM after the context exists, so it is already
# outside the budget).
WORKSPACE_OVERHEAD = {
    ("mlx", "apple"): 64 * MiB,  # Metal command buffers, compiled kernels, allocator cache
    # MLX on CPU: what a prefill holds besides the batch's share (`_ws_per_seq_run_ahead`)
    # measured 0.0-0.8 MiB (SmolLM2, prompts of 64-256 tokens, batch 1-8) and a decode step
    # ~1 MiB; 8 MiB is kept as the margin it was
    ("mlx", "cpu"): 8 * MiB,
    ("torch", "cuda"): 128 * MiB,  # cuBLAS workspaces and caching-allocator rounding
    ("torch", "apple"): 64 * MiB,
    ("torch", "cpu"): TORCH_CPU_LOAD_RESIDUE + TORCH_CPU_HEAP_RETAINED,
}
SCORES_BYTES = 4  # attention scores are fp32 on the non-flash path
# PyTorch on CUDA never materialises the scores (flash / memory-efficient SDPA): a prefill
# chunk past the first holds its boolean mask and the bf16 bias SDPA makes of it instead.
FUSED_ATTENTION = {("torch", "cuda")}
MASK_BYTES = 3
# PyTorch on CPU runs op by op in the compute dtype (float32 by default), and its SDPA picks
# the flash kernel (torch._fused_sdp_choice is FLASH_ATTENTION for a causal pass, with a
# boolean mask and with GQA): no scores, but the mask of a later chunk becomes a float bias.
# Its workspace is the tensors alive at once in the forward pass (`_ws_per_seq_eager`).
EAGER = {("torch", "cpu")}
# MLX on CPU allocates each op's output when the op is scheduled, on the calling thread, and
# that thread runs ~55 ops ahead of the worker thread that computes them (mlx 0.32.4: a chain
# of N fp32 1024x1024 matmuls, nothing else alive, peaked at N extra outputs for N = 5, 10,
# 20, 50 and at 57 and 56 for N = 100 and 200; evaluated one at a time, at 2). A prefill pass
# therefore holds the outputs of about one and a half layers at once, not one op's working
# set (`_ws_per_seq_run_ahead`).
RUN_AHEAD = {("mlx", "cpu")}
# Tokens per prefill pass. On CUDA a 512-token pass of an 8B model took 37-39 ms (H100, bf16:
# TTFT 36.8 ms at 512 tokens, 154.8 ms at 2048), where its matmuls need ~11 ms at the GPU's
# bf16 rate: launching ~600 kernels from Python set the pace. There a pass takes at least
# 2048 tokens of the batch (one sequence: 2048 of it; 4 or more: 512 each, as elsewhere).
PREFILL_TOKENS = {("torch", "cuda"): 2048}
DEFAULT_PREFILL_CHUNK = 512


def prefill_chunk_for(backend: str, kind: str, batch: int = 1) -> int:
    """Tokens per sequence per prefill pass for `batch` sequences on `backend` ("mlx" or
    "torch") on a `kind` device ("cuda", "apple", "cpu")."""
    return max(DEFAULT_PREFILL_CHUNK, PREFILL_TOKENS.get((backend, kind), 0) // batch)


# PyTorch on CPU/MPS has no packed-weight kernel: each call expands a block of rows of one
# packed matrix (quant/torch_linear.py: 4 MiB of fp32 values; with the uint8 codes and the
# float copy dequantize makes, ~10 bytes per weight expanded), a matrix smaller than a block
# all at once.
DEQUANT_BYTES_PER_WEIGHT = 10
DEQUANT_BLOCK_WEIGHTS = (4 << 20) // 4
DEQUANTIZING = {("torch", "cpu"), ("torch", "apple")}
# Quantizing a matrix at load (`--quant`) on PyTorch CPU goes through numpy
# (quant/reference.py) with float32 temporaries of the whole matrix: re-quantizing SmolLM2's
# 49152 x 576 embedding from its stored 8-bit to int4 g64 as the loader does
# (build.stored_dense from the memory map, be.array, be.quantize) raised peak RSS by 562.6
# MiB, 20.8 bytes per weight: its file pages (33 MiB), the float32 matrix and the
# quantizer's temporaries. The whole `--quant int4` load peaked at 609.2 MiB.
QUANTIZE_BYTES_PER_WEIGHT = 21
LOGITS_BYTES = 4  # logits of the last position only, fp32


def workspace_bytes(
    config: ModelConfig,
    *,
    context: int,
    batch: int,
    prefill_chunk: int,
    dtype_bytes: int,
    backend: str,
    kind: str,
) -> int:
    """Peak activation bytes of prefilling a chunk of C = min(prefill_chunk, context) tokens.

    B*C*(hidden + q + 2*kv) hidden states and q/k/v/o + B*C*intermediate*3 MLP intermediates
    (both x dtype_bytes) + B*heads*C*context fp32 attention scores (non-flash path) + B*vocab
    fp32 logits of the last position + WORKSPACE_OVERHEAD[(backend, kind)]. PyTorch on CUDA
    charges a later chunk's mask for the scores; PyTorch on CPU the tensors an eager pass
    holds at once instead (`_ws_per_seq_eager`), MLX on CPU those its scheduler allocates
    ahead (`_ws_per_seq_run_ahead`).
    """
    per_seq = _ws_per_seq(config, context, prefill_chunk, dtype_bytes, (backend, kind))
    return per_seq * batch + _overhead(backend, kind)


def _overhead(backend: str, kind: str) -> int:
    return WORKSPACE_OVERHEAD.get((backend, kind), 128 * MiB)


def _ws_per_seq(
    c: ModelConfig, context: int, chunk: int, dtype_bytes: int, key: tuple[str, str]
) -> int:
    """Workspace of one sequence for (backend, kind) `key`."""
    if key in EAGER:
        return _ws_per_seq_eager(c, context, chunk, dtype_bytes)
    if key in RUN_AHEAD:
        return _ws_per_seq_run_ahead(c, context, chunk, dtype_bytes)
    fused = key in FUSED_ATTENTION
    C = min(chunk, context)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    act = C * (c.hidden_size + 2 * q + 3 * kv) * dtype_bytes  # h, q, k, v, rotated q and k
    mlp = C * c.intermediate_size * 3 * dtype_bytes
    if fused:  # one chunk is plain causal (no mask); later ones carry a mask
        scores = MASK_BYTES * C * context if context > C else 0
    else:
        scores = c.num_attention_heads * C * context * SCORES_BYTES
    return act + mlp + scores + c.vocab_size * LOGITS_BYTES


def _ws_per_seq_eager(c: ModelConfig, context: int, chunk: int, dtype_bytes: int) -> int:
    """Tensors alive at once in an eager prefill pass of C = min(chunk, context) tokens
    (mlxrun/model.py's loop; every tensor B x C x width x dtype_bytes):

    - MLP: h, x and the previous layer's MLP output y, this layer's o_proj output o and
      rotated q, gate, up, silu(gate) and silu(gate) * up: 4*hidden + q + 4*intermediate;
    - rope of q: h, x, y and the previous o; q, k, v as projected; rotate_half's copy,
      q*cos, rot*sin and their sum: 4*hidden + 5*q + 2*kv.

    The larger of the two, + a later chunk's boolean mask and the float bias SDPA makes of
    it ((1 + dtype_bytes) x C x context), + fp32 logits of the last position.
    """
    C = min(chunk, context)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    mlp = 4 * c.hidden_size + q + 4 * c.intermediate_size
    rope = 4 * c.hidden_size + 5 * q + 2 * kv
    mask = (1 + dtype_bytes) * C * context if context > C else 0
    return C * max(mlp, rope) * dtype_bytes + mask + c.vocab_size * LOGITS_BYTES


def _ws_per_seq_run_ahead(c: ModelConfig, context: int, chunk: int, dtype_bytes: int) -> int:
    """Tensors alive at once in a prefill pass of C = min(chunk, context) tokens on MLX's CPU
    backend, whose scheduling thread allocates ~55 ops ahead of the computation (RUN_AHEAD);
    every row is C x width x dtype_bytes, the scores C x heads x context x SCORES_BYTES:

    - across the MLP into the next layer's attention: gate, up, sigmoid(gate), its product
      with gate and with up (5 x intermediate); down_proj, the residual add and the norm
      after it, h and x (5 x hidden); the next q, k, v and the four temporaries that MLX's
      CPU rope (a composed fallback: both halves times cos and sin) makes of q and of k
      (5 x q + 6 x kv);
    - across the attention (composed on CPU too): q as projected, rotated, scaled, the
      scores @ v output and its transposed copy (5 x q); h, x and o_proj's output
      (3 x hidden); the scores, the masked scores and their softmax (3 x scores).

    The larger of the two, + fp32 logits of the last position. Measured on SmolLM2 in
    float32 (mx.get_peak_memory minus weights and KV cache; batch 1 and 2): 3.2, 7.3, 14.5
    MiB per sequence for prompts of 64, 128, 256 tokens (the MLP side; these give 3.8, 7.3,
    14.4) and 36.4 at 512 (the attention side; 36.2). One layer evaluated op by op peaked
    at 5 MiB per sequence at 256 tokens: the extra is the run-ahead, not tensors mlxrun keeps.
    """
    C = min(chunk, context)
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    mlp = C * (5 * i + 5 * h + 5 * q + 6 * kv) * dtype_bytes
    attn = (
        C * (5 * q + 3 * h) * dtype_bytes + 3 * c.num_attention_heads * C * context * SCORES_BYTES
    )
    return max(mlp, attn) + c.vocab_size * LOGITS_BYTES


@dataclass(frozen=True)
class Plan:
    """Whether `batch` sequences of `context` tokens fit on `device`, and what would."""

    device: DeviceMemory
    footprint: ModelFootprint
    context: int
    batch: int
    prefill_chunk: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int  # batch x context tokens
    workspace_bytes: int
    total_bytes: int
    budget_bytes: int
    fits: bool
    max_batch: int  # largest batch at this context (0: not even one)
    max_context: int  # longest context at this batch, <= max_position_embeddings (0: none)
    advice: str  # "" when it fits, else "try --quant int4 (Z GiB), --context N or ..."
    backend: str = "torch"
    load_bytes: int = 0  # peak of loading the model (`load_peak_bytes`; 0 where not modelled)
    prompt_tokens: int | None = None  # the prefill the workspace is for (None: the context)

    @property
    def peak_bytes(self) -> int:
        """The predicted high-water mark: the generation's total or the load's peak."""
        return max(self.total_bytes, self.load_bytes)

    def __str__(self) -> str:
        return format_plan(self)  # the table `mlxrun plan` prints


def _limits(
    config: ModelConfig,
    weights: int,
    kv_of,
    budget: int,
    *,
    context: int,
    batch: int,
    chunk_of,
    dtype_bytes: int,
    overhead: int,
    key: tuple[str, str],
    prompt: int | None = None,
) -> tuple[int, int]:
    """(max batch at `context`, max context at `batch`) for `weights` bytes of weights;
    chunk_of(b) is the prefill chunk for a batch of b; kv_of(ctx, chunk) the KV bytes of a
    sequence (ModelFootprint.kv_bytes); `prompt`: the prompt's tokens where known (the
    prefill's length; else the whole context)."""

    def need(b: int, ctx: int) -> int:  # grows with both, so bisect
        filled = ctx if prompt is None else min(prompt, ctx)
        ws = _ws_per_seq(config, filled, chunk_of(b), dtype_bytes, key)
        return weights + overhead + b * (kv_of(ctx, 1, chunk_of(b)) + ws)

    def largest(lo: int, hi: int, fits) -> int:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    per_seq = need(1, context) - weights - overhead
    top = max(1, (budget - weights - overhead) // per_seq) * 4 + 4  # chunks only shrink with b
    max_batch = largest(0, top, lambda b: need(b, context) <= budget) if budget > weights else 0
    max_context = largest(0, config.context_length, lambda c: need(batch, c) <= budget)
    return int(max_batch), max_context


def load_peak_bytes(fp: ModelFootprint, backend: str, kind: str, mapped: bool) -> int:
    """Peak RSS of loading the model, where it is modelled (PyTorch CPU; else 0).

    The loader copies each tensor out of the memory-mapped safetensors file (`mapped`), and
    the pages it read stay resident until the map is closed at the end: weights + the stored
    tensors (fp.stored_bytes). Quantizing at load holds ~QUANTIZE_BYTES_PER_WEIGHT per weight
    of the largest matrix (at its turn; taken as the larger of the two, which fits a largest
    matrix loaded first, the embedding). Both + TORCH_CPU_LOAD_RESIDUE. A GGUF import is not
    modelled (its reader's metadata, not the shapes, dominates; pass mapped=False).
    """
    if (backend, kind) not in EAGER:
        return 0
    resident = fp.weight_bytes + (fp.stored_bytes if mapped else 0)
    quantizing = fp.load_quantized * QUANTIZE_BYTES_PER_WEIGHT
    return max(resident, quantizing) + TORCH_CPU_LOAD_RESIDUE


def make_plan(
    config: ModelConfig,
    footprint: ModelFootprint,
    device: DeviceMemory,
    *,
    context: int,
    batch: int = 1,
    prefill_chunk: int | None = None,
    dtype_bytes: int = 2,
    backend: str = "torch",
    mapped: bool = False,
    prompt_tokens: int | None = None,
) -> Plan:
    """Plan `batch` sequences of up to `context` tokens (prompt + generation) on `device`.

    total = weights + KV (kv_bytes_per_token x context x batch) + prefill workspace; it fits
    when total <= device.budget_bytes. The workspace is that of prefilling `prompt_tokens`
    (the longest prompt) where the caller knows it, else the whole context: generated
    tokens are decoded one at a time and never go through a prefill pass. Raises
    MlxrunError for batch < 1, context < 1, a prompt outside 1..context or a context beyond
    config.max_position_embeddings. load_bytes is the peak of loading
    (`load_peak_bytes`; `mapped`: the weights come out of memory-mapped safetensors); it is
    reported (Plan.peak_bytes), not part of `fits`: without --quant the part above the total
    is the file's clean pages, which the kernel can drop under pressure.
    """
    if batch < 1:
        raise MlxrunError(f"--batch-size must be at least 1 (got {batch})")
    fixed_chunk = prefill_chunk
    if prefill_chunk is None:
        prefill_chunk = prefill_chunk_for(backend, device.kind, batch)
    if context < 1 or prefill_chunk < 1:
        raise MlxrunError(
            f"--context and the prefill chunk must be at least 1 (got {context}, {prefill_chunk})"
        )
    if prompt_tokens is not None and not 1 <= prompt_tokens <= context:
        raise MlxrunError(f"the prompt ({prompt_tokens} tokens) must be 1 to --context {context}")
    if (backend, device.kind) in EAGER:
        # PyTorch on CPU keeps the whole context's workspace: TORCH_CPU_HEAP_RETAINED was
        # calibrated with it (the prompt's alone gave +12.1% at batch 32, 256 + 32 tokens)
        prompt_tokens = None
    prompt = context if prompt_tokens is None else prompt_tokens
    if context > config.context_length:
        what = "context (max_position_embeddings x dynamic rope factor)"
        raise MlxrunError(
            f"--context {context} is longer than this model's "
            f"{what if config.rope_dynamic else 'max_position_embeddings'} "
            f"({config.context_length}); use --context {config.context_length} or less"
        )
    fp, budget = footprint, device.budget_bytes
    # Per-call expansion of one block of packed rows, where the backend has no packed kernel.
    expand = (
        min(fp.largest_packed, DEQUANT_BLOCK_WEIGHTS) * DEQUANT_BYTES_PER_WEIGHT
        if (backend, device.kind) in DEQUANTIZING
        else 0
    )
    overhead = _overhead(backend, device.kind) + expand
    kw = dict(
        context=context,
        batch=batch,
        chunk_of=lambda b: fixed_chunk or prefill_chunk_for(backend, device.kind, b),
        dtype_bytes=dtype_bytes,
        overhead=overhead,
        key=(backend, device.kind),
        prompt=prompt_tokens,
    )
    kv = fp.kv_bytes(context, batch, prefill_chunk)
    ws = workspace_bytes(
        config,
        context=prompt,
        batch=batch,
        prefill_chunk=prefill_chunk,
        dtype_bytes=dtype_bytes,
        backend=backend,
        kind=device.kind,
    )
    ws += expand
    total = fp.weight_bytes + kv + ws
    max_batch, max_context = _limits(config, fp.weight_bytes, fp.kv_bytes, budget, **kw)
    advice = ""
    if total > budget:
        opts = []
        if fp.int4_weight_bytes < fp.weight_bytes:
            int4_total = fp.int4_weight_bytes + kv + ws
            _, ctx4 = _limits(config, fp.int4_weight_bytes, fp.kv_bytes, budget, **kw)
            if int4_total <= budget:
                opts.append(f"--quant int4 ({_gib(int4_total)} GiB)")
            elif max_context == 0 and ctx4 > 0:
                opts.append(f"--quant int4 --context {ctx4}")
        if max_context > 0:
            opts.append(f"--context {max_context}")
        if batch > 1 and max_batch > 0:
            opts.append(f"--batch-size {max_batch}")
        if opts:
            advice = "try " + (", ".join(opts[:-1]) + " or " if len(opts) > 1 else "") + opts[-1]
        else:
            advice = (
                f"nothing fits: the weights alone need {_gib(fp.weight_bytes)} GiB "
                f"({_gib(fp.int4_weight_bytes)} GiB as int4); use a device with more "
                "memory"
            )
    return Plan(
        device,
        fp,
        context,
        batch,
        prefill_chunk,
        fp.weight_bytes,
        fp.kv_bytes_per_token,
        kv,
        ws,
        total,
        budget,
        total <= budget,
        max_batch,
        max_context,
        advice,
        backend,
        load_peak_bytes(fp, backend, device.kind, mapped),
        prompt_tokens,
    )


def check_fits(plan: Plan) -> None:
    """Raise MlxrunError, one line with what would fit, when `plan` does not fit."""
    if not plan.fits:
        raise MlxrunError(
            f"needs {_gib(plan.total_bytes)} GiB (weights {_gib(plan.weight_bytes)} + KV "
            f"{_gib(plan.kv_bytes)} + workspace {_gib(plan.workspace_bytes)}) but the device "
            f"budget is {_gib(plan.budget_bytes)} GiB; {plan.advice}"
        )


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def format_plan(plan: Plan) -> str:
    """A readable multi-line table of `plan`, with units and where the device numbers came from."""
    d, fp = plan.device, plan.footprint
    rows = [
        (
            "device",
            f"{d.name} ({d.kind}{', unified memory' if d.unified else ''}, "
            f"{plan.backend}), total {_fmt(d.total_bytes)}",
        ),
        (
            "model",
            f"{fp.n_params / 1e9:.2f} B params, {fp.label}, {fp.bits_per_weight:.2f} bits/weight",
        ),
        ("weights", _fmt(plan.weight_bytes)),
        (
            "KV cache",
            f"{_fmt(plan.kv_bytes)}  ({plan.batch} x {plan.context} tokens x "
            f"{_fmt(plan.kv_bytes_per_token)}/token"
            + (", sliding-window layers hold their window + chunk)" if fp.kv_windows else ")"),
        ),
        (
            "workspace",
            f"{_fmt(plan.workspace_bytes)}  (prefill of "
            f"{plan.prompt_tokens or plan.context} tokens, chunk {plan.prefill_chunk})",
        ),
        ("total", _fmt(plan.total_bytes)),
        *(
            [("loading peak", f"{_fmt(plan.load_bytes)}  (transient, while the weights load)")]
            if plan.load_bytes > plan.total_bytes
            else []
        ),
        ("budget", f"{_fmt(plan.budget_bytes)}  = {d.budget_rule()}"),
        ("fits", "yes" if plan.fits else "NO"),
        ("max batch", f"{plan.max_batch} at context {plan.context}"),
        ("max context", f"{plan.max_context} at batch {plan.batch}"),
    ]
    if plan.advice:
        rows.append(("advice", plan.advice))
    rows += [(f"source: {k}", v) for k, v in d.sources.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
