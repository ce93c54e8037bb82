"""The device budget rule against simulated machines, and the probe of the machine the
tests run on (mlxrun/device_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxrun.device_memory import estimate_apple_working_set
from mlxrun.errors import MlxrunError
from mlxrun.memory import DeviceMemory, GiB, MiB, probe_device

from ._memory import APPLE_WS, BUDGETS


@pytest.mark.parametrize("key", BUDGETS)
def test_budget_rule(key):
    dev, want = BUDGETS[key]
    assert dev.budget_bytes == want


def test_apple_working_set_estimate_matches_reported_values():
    for ram, ws in APPLE_WS.items():
        assert estimate_apple_working_set(ram * GiB) == ws
    # with no reported value the estimate stands in
    dev = DeviceMemory("apple", "M2", 64 * GiB, 61 * GiB, True, None)
    assert dev.budget_bytes == 48 * GiB


def test_budget_is_never_negative():
    assert DeviceMemory("cuda", "busy", 24 * GiB, 100 * MiB, False).budget_bytes == 0


# --- probing the machine the tests run on ---


def test_probe_cpu_reads_meminfo():
    meminfo = {k: int(v.split()[0]) * 1024 for k, v in
               (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}  # fmt: skip
    limit = Path("/sys/fs/cgroup/memory.max")
    cg = int(limit.read_text()) if limit.exists() and limit.read_text().strip().isdigit() else None
    for backend in ("torch", "mlx"):
        dev = probe_device(backend, "cpu")
        assert dev.kind == "cpu" and not dev.unified
        assert dev.total_bytes == min(meminfo["MemTotal"], cg or meminfo["MemTotal"])
        assert abs(dev.available_bytes - meminfo["MemAvailable"]) < 512 * MiB or cg
        assert "/proc/meminfo" in dev.sources["available_bytes"]
        reserve = max(GiB, dev.total_bytes * 5 // 100)
        assert dev.budget_bytes == max(0, dev.available_bytes - reserve)


def test_probe_missing_devices():
    import mlx.core as mx
    import torch

    if not (mx.metal.is_available() or mx.cuda.is_available()):
        with pytest.raises(MlxrunError, match="MLX has no GPU"):
            probe_device("mlx", "gpu")
    if not torch.cuda.is_available():
        with pytest.raises(MlxrunError, match="no CUDA GPU"):
            probe_device("torch", "cuda")
    with pytest.raises(MlxrunError, match="unknown device"):
        probe_device("torch", "tpu")


@pytest.mark.cuda
@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
def test_probe_cuda():
    import torch

    dev = probe_device("torch", "cuda")
    free, total = torch.cuda.mem_get_info()
    assert dev.kind == "cuda" and dev.total_bytes == total
    assert abs(dev.available_bytes - free) < 256 * MiB
