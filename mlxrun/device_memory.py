"""What a device can hold: its memory as the backend sees it, and the budget mlxrun may plan.

Backend-free at import (the standard library only); `probe_device` imports torch or mlx when
it is called.

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

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MlxrunError

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


def _fmt(n: int) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.1f} KiB"
