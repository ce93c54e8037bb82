"""Device profiles: for each device, the kernel and compute dtype of every quantized format,
and the format `--quant auto` picks there.

A profile names what mlxrun runs, not what the hardware could run: every CUDA profile uses
the same Triton kernels (`mlxrun.quant.triton_kernels`: a split-K CUDA-core GEMV for decode,
M <= 4 rows, and a tl.dot GEMM on dequantized tiles for prefill), which decode the weight in
registers to the compute dtype. Where the tensor cores have a native path for a format's
element type (FP8 on sm_89+, block-scaled FP4 on sm_100/120) the `tensor_cores` field says
so; no kernel of ours uses it yet, and at decode (batch 1, memory-bound) it would not help:
the GEMV reads the same bytes either way.

Numbers quoted in the reasons: bytes per weight from `formats.bytes_per_weight`; relative
RMS error of `reference.quantize` on a 512x4096 Gaussian / Student-t(4) matrix; the Triton
GEMV for x [1, 4096] @ W [14336, 4096]^T on an H100 (sm_90, 132 SMs), timed as a CUDA-graph
replay (`autotune.CudaGraphTimer`), split-K autotuned, torch 2.11 / triton 3.6; CPU timings of
one 2048x2048 matrix-vector product on this project's 2-core AMD EPYC test machine.

    format  bytes/weight  rel. RMS error (gaussian / t4)  H100 GEMV 14336x4096
    bf16    2.0           0                               41.8 us (F.linear, cuBLAS)
    int4    0.5625        0.091 / 0.119                   14.7 us   affine g64, bf16 scale+bias
    nvfp4   0.5625        0.103 / 0.095                   21.6 us   E2M1, E4M3 scale per 16
    fp4     0.53125       0.119 / 0.139                   18.1 us   mxfp4: E8M0 scale per 32
    int8    1.0625        0.005 / 0.007                   24.9 us
    fp8     1.03125       0.027 / 0.027                   27.1 us   mxfp8: E4M3, E8M0 per 32
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from mlxrun.errors import MlxrunError
from mlxrun.quant.formats import USER_FORMATS


@dataclass(frozen=True)
class KernelChoice:
    """How one format runs on one device.

    kernel: what computes x @ W^T ("mx.quantized_matmul", "triton-gemv-splitk+triton-gemm",
    "torch-dequant-per-layer"). compute_dtype: activations and accumulation inputs.
    note: why, in one line. tiles: launch shapes fixed by the code (the rest is autotuned).
    tensor_cores: a native tensor-core path for this format's element type, "" if none.
    """

    kernel: str
    compute_dtype: str
    note: str
    tiles: str = ""
    tensor_cores: str = ""


@dataclass(frozen=True)
class DeviceProfile:
    """One kind of device: `formats` maps every `--quant` name to its KernelChoice.

    auto: the format `--quant auto` picks ("none" keeps the checkpoint dtype); fallback: the
    formats tried in order when the caller says `auto` does not fit in memory.
    """

    name: str
    match: str
    formats: dict[str, KernelChoice]
    auto: str
    auto_reason: str
    fallback: tuple[str, ...] = ()


# --- kernel choices shared between profiles -------------------------------------------------

MLX_QMM = "mx.quantized_matmul"
TRITON = "triton-gemv-splitk+triton-gemm"
TORCH_DEQUANT = "torch-dequant-per-layer"

# From triton_kernels.choose_config: what is fixed by the code for x [M, K] @ W^T [K, N].
TRITON_TILES = (
    "M<=4: GEMV, 1 warp x 8 rows x 128 words per step, split-K to ~16 warps/SM; "
    "M>4: tl.dot GEMM 16x64 (M<=16), 64x64 (M<=64) or 128x128/8 warps, 3 stages, "
    "split-K when tiles < SMs"
)
MLX_TILES = "MLX picks qmv (few rows) or qmm internally"

FP8_TC = "FP8 MMA (sm_89+): W8A8 would also quantize activations; unused"
FP8_TC_MX = "FP8 block-scaled MMA (torch._scaled_mm with E8M0 scales, cc >= 10.0); unused"
FP4_TC = "FP4 block-scaled MMA (E2M1 with E8M0/32 or E4M3/16 scales, sm_100/120); unused"

_WEIGHT_ONLY = "weight-only: codes decode to {dt} in registers"


def _cuda(dt: str, fp8_tc: str, fp4_tc: str, fp8_note: str, fp4_note: str) -> dict:
    """The five formats on a CUDA GPU through the Triton kernels, compute dtype `dt`."""
    wo = _WEIGHT_ONLY.format(dt=dt)
    return {
        "int4": KernelChoice(TRITON, dt, f"{wo}; 0.5625 B/weight", TRITON_TILES),
        "int8": KernelChoice(TRITON, dt, f"{wo}; 1.0625 B/weight", TRITON_TILES),
        "fp8": KernelChoice(TRITON, dt, f"{wo}; {fp8_note}", TRITON_TILES, fp8_tc),
        "fp4": KernelChoice(TRITON, dt, f"{wo}; {fp4_note}", TRITON_TILES, fp4_tc),
        "nvfp4": KernelChoice(TRITON, dt, f"{wo}; {fp4_note}", TRITON_TILES, fp4_tc),
    }


_NO_FP8 = "no FP8 tensor cores before sm_89: E4M3 decodes by bit moves, no fp8 instructions"
_FP8_ADA = (
    "FP8 tensor cores exist, but torch._scaled_mm here takes per-tensor/row-wise scales, "
    "not MX 1x32 E8M0 ones"
)
_FP8_HOPPER = (
    "FP8 tensor cores exist, but torch._scaled_mm here takes per-tensor, row-wise or 1x128 "
    "block scales, not MX 1x32 E8M0 ones"
)
_FP8_BW = "prefill could run W8A8 on block-scaled MMA; decode reads the same bytes either way"
_NO_FP4 = "no FP4 tensor cores before Blackwell: E2M1 decodes to the compute dtype"
_FP4_BW = "FP4 tensor cores exist (sm_100/120); prefill still dequantizes tiles"

_INT4_GPU_REASON = (
    "decode is memory-bound: int4 g64 reads 0.5625 B/weight, 3.6x fewer bytes than bf16, and "
    "is the most accurate 4-bit format here (rel. RMS 0.091 vs nvfp4 0.103, fp4 0.119)"
)
_H100 = (
    "; measured on H100: 4096x14336 GEMV int4 14.7 us vs bf16 41.8, fp4 18.1, nvfp4 21.6 "
    "(FP8/FP4 tensor cores would only speed up prefill)"
)


def _mlx_formats(dt: str, note: str) -> dict:
    """All five formats through MLX's fused kernels (mxfp8/nvfp4 need MLX >= 0.30)."""
    return {
        "int4": KernelChoice(MLX_QMM, dt, f"affine 4-bit g64; {note}", MLX_TILES),
        "int8": KernelChoice(MLX_QMM, dt, f"affine 8-bit g64; {note}", MLX_TILES),
        "fp8": KernelChoice(MLX_QMM, dt, f"mxfp8 (MLX >= 0.30); {note}", MLX_TILES),
        "fp4": KernelChoice(MLX_QMM, dt, f"mxfp4 (MLX >= 0.29); {note}", MLX_TILES),
        "nvfp4": KernelChoice(MLX_QMM, dt, f"nvfp4 (MLX >= 0.30); {note}", MLX_TILES),
    }


def _dequant_formats(dt: str, note: str) -> dict:
    return {f: KernelChoice(TORCH_DEQUANT, dt, note) for f in USER_FORMATS}


# --- the table ------------------------------------------------------------------------------

APPLE_GPU = DeviceProfile(
    "apple-gpu",
    "MLX on an Apple GPU (Metal), M3 or later or chip unknown",
    _mlx_formats("bfloat16", "fused dequant in the Metal qmv/qmm kernels"),
    "int4",
    "decode is memory-bound: int4 g64 reads 0.5625 B/weight, 3.6x fewer than bf16, through "
    "MLX's fused qmv, and is the most accurate 4-bit format (rel. RMS 0.091 vs 0.103/0.119)",
)
APPLE_M1_M2 = DeviceProfile(
    "apple-gpu-m1-m2",
    "MLX on an Apple M1/M2 GPU (no hardware bf16: Metal emulates it)",
    _mlx_formats("float16", "fp16 compute: bf16 is emulated on M1/M2"),
    "int4",
    APPLE_GPU.auto_reason,
)
APPLE_MPS = DeviceProfile(
    "apple-mps",
    "PyTorch on an Apple GPU (MPS)",
    _dequant_formats(
        "float16", "no fused kernel: each call expands the layer to a dense fp16 copy"
    ),
    "none",
    "torch on MPS dequantizes each layer per call (~4.6 B/weight moved vs 2 dense), so "
    "quantizing only saves memory: keep the checkpoint dtype (int4 if it does not fit); "
    "--backend mlx runs fused kernels",
    ("int4",),
)
NVIDIA_PRE_AMPERE = DeviceProfile(
    "nvidia-pre-ampere",
    "NVIDIA Volta/Turing (sm_70, sm_75): no bf16 tensor cores",
    _cuda("float16", "", "", _NO_FP8, _NO_FP4),
    "int4",
    _INT4_GPU_REASON,
)
NVIDIA_AMPERE = DeviceProfile(
    "nvidia-ampere",
    "NVIDIA Ampere (sm_80 A100, sm_86 RTX 30/A10, sm_87 Orin)",
    _cuda("bfloat16", "", "", _NO_FP8, _NO_FP4),
    "int4",
    _INT4_GPU_REASON,
)
NVIDIA_ADA = DeviceProfile(
    "nvidia-ada",
    "NVIDIA Ada (sm_89: RTX 40, L4, L40)",
    _cuda("bfloat16", FP8_TC, "", _FP8_ADA, _NO_FP4),
    "int4",
    _INT4_GPU_REASON + "; FP8 tensor cores would only speed up prefill",
)
NVIDIA_HOPPER = DeviceProfile(
    "nvidia-hopper",
    "NVIDIA Hopper (sm_90: H100, H200, GH200)",
    _cuda("bfloat16", FP8_TC, "", _FP8_HOPPER, _NO_FP4),
    "int4",
    _INT4_GPU_REASON + _H100,
)
NVIDIA_BLACKWELL = DeviceProfile(
    "nvidia-blackwell",
    "NVIDIA Blackwell (sm_100/103 B200/B300 tcgen05; sm_120/121 RTX 50, DGX Spark mma.sync)",
    _cuda("bfloat16", FP8_TC_MX, FP4_TC, _FP8_BW, _FP4_BW),
    "int4",
    "our kernels decode every format in CUDA cores (no block-scaled FP4 path yet), and there "
    "int4 g64 is fastest and most accurate at the same 0.5625 B/weight as nvfp4 (H100 GEMV "
    "14.7 vs 21.6 us; rel. RMS 0.091 vs 0.103); nvfp4 becomes the pick with a W4A4 kernel",
)
MLX_CUDA = DeviceProfile(
    "mlx-cuda",
    "MLX on an NVIDIA GPU (mlx-cuda)",
    _mlx_formats("bfloat16", "MLX's CUDA quantized kernels"),
    "int4",
    _INT4_GPU_REASON,
)
MLX_CPU = DeviceProfile(
    "mlx-cpu",
    "MLX on the CPU",
    {
        f: KernelChoice(
            MLX_QMM,
            "float32",
            "fp32: with bf16 inputs MLX's CPU qmv is ~8x slower (67 vs 7.8 ms, 2048x2048); "
            "prefill runs the same call (x [512, 576] @ W [1536, 576]^T: 2.0 s quantized, "
            "2.2 s dense: MLX's CPU matmul itself is slow here)",
            MLX_TILES,
        )
        for f in USER_FORMATS
    },
    "int4",
    "MLX's CPU qmv at fp32 decodes as fast as dense fp32 (2048x2048 GEMV: 7.8 vs 7.6 ms on 2 "
    "cores) at 0.56 instead of 4 bytes/weight",
)
TORCH_CPU = DeviceProfile(
    "torch-cpu",
    "PyTorch on the CPU",
    _dequant_formats("float32", "no fused kernel: each call expands the layer to dense fp32"),
    "none",
    "expanding a layer per call costs more than reading it dense (2048x2048 GEMV: fp32 2.0 ms, "
    "int8 48 ms, int4 145 ms on 2 cores): keep the checkpoint dtype; int8 (3x faster than "
    "int4) if it does not fit, then int4",
    ("int8", "int4"),
)

PROFILES: tuple[DeviceProfile, ...] = (
    APPLE_GPU,
    APPLE_M1_M2,
    APPLE_MPS,
    NVIDIA_PRE_AMPERE,
    NVIDIA_AMPERE,
    NVIDIA_ADA,
    NVIDIA_HOPPER,
    NVIDIA_BLACKWELL,
    MLX_CUDA,
    MLX_CPU,
    TORCH_CPU,
)
for _p in PROFILES:  # every profile covers exactly the user formats, and picks a known one
    assert set(_p.formats) == set(USER_FORMATS), _p.name
    assert _p.auto in (*USER_FORMATS, "none") and set(_p.fallback) <= set(USER_FORMATS), _p.name


# --- matching -------------------------------------------------------------------------------


def backend_device(name: str) -> tuple[str, str]:
    """A backend name as `resolve_backend_name` returns it -> (backend, device) for
    `match_profile` / `probe_device`: "mlx" -> ("mlx", "gpu" | "cpu"), "cuda" ->
    ("torch", "cuda"), "mps" -> ("torch", "mps"), "cpu" -> ("torch", "cpu")."""
    if name in ("cuda", "mps", "cpu") or name.startswith("cuda:"):
        return "torch", name
    if name == "mlx":
        import mlx.core as mx  # noqa: PLC0415

        return "mlx", "gpu" if mx.default_device() == mx.gpu else "cpu"
    raise MlxrunError(f"unknown backend {name!r}: use mlx, cuda, mps or cpu")


def _cuda_cc(device: str) -> tuple[int, int]:
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise MlxrunError("torch sees no CUDA GPU (CPU-only torch build, or no driver)")
    idx = int(device.partition(":")[2] or torch.cuda.current_device())
    return tuple(torch.cuda.get_device_capability(idx))


def _mlx_gpu_kind() -> tuple[str, str | None]:
    """("metal", chip name) or ("cuda", None) for MLX's GPU; ("metal", None) when unknown."""
    if importlib.util.find_spec("mlx") is None:
        return "metal", None
    import mlx.core as mx  # noqa: PLC0415

    if mx.metal.is_available():
        try:
            return "metal", str(mx.device_info().get("device_name") or "") or None
        except Exception:  # device_info is best-effort on older MLX
            return "metal", None
    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        return "cuda", None
    return "metal", None


def apple_chip() -> str | None:
    """The Apple chip name ("Apple M2 Max") from sysctl, or None off macOS."""
    try:
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out if out.startswith("Apple") else None


def _cuda_profile(cc: tuple[int, int]) -> DeviceProfile:
    major, minor = cc
    if major >= 10:  # sm_100/103 (tcgen05), sm_110, sm_120/121 (mma.sync block-scaled)
        return NVIDIA_BLACKWELL
    if major == 9:
        return NVIDIA_HOPPER
    if (major, minor) == (8, 9):
        return NVIDIA_ADA
    if major == 8:
        return NVIDIA_AMPERE
    return NVIDIA_PRE_AMPERE


def _apple_profile(chip: str | None) -> DeviceProfile:
    # M1/M2 (and their Pro/Max/Ultra) lack hardware bf16; M3 onwards have it.
    if chip and re.search(r"\bM[12]\b", chip):
        return APPLE_M1_M2
    return APPLE_GPU


def match_profile(
    backend: str,
    device: str,
    *,
    cc: tuple[int, int] | None = None,
    chip: str | None = None,
) -> DeviceProfile:
    """The profile of (backend, device) as `probe_device` names them: ("mlx", "gpu" | "cpu")
    or ("torch", "cuda[:N]" | "mps" | "cpu").

    cc: CUDA compute capability (major, minor); chip: Apple chip name ("Apple M2 Max").
    When not given they are read from the machine (torch / mlx / sysctl), so pass them to
    match a device that is not here.
    """
    if backend == "torch" and (device == "cuda" or device.startswith("cuda:")):
        return _cuda_profile(cc if cc is not None else _cuda_cc(device))
    if backend == "torch" and device == "mps":
        return APPLE_MPS
    if backend in ("torch", "mlx") and device == "cpu":
        return TORCH_CPU if backend == "torch" else MLX_CPU
    if backend == "mlx" and device == "gpu":
        if cc is not None:
            return MLX_CUDA
        if chip is not None:
            return _apple_profile(chip)
        kind, found = _mlx_gpu_kind()
        return MLX_CUDA if kind == "cuda" else _apple_profile(found)
    raise MlxrunError(
        f"unknown device {device!r} for backend {backend!r}: use mlx with gpu/cpu "
        "or torch with cuda/mps/cpu"
    )


def resolve_auto(
    backend: str,
    device: str,
    *,
    cc: tuple[int, int] | None = None,
    chip: str | None = None,
    fits: Callable[[str], bool] | None = None,
) -> tuple[str, str]:
    """What `--quant auto` means here: (format name or "none", one-line reason).

    fits(format) -> bool (optional, e.g. from the memory plan) says whether the model fits
    with that format ("none": the checkpoint dtype). When the profile's pick does not fit,
    its fallbacks are tried in order; when nothing fits, the last (smallest) is returned and
    the memory check that follows refuses with its own advice.
    """
    p = match_profile(backend, device, cc=cc, chip=chip)
    if fits is None or fits(p.auto):
        return p.auto, p.auto_reason
    for fmt in p.fallback:
        if fits(fmt):
            return (
                fmt,
                f"{p.auto} does not fit in memory; {fmt} is the next choice: {p.auto_reason}",
            )
    last = (p.auto, *p.fallback)[-1]
    return last, f"nothing fits in memory; {last} is the smallest choice here"


def markdown_table(profiles: tuple[DeviceProfile, ...] = PROFILES) -> str:
    """The profile table as README markdown: one row per profile, kernel/dtype per format."""
    fmts = list(USER_FORMATS)
    head = "| profile | device | " + " | ".join(fmts) + " | `--quant auto` | why |"
    rows = [head, "|" + "---|" * (len(fmts) + 4)]
    for p in profiles:
        cells = []
        for f in fmts:
            k = p.formats[f]
            tc = " (TC)" if k.tensor_cores else ""
            cells.append(f"{k.kernel}, {k.compute_dtype}{tc}")
        rows.append(f"| {p.name} | {p.match} | " + " | ".join(cells) + f" | {p.auto} | "
                    f"{p.auto_reason} |")  # fmt: skip
    return "\n".join(rows)
