"""The memory model: what a device can hold, what a model needs, and the plan between them.

Backend-free at import (numpy and the standard library only); `probe_device` imports torch or
mlx when it is called. Every number the planner assumes is a module constant below, so the
README can quote them and measurements can recalibrate them in one place.

Budget rule (`DeviceMemory.budget_bytes`), quoted by the README:

- CUDA: free VRAM (torch.cuda.mem_get_info, read after the CUDA context exists) minus
  max(512 MiB, 3% of total VRAM) for allocator fragmentation, cuBLAS workspaces and kernels
  loaded later.
- CPU: MemAvailable (Linux /proc/meminfo, clamped to the cgroup limit; free + inactive pages
  on macOS) minus max(1 GiB, 5% of total RAM) for the OS page cache and the Python process.
- Apple unified memory: min(the GPU's recommended working set, physical RAM - memory already
  used by other processes - max(2 GiB, 5% of RAM) kept for macOS). MLX and torch.mps report
  the working set; macOS sets it to about 2/3 of RAM up to 36 GiB and 3/4 above (newer
  macOS versions report more, and `sysctl iogpu.wired_limit_mb` raises it).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ModelConfig
from .errors import MlxrunError
from .weights import read_header

if TYPE_CHECKING:
    from mlxrun.quant.formats import QuantSpec

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# --- Device reserves (see the budget rule in the module docstring) -----------------------
CUDA_RESERVE_MIN = 512 * MiB
CUDA_RESERVE_PERCENT = 3  # of total VRAM
CPU_RESERVE_MIN = 1 * GiB
CPU_RESERVE_PERCENT = 5  # of total RAM
APPLE_OS_RESERVE_MIN = 2 * GiB
APPLE_OS_RESERVE_PERCENT = 5  # of physical RAM
# macOS's default recommendedMaxWorkingSetSize as a fraction of RAM (llama.cpp logs: 32 GB ->
# 21845 MB = 2/3, 64 GB -> 48 GB and 96 GB -> 72 GB = 3/4). Used only when neither MLX nor
# torch.mps reports the value.
APPLE_WS_SMALL_RAM = 36 * GiB
APPLE_WS_SMALL = (2, 3)
APPLE_WS_LARGE = (3, 4)

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

# The quantization that `--quant int4` means (DESIGN.md: INT4 = affine 4-bit, mlx-lm's group)
INT4_GROUP_SIZE = 64

# Compute dtype names accepted -> (canonical name, bytes per element)
DTYPES = {
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2), "BF16": ("bfloat16", 2),
    "float16": ("float16", 2), "fp16": ("float16", 2), "F16": ("float16", 2),
    "float32": ("float32", 4), "fp32": ("float32", 4), "F32": ("float32", 4),
}  # fmt: skip
# Stored size of each safetensors dtype, for tensors counted as they sit on disk.
STORED_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip

# Bytes per weight of GGUF K-quant matrices kept as their blocks (Tensor.block; their
# "dtype" in a shapes map is the block type and their shape the logical [out, in]), as the
# CUDA kernels hold them (quant/triton_kquant.py)
GGUF_HELD = {"Q4_K": 4.625 / 8, "Q5_K": 5.625 / 8, "Q6_K": 6.5625 / 8}

Shapes = dict[str, tuple[tuple[int, ...], str]]


def _reserve(total: int, minimum: int, percent: int) -> int:
    return max(minimum, total * percent // 100)


def estimate_apple_working_set(total_bytes: int) -> int:
    """macOS's default GPU working set for `total_bytes` of RAM (2/3 up to 36 GiB, else 3/4)."""
    num, den = APPLE_WS_SMALL if total_bytes <= APPLE_WS_SMALL_RAM else APPLE_WS_LARGE
    return total_bytes * num // den


@dataclass(frozen=True)
class DeviceMemory:
    """What a device can hold, with where each number came from.

    kind: "apple" (unified, Metal/MPS), "cuda" or "cpu". available_bytes: free VRAM (CUDA),
    MemAvailable (CPU), or RAM not used by other processes (Apple). recommended_working_set
    and wired_limit are Apple-only (None elsewhere).
    """

    kind: str
    name: str
    total_bytes: int
    available_bytes: int
    unified: bool
    recommended_working_set: int | None = None
    wired_limit: int | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def reserve_bytes(self) -> int:
        """What the budget keeps back for the OS/driver (see the module docstring)."""
        if self.kind == "cuda":
            return _reserve(self.total_bytes, CUDA_RESERVE_MIN, CUDA_RESERVE_PERCENT)
        if self.kind == "apple":
            return _reserve(self.total_bytes, APPLE_OS_RESERVE_MIN, APPLE_OS_RESERVE_PERCENT)
        return _reserve(self.total_bytes, CPU_RESERVE_MIN, CPU_RESERVE_PERCENT)

    @property
    def working_set(self) -> int:
        """Apple: the reported working set, or macOS's default rule when none was reported."""
        if self.recommended_working_set is not None:
            return self.recommended_working_set
        return estimate_apple_working_set(self.total_bytes)

    @property
    def budget_bytes(self) -> int:
        """Bytes mlxrun may plan to use.

        CUDA: free VRAM - max(512 MiB, 3% of VRAM). CPU: MemAvailable - max(1 GiB, 5% of
        RAM). Apple: min(recommended working set, RAM not used by other processes -
        max(2 GiB, 5% of RAM)). Never negative.
        """
        free = self.available_bytes - self.reserve_bytes
        if self.kind == "apple":
            free = min(self.working_set, free)
        return max(0, free)

    def budget_rule(self) -> str:
        """The budget rule with this device's numbers, for `format_plan`."""
        avail = "free VRAM" if self.kind == "cuda" else "available"
        rule = f"{avail} {_fmt(self.available_bytes)} - reserve {_fmt(self.reserve_bytes)}"
        if self.kind == "apple":
            return f"min(GPU working set {_fmt(self.working_set)}, {rule})"
        return rule


# --- probing -------------------------------------------------------------------------------


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _host_memory() -> tuple[int, int, dict[str, str]]:
    """(total RAM, available RAM, sources) of this host, without psutil."""
    src: dict[str, str] = {}
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kb = {}
        for line in meminfo.read_text().splitlines():
            k, _, v = line.partition(":")
            kb[k] = int(v.split()[0]) * KiB if v.split() else 0
        total, avail = kb["MemTotal"], kb.get("MemAvailable", kb.get("MemFree", 0))
        src["total_bytes"] = "/proc/meminfo MemTotal"
        src["available_bytes"] = "/proc/meminfo MemAvailable"
        # In a container the cgroup limit, not the host's RAM, is what the OOM killer enforces.
        limit = _read_int("/sys/fs/cgroup/memory.max")
        used = _read_int("/sys/fs/cgroup/memory.current")
        if limit is not None and limit < total:
            total = limit
            avail = min(avail, limit - (used or 0))
            src["total_bytes"] = "/sys/fs/cgroup/memory.max"
            src["available_bytes"] = "/proc/meminfo MemAvailable, cgroup memory.max - current"
        return total, avail, src
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    src["total_bytes"] = "os.sysconf SC_PHYS_PAGES x SC_PAGE_SIZE"
    avail = None
    out = _run(["vm_stat"])
    if out:
        # Same rule as psutil on macOS: free (already excludes speculative) + inactive pages.
        page = int(m.group(1)) if (m := re.search(r"page size of (\d+) bytes", out)) else 4096
        pages = {k.strip(): int(v.strip(" .")) for k, v in re.findall(r"(Pages [^:]+):(.*)", out)}
        if "Pages free" in pages and "Pages inactive" in pages:
            avail = (pages["Pages free"] + pages["Pages inactive"]) * page
            src["available_bytes"] = "vm_stat (Pages free + Pages inactive)"
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        src["available_bytes"] = "os.sysconf SC_AVPHYS_PAGES x SC_PAGE_SIZE"
    return total, avail, src


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return (_run(["sysctl", "-n", "machdep.cpu.brand_string"]) or "").strip() or "CPU"


def _apple_wired_limit(src: dict[str, str]) -> int | None:
    out = _run(["sysctl", "-n", "iogpu.wired_limit_mb"])
    if out and out.strip().isdigit() and int(out) > 0:  # 0 means macOS's default
        src["wired_limit"] = "sysctl iogpu.wired_limit_mb"
        return int(out) * MiB
    return None


def _probe_cpu() -> DeviceMemory:
    total, avail, src = _host_memory()
    return DeviceMemory("cpu", _cpu_name(), total, avail, unified=False, sources=src)


def _probe_apple(backend: str) -> DeviceMemory:
    total, avail, src = _host_memory()
    if backend == "mlx":
        import mlx.core as mx

        info = (getattr(mx, "device_info", None) or mx.metal.device_info)()
        ws = int(info["max_recommended_working_set_size"])
        total = int(info.get("memory_size", total))
        name = str(info.get("device_name") or info.get("architecture") or "Apple GPU")
        src["recommended_working_set"] = "mx.device_info max_recommended_working_set_size"
        src["total_bytes"] = "mx.device_info memory_size"
    else:
        import torch

        ws = int(torch.mps.recommended_max_memory())
        name = (_run(["sysctl", "-n", "machdep.cpu.brand_string"]) or "Apple GPU").strip()
        src["recommended_working_set"] = "torch.mps.recommended_max_memory"
    wired = _apple_wired_limit(src)
    return DeviceMemory("apple", name, total, avail, True, ws, wired, src)


def probe_device(backend: str, device: str) -> DeviceMemory:
    """Measure the memory of `device` as `backend` sees it.

    (backend, device) is ("mlx", "gpu" | "cpu") or ("torch", "cuda[:N]" | "mps" | "cpu").
    Raises MlxrunError when that device is not present.
    """
    if backend == "mlx" and device == "gpu":
        import mlx.core as mx

        if mx.metal.is_available():
            return _probe_apple("mlx")
        if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            info = mx.device_info(mx.gpu)  # NVML's device-wide free memory when available
            src = {"total_bytes": "mx.device_info total_memory",
                   "available_bytes": "mx.device_info free_memory"}  # fmt: skip
            name, total = str(info["device_name"]), int(info["total_memory"])
            return DeviceMemory("cuda", name, total, int(info["free_memory"]), False, sources=src)
        raise MlxrunError("MLX has no GPU on this machine (no Metal, no CUDA); use --device cpu")
    if backend in ("mlx", "torch") and device == "cpu":
        return _probe_cpu()
    if backend == "torch" and device == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise MlxrunError(
                "torch has no MPS device here (needs Apple Silicon macOS); use --device cpu"
            )
        return _probe_apple("torch")
    if backend == "torch" and (device == "cuda" or device.startswith("cuda:")):
        import torch

        if not torch.cuda.is_available():
            raise MlxrunError(
                "torch sees no CUDA GPU (CPU-only torch build, or no driver); use --device cpu"
            )
        idx = int(device.partition(":")[2] or torch.cuda.current_device())
        if idx >= torch.cuda.device_count():
            raise MlxrunError(
                f"no GPU {device}: this machine has {torch.cuda.device_count()}; use cuda:0"
            )
        free, total = torch.cuda.mem_get_info(idx)
        src = {
            "total_bytes": "torch.cuda.mem_get_info",
            "available_bytes": "torch.cuda.mem_get_info (free, after CUDA context init)",
        }
        return DeviceMemory(
            "cuda", torch.cuda.get_device_name(idx), total, free, False, sources=src
        )
    raise MlxrunError(
        f"unknown device {device!r} for backend {backend!r}: use mlx with gpu/cpu "
        "or torch with cuda/mps/cpu"
    )


# --- model footprint -----------------------------------------------------------------------


def header_shapes(path: str | os.PathLike) -> Shapes:
    """{tensor name: (shape, safetensors dtype)} of a safetensors file or checkpoint directory.

    Reads headers only (sharded checkpoints through model.safetensors.index.json).
    """
    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise MlxrunError(f"{path} holds no .safetensors files; is it a model directory?")
    elif path.exists():
        files = [path]
    else:
        raise MlxrunError(f"{path} does not exist")
    out: Shapes = {}
    for f in files:
        _, header = read_header(f)
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (tuple(info["shape"]), info["dtype"])
    return out


def config_shapes(config: ModelConfig, dtype: str = "BF16") -> Shapes:
    """The Hugging Face tensor names and shapes a checkpoint of `config` holds (no file)."""
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    out: Shapes = {"model.embed_tokens.weight": ((c.vocab_size, h), dtype)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        moe = c.moe is not None and c.moe.is_moe(i)
        mlp = [
            ("mlp.gate_proj.weight", (c.intermediate_size, h)),
            ("mlp.up_proj.weight", (c.intermediate_size, h)),
            ("mlp.down_proj.weight", (h, c.intermediate_size)),
        ]
        for n, shape in [
            ("self_attn.q_proj.weight", (q, h)),
            ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)),
            ("self_attn.o_proj.weight", (h, q)),
            *([] if moe else mlp),
            ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,)),
        ]:
            out[p + n] = (shape, dtype)
        if moe:  # every expert is held: the planner counts them all
            from .moe import layer_shapes  # noqa: PLC0415

            out.update(layer_shapes(c, p, dtype))
        if c.attention_bias:
            for n, width in (("q", q), ("k", kv), ("v", kv)):
                out[f"{p}self_attn.{n}_proj.bias"] = ((width,), dtype)
        if c.o_bias:
            out[f"{p}self_attn.o_proj.bias"] = ((h,), dtype)
        if c.mlp_bias:
            for n, width in (("gate", c.intermediate_size), ("up", c.intermediate_size)):
                out[f"{p}mlp.{n}_proj.bias"] = ((width,), dtype)
            out[f"{p}mlp.down_proj.bias"] = ((h,), dtype)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = ((d,), dtype)
            out[p + "self_attn.k_norm.weight"] = ((d,), dtype)
    out["model.norm.weight"] = ((h,), dtype)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ((c.vocab_size, h), dtype)
    return out


def packed_bytes(
    out_dim: int, in_dim: int, mode: str, bits: int, group_size: int, dtype_bytes: int
) -> int:
    """Bytes of one quantized [out, in] matrix in the canonical (mlx) format.

    weight uint32 [out, in*bits/32]; scales [out, in/group] (affine: `dtype_bytes` each,
    mxfp4/mxfp8/nvfp4: 1 byte); biases like scales, affine only.
    """
    assert in_dim % group_size == 0 and in_dim * bits % 32 == 0, (in_dim, group_size, bits)
    groups = out_dim * (in_dim // group_size)
    if mode == "affine":
        return out_dim * (in_dim * bits // 32) * 4 + 2 * groups * dtype_bytes
    return out_dim * (in_dim * bits // 32) * 4 + groups


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _layer_bits(config: ModelConfig, prefix: str) -> int:
    """Bits of quantized layer `prefix`, from config.json's quantization (per-layer first)."""
    q = config.quantization
    if not q:
        raise MlxrunError(
            f"checkpoint has quantized tensors ({prefix}.scales) but config.json "
            "has no 'quantization' entry; re-download config.json"
        )
    from mlxrun.quant.formats import layer_spec  # noqa: PLC0415

    # per-layer entries as the loader reads them (null: the mode's default)
    spec = layer_spec(q, prefix)
    return 4 if spec is None else spec.bits


def _keeps_stored(
    config: ModelConfig, prefix: str, quant: QuantSpec | None, group_asked: bool
) -> bool:
    """Whether the loader keeps stored quantized layer `prefix` as it is (build._Builder)."""
    if quant is None:
        return True
    from mlxrun.quant.formats import layer_spec  # noqa: PLC0415

    have = layer_spec(config.quantization or {}, prefix)
    if have is None or (have.mode, have.bits) != (quant.mode, quant.bits):
        return False
    return have == quant or not group_asked


def _requant_spec(config: ModelConfig, quant: QuantSpec | None, group_asked: bool):
    """The format a stored layer is re-quantized to (build.target_spec)."""
    from mlxrun.build import target_spec  # noqa: PLC0415

    return target_spec(quant, config.quantization, group_asked)


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes a model needs, from config.json and checkpoint headers alone.

    weight_bytes: the weights as they will sit in memory (after quantization).
    kv_bytes_per_token: one token of one sequence's KV cache (layers x 2 x kv_heads x
    head_dim x dtype size) while no layer's window is full. dense_weight_bytes /
    int4_weight_bytes: the same weights unquantized at the compute dtype, and quantized to
    `--quant int4` (affine 4-bit, group 64). kv_windows: each layer's attention window (or
    None), from config.layer_windows; empty when no layer slides.
    """

    weight_bytes: int
    kv_bytes_per_token: int
    n_params: int
    dense_weight_bytes: int
    int4_weight_bytes: int
    dtype: str
    label: str  # how the weights are stored, e.g. "bfloat16" or "affine 4-bit g64"
    largest_packed: int = 0  # weights of the largest matrix held packed (0: none)
    stored_bytes: int = 0  # the tensors the loader reads, as stored (tied head once)
    load_quantized: int = 0  # weights of the largest matrix quantized at load (0: none)
    kv_windows: tuple[int | None, ...] = ()

    def kv_bytes(self, tokens: int, batch: int = 1, chunk: int | None = None) -> int:
        """KV-cache bytes for `batch` sequences of `tokens` tokens; with `chunk` (the most
        tokens a pass brings), a sliding-window layer holds window + chunk - 1 of them, as
        the caches do (backends.base.ring_capacity)."""
        if not self.kv_windows or chunk is None:
            return self.kv_bytes_per_token * tokens * batch
        from mlxrun.backends.base import ring_capacity  # noqa: PLC0415

        per_layer = self.kv_bytes_per_token // len(self.kv_windows)
        held = sum(ring_capacity(w, tokens, chunk) for w in self.kv_windows)
        return per_layer * held * batch

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes / self.n_params


def footprint(
    config: ModelConfig,
    tensor_shapes: Shapes,
    dtype: str = "bfloat16",
    quant: QuantSpec | None = None,
    backend: str = "torch",
    group_asked: bool = False,
) -> ModelFootprint:
    """Weight and KV bytes of a model: `tensor_shapes` from `header_shapes` or `config_shapes`.

    A checkpoint that is already quantized (`p.scales` present) counts its quantized tensors
    as stored (on MLX, float scales and biases at the compute dtype, as its quantized matmul
    wants them); `quant` for an unquantized checkpoint packs every 2-D `.weight` whose in-dim
    divides by the group size (embedding and lm_head too, as mlx-lm does). Other tensors count
    at the compute `dtype`. A tied lm_head stored in the file is not counted twice.

    `quant` on a quantized checkpoint follows the loader (mlxrun/build.py): a stored layer
    already in quant's mode and bits (and its group size, when `group_asked`) is kept as
    stored; the others are re-quantized, in the checkpoint's group size unless one was asked.
    """
    if dtype not in DTYPES:
        raise MlxrunError(f"unknown dtype {dtype!r}: use bfloat16, float16 or float32")
    dtype, db = DTYPES[dtype]
    shapes = dict(tensor_shapes)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # the loader drops it and uses the embedding
    quantized = {n[: -len(".scales")] for n in shapes if n.endswith(".scales")}
    kept = {p for p in quantized if _keeps_stored(config, p, quant, group_asked)}
    weight = dense = int4 = n_params = largest = stored = requant = 0
    for name, (shape, sdt) in shapes.items():
        if sdt in GGUF_HELD:  # kept as stored whatever is asked (a re-quantization is
            n = _numel(shape)  # one layer at a time, no larger than its dense copy)
            stored += int(n * GGUF_HELD[sdt])
            weight += int(n * GGUF_HELD[sdt])
            n_params += n
            dense += n * db
            int4 += packed_bytes(*shape, "affine", 4, INT4_GROUP_SIZE, db)
            largest = max(largest, n)
            continue
        stored += _numel(shape) * STORED_BYTES.get(sdt, db)
        if config.moe is not None and name.endswith(("_blocks", "_scales")):
            # OpenAI's MXFP4 experts (gpt-oss): held as stored, two values a block byte
            weight += _numel(shape)
            if name.endswith("_blocks"):
                n_params += 2 * _numel(shape)
                dense += 2 * _numel(shape) * db
            int4 += _numel(shape)
            continue
        prefix, _, leaf = name.rpartition(".")
        is_q = prefix in quantized and leaf in ("weight", "scales", "biases")
        if is_q:
            if prefix in kept:  # kept as stored; else re-quantized below
                cast = backend == "mlx" and leaf != "weight" and sdt in ("F16", "BF16", "F32")
                weight += _numel(shape) * (db if cast else STORED_BYTES[sdt])
            if leaf != "weight":
                continue
            # uint32 [..., out, in*bits/32] -> the logical [..., out, in]
            shape = (*shape[:-1], shape[-1] * 32 // _layer_bits(config, prefix))
        n = _numel(shape)
        n_params += n
        dense += n * db
        # a matrix, or a stack of them (MoE experts (E, out, in)); a MoE router stays as
        # stored (build._Builder.stored_or_dense)
        router = config.moe is not None and prefix.endswith((".gate", ".router"))
        matrix = leaf == "weight" and len(shape) in (2, 3) and not router
        stack = _numel(shape[:-2]) if matrix else 1
        int4 += (
            stack * packed_bytes(*shape[-2:], "affine", 4, INT4_GROUP_SIZE, db)
            if matrix and shape[-1] % INT4_GROUP_SIZE == 0
            else n * db
        )
        if is_q and prefix in kept:
            largest = max(largest, n)
            continue
        # a stored layer is re-quantized in the checkpoint's group size when none was asked
        q = _requant_spec(config, quant, group_asked) if is_q else quant
        if q is not None and matrix and shape[-1] % q.group_size == 0:
            largest, requant = max(largest, n), max(requant, n)
            weight += stack * packed_bytes(*shape[-2:], q.mode, q.bits, q.group_size, db)
        else:
            weight += n * db
    if quant is not None:
        t = _requant_spec(config, quant, group_asked) if quantized else quant
        label = f"{t.mode} {t.bits}-bit g{t.group_size}"
    elif quantized:
        from mlxrun.quant.formats import from_config  # noqa: PLC0415

        g = from_config(config.quantization or {})
        label = f"{g.mode} {g.bits}-bit g{g.group_size}"
        if any(isinstance(v, dict) for v in (config.quantization or {}).values()):
            label += " (mixed per layer)"
    else:
        label = dtype
    c = config
    kv = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * db
    quantizing = requant if quant is not None else 0
    return ModelFootprint(
        weight, kv, n_params, dense, int4, dtype, label, largest, stored, quantizing,
        tuple(c.layer_windows),
    )  # fmt: skip


# --- planning ------------------------------------------------------------------------------


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


def _fmt(n: int) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.1f} KiB"


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
