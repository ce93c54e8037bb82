"""Device profiles against the hardware facts they encode, the autotuner's cache against a
scripted timer, and `mlxrun devices` on this machine."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import numpy as np
import pytest

from mlxrun.device_memory import DeviceMemory, GiB, _fmt, probe_device
from mlxrun.errors import MlxrunError
from mlxrun.quant import autotune
from mlxrun.quant.autotune import Autotuner, default_cache_path, device_key_for, wall_timer
from mlxrun.quant.formats import USER_FORMATS, bytes_per_weight
from mlxrun.quant.profiles import (
    MLX_QMM,
    PROFILES,
    TORCH_DEQUANT,
    TRITON,
    backend_device,
    markdown_table,
    match_profile,
    resolve_auto,
)

# --- profiles -------------------------------------------------------------------------------

# cc -> (profile, compute dtype, FP8 tensor cores, FP4 tensor cores, auto pick)
CUDA_CASES = {
    (7, 5): ("nvidia-pre-ampere", "float16", False, False, "int4"),
    (8, 0): ("nvidia-ampere", "bfloat16", False, False, "int4"),
    (8, 6): ("nvidia-ampere", "bfloat16", False, False, "int4"),
    (8, 9): ("nvidia-ada", "bfloat16", True, False, "int4"),
    (9, 0): ("nvidia-hopper", "bfloat16", True, False, "int4"),
    (10, 0): ("nvidia-blackwell", "bfloat16", True, True, "int4"),
    (12, 0): ("nvidia-blackwell", "bfloat16", True, True, "int4"),
}


@pytest.mark.parametrize("cc", list(CUDA_CASES))
def test_cuda_profiles(cc):
    name, dt, fp8_tc, fp4_tc, auto = CUDA_CASES[cc]
    for device in ("cuda", "cuda:1"):
        p = match_profile("torch", device, cc=cc)
        assert p.name == name
        assert p.auto == auto
        assert resolve_auto("torch", device, cc=cc) == (auto, p.auto_reason)
    for f, k in p.formats.items():
        # every format runs on our Triton kernels, weights decoded to the compute dtype
        assert k.kernel == TRITON and k.compute_dtype == dt, f
        assert "split-K" in k.tiles
    # FP8 tensor cores exist from sm_89 (Ada, Hopper, Blackwell); FP4 only on Blackwell
    assert bool(p.formats["fp8"].tensor_cores) == fp8_tc == (cc >= (8, 9))
    assert bool(p.formats["fp4"].tensor_cores) == fp4_tc == (cc[0] >= 10)
    assert bool(p.formats["nvfp4"].tensor_cores) == fp4_tc
    assert not p.formats["int4"].tensor_cores and not p.formats["int8"].tensor_cores
    if not fp8_tc:
        assert "weight-only" in p.formats["fp8"].note


@pytest.mark.parametrize(
    "chip, name, dt",
    [
        ("Apple M1", "apple-gpu-m1-m2", "float16"),
        ("Apple M1 Pro", "apple-gpu-m1-m2", "float16"),
        ("Apple M2 Ultra", "apple-gpu-m1-m2", "float16"),
        ("Apple M3 Max", "apple-gpu", "bfloat16"),
        ("Apple M4", "apple-gpu", "bfloat16"),
        ("Apple M12", "apple-gpu", "bfloat16"),  # not an M1/M2
    ],
)
def test_apple_gpu_profiles(chip, name, dt):
    p = match_profile("mlx", "gpu", chip=chip)
    assert p.name == name
    assert {k.kernel for k in p.formats.values()} == {MLX_QMM}
    assert {k.compute_dtype for k in p.formats.values()} == {dt}
    assert resolve_auto("mlx", "gpu", chip=chip)[0] == "int4"


def test_mps_cpu_and_mlx_cuda_profiles():
    mps = match_profile("torch", "mps", chip="Apple M3")
    assert mps.name == "apple-mps" and mps.auto == "none" and mps.fallback == ("int4",)
    assert {k.kernel for k in mps.formats.values()} == {TORCH_DEQUANT}
    mcpu = match_profile("mlx", "cpu")
    assert mcpu.name == "mlx-cpu" and mcpu.auto == "int4"
    assert {k.compute_dtype for k in mcpu.formats.values()} == {"float32"}
    tcpu = match_profile("torch", "cpu")
    assert tcpu.name == "torch-cpu" and tcpu.auto == "none"
    assert tcpu.fallback == ("int8", "int4")
    assert {k.kernel for k in tcpu.formats.values()} == {TORCH_DEQUANT}
    assert match_profile("mlx", "gpu", cc=(9, 0)).name == "mlx-cuda"
    # CLI backend names
    assert backend_device("cpu") == ("torch", "cpu")
    assert backend_device("cuda:1") == ("torch", "cuda:1")
    assert backend_device("mlx") == ("mlx", "cpu")  # no Metal / CUDA on this machine
    with pytest.raises(MlxrunError, match="unknown device"):
        match_profile("torch", "tpu")
    with pytest.raises(MlxrunError, match="unknown backend"):
        backend_device("rocm")


def test_auto_falls_back_when_it_does_not_fit():
    def only(*ok):
        return lambda fmt: fmt in ok

    assert resolve_auto("torch", "cpu", fits=only("none", "int8", "int4"))[0] == "none"
    fmt, why = resolve_auto("torch", "cpu", fits=only("int8", "int4"))
    assert fmt == "int8" and "none does not fit" in why
    assert resolve_auto("torch", "cpu", fits=only("int4"))[0] == "int4"
    fmt, why = resolve_auto("torch", "cpu", fits=only())
    assert fmt == "int4" and "nothing fits" in why
    assert resolve_auto("torch", "cuda", cc=(10, 0), fits=only("int4"))[0] == "int4"
    assert resolve_auto("torch", "cuda", cc=(9, 0), fits=only())[0] == "int4"


def test_every_profile_covers_every_format_and_the_table_lists_them():
    table = markdown_table()
    assert len(table.splitlines()) == 2 + len(PROFILES)
    for p in PROFILES:
        assert set(p.formats) == set(USER_FORMATS)
        assert p.auto_reason and f"| {p.name} |" in table


def test_quoted_bytes_and_errors_are_what_the_formats_give():
    """The auto reasons quote bytes/weight and relative RMS errors; recompute them."""
    from mlxrun.quant.reference import dequantize, quantize

    bpw = {f: bytes_per_weight(s) for f, s in USER_FORMATS.items()}
    assert bpw["int4"] == bpw["nvfp4"] == 0.5625 and bpw["fp4"] == 0.53125
    assert round(2 / bpw["int4"], 1) == 3.6  # "3.6x fewer bytes than bf16"
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((512, 4096)) * 0.02).astype(np.float32)
    quoted = {"int4": 0.091, "nvfp4": 0.103, "fp4": 0.119}
    for f, want in quoted.items():
        parts = quantize(w, USER_FORMATS[f])
        d = dequantize(parts["weight"], parts["scales"], parts.get("biases"), USER_FORMATS[f])
        err = np.sqrt(np.mean((np.asarray(d, np.float32) - w) ** 2) / np.mean(w**2))
        assert abs(err - want) < 0.002, (f, err)
    assert "0.091" in match_profile("torch", "cuda", cc=(9, 0)).auto_reason


# --- autotuner ------------------------------------------------------------------------------


class Scripted:
    """Candidates that log their runs, and a timer that returns scripted times per run."""

    def __init__(self, times: dict[str, list[float] | float]):
        self.times = times
        self.runs: list[str] = []
        self.timed = 0

    def candidates(self) -> dict:
        return {name: (lambda n=name: self.runs.append(n)) for name in self.times}

    def timer(self, fn) -> float:
        fn()
        self.timed += 1
        name = self.runs[-1]
        t = self.times[name]
        if isinstance(t, float):
            return t
        return t[sum(1 for r in self.runs if r == name) % len(t)]


def test_autotuner_picks_the_fastest_median_and_caches_it(tmp_path, capsys):
    path = tmp_path / "at.json"
    # "a" has one very fast outlier in five runs: its minimum is best, its median is not
    s = Scripted({"a": [1e-6, 5e-5, 5e-5, 5e-5, 5e-5], "b": 2e-5, "c": 3e-5})
    tuner = Autotuner(path, versions="torch=1", timer=s.timer)
    best = tuner.best("gemv", (1, 4096, 14336), s.candidates(), device_key="H100", reps=5)
    assert best == "b"
    assert s.timed == 15 and len(s.runs) == 15 + 3 * 2  # 5 timed + 2 warm-up each
    data = json.loads(path.read_text())
    assert data["versions"] == "torch=1"
    entry = data["entries"]["H100|gemv|1x4096x14336"]
    assert entry["winner"] == "b" and entry["median_s"]["a"] == 5e-5

    # a fresh process (new Autotuner on the same file) hits the cache: nothing runs
    s2 = Scripted({"a": 1e-6, "b": 1.0, "c": 1.0})
    tuner2 = Autotuner(path, versions="torch=1", timer=s2.timer)
    assert tuner2.best("gemv", (1, 4096, 14336), s2.candidates(), device_key="H100") == "b"
    assert s2.timed == 0 and s2.runs == []
    # another shape, device or kernel is a miss and is timed
    assert tuner2.best("gemv", (1, 4096, 4096), s2.candidates(), device_key="H100") == "a"
    assert tuner2.best("gemv", (1, 4096, 14336), s2.candidates(), device_key="A100") == "a"
    assert s2.timed == 2 * 3 * 20
    assert set(json.loads(path.read_text())["entries"]) == {
        "H100|gemv|1x4096x14336",
        "H100|gemv|1x4096x4096",
        "A100|gemv|1x4096x14336",
    }
    # a cached winner that is no longer a candidate is retuned
    s3 = Scripted({"c": 1.0, "d": 0.5})
    cands = s3.candidates()
    assert tuner2.best("gemv", (1, 4096, 14336), cands, device_key="H100", timer=s3.timer) == "d"
    assert s3.timed == 2 * 20
    assert capsys.readouterr().err == ""  # nothing to warn about


def test_stale_versions_retune_with_one_warning(tmp_path, capsys):
    path = tmp_path / "at.json"
    s = Scripted({"a": 1.0, "b": 2.0})
    Autotuner(path, versions="torch=1", timer=s.timer).best(
        "k", (8,), s.candidates(), device_key="d", reps=1
    )
    s2 = Scripted({"a": 2.0, "b": 1.0})
    tuner = Autotuner(path, versions="torch=2", timer=s2.timer)
    assert tuner.best("k", (8,), s2.candidates(), device_key="d", reps=1) == "b"
    assert s2.timed == 2
    err = capsys.readouterr().err
    assert err.count("tuned under 'torch=1', now 'torch=2'") == 1
    data = json.loads(path.read_text())
    assert data["versions"] == "torch=2" and list(data["entries"]) == ["d|k|8"]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x00\xff\xfe garbage \x80", "not valid JSON"),
        (b'{"schema": 1, "versions": "v", "entr', "not valid JSON"),  # truncated
        (b"[1, 2, 3]", "unexpected contents"),
        (b'{"schema": 99, "versions": "v", "entries": {}}', "unexpected contents"),
        (b'{"schema": 1, "versions": "v", "entries": {"k": 3}}', "unexpected contents"),
    ],
)
def test_corrupt_cache_is_rebuilt_never_fatal(tmp_path, capsys, content, message):
    path = tmp_path / "at.json"
    path.write_bytes(content)
    Autotuner(path, versions="v")  # loading alone warns ...
    s = Scripted({"x": 2.0, "y": 1.0})
    tuner = Autotuner(path, versions="v", timer=s.timer)  # ... once per path
    assert tuner.best("k", (1, 2), s.candidates(), device_key="d", reps=1) == "y"
    assert capsys.readouterr().err.count(message) == 1
    assert json.loads(path.read_text())["entries"]["d|k|1x2"]["winner"] == "y"


def test_cache_write_is_atomic(tmp_path, capsys, monkeypatch):
    path = tmp_path / "sub" / "at.json"
    s = Scripted({"x": 1.0, "y": 2.0})
    Autotuner(path, versions="v", timer=s.timer).best(
        "k", (1,), s.candidates(), device_key="d", reps=1
    )
    before = path.read_bytes()

    def half_then_fail(data, f):
        f.write(json.dumps(data)[:20])  # a partial file ...
        f.flush()
        raise OSError(28, "No space left on device")  # ... then the disk fills up

    monkeypatch.setattr(autotune, "_dump", half_then_fail)
    tuner = Autotuner(path, versions="v", timer=s.timer)
    # tuning still answers, keeps the result in memory, and leaves the old file whole
    assert tuner.best("k", (2,), s.candidates(), device_key="d", reps=1) == "x"
    assert tuner.best("k", (2,), {"x": lambda: None}, device_key="d") == "x"
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["at.json"]  # no temp left
    assert "could not be written" in capsys.readouterr().err
    # the same failure with no file yet leaves no file at all
    fresh = tmp_path / "fresh" / "at.json"
    Autotuner(fresh, versions="v", timer=s.timer).best(
        "k", (1,), s.candidates(), device_key="d", reps=1
    )
    assert list(fresh.parent.iterdir()) == []


def test_failing_candidates_are_skipped(tmp_path):
    def boom():
        raise RuntimeError("out of shared memory")

    s = Scripted({"ok": 1.0})
    tuner = Autotuner(tmp_path / "at.json", versions="v", timer=s.timer)
    cands = {"big": boom, **s.candidates()}
    assert tuner.best("k", (1,), cands, device_key="d", reps=2) == "ok"
    with pytest.raises(RuntimeError, match="shared memory"):
        tuner.best("k", (2,), {"big": boom}, device_key="d")


def test_wall_timer_on_real_work(tmp_path):
    import time

    tuner = Autotuner(tmp_path / "at.json", versions="v")
    cands = {"slow": lambda: time.sleep(0.003), "fast": lambda: None}
    assert tuner.timer is wall_timer
    assert tuner.best("sleep", (1,), cands, device_key="d", reps=3, warmup=0) == "fast"
    assert (
        json.loads((tmp_path / "at.json").read_text())["entries"]["d|sleep|1"]["median_s"]["slow"]
        >= 0.003
    )


def test_cache_location_versions_and_device_key(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXRUN_CACHE", str(tmp_path / "c"))
    assert default_cache_path() == tmp_path / "c" / "autotune.json"
    monkeypatch.delenv("MLXRUN_CACHE")
    assert default_cache_path() == Path.home() / ".cache" / "mlxrun" / "autotune.json"
    v = autotune.software_versions()
    for pkg in ("mlx", "torch", "triton", "mlxrun"):
        assert f"{pkg}={importlib.metadata.version(pkg)}" in v.split()
    model = next(
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    )
    assert device_key_for("torch", "cpu") == device_key_for("mlx", "cpu") == f"cpu-{model}"


# --- mlxrun devices -------------------------------------------------------------------------


def _mem_total() -> int:
    kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    total = kb * 1024
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().split()[0]
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def test_detect_on_this_machine():
    from mlxrun.devices import detect, format_report

    reports = {(r.backend, r.device): r for r in detect()}
    assert {("mlx", "cpu"), ("torch", "cpu")} <= set(reports)
    for key, profile, auto in [(("mlx", "cpu"), "mlx-cpu", "int4"), (("torch", "cpu"), "torch-cpu", "none")]:  # fmt: skip
        r = reports[key]
        assert r.error == "" and r.memory is not None
        assert r.memory.total_bytes == _mem_total()
        assert 0 < r.memory.available_bytes <= r.memory.total_bytes
        # MemAvailable moves between two reads while other processes run: check the rule
        # (available - max(1 GiB, 5% of RAM)) on the report's own reading instead
        reserve = max(2**30, _mem_total() * 5 // 100)
        assert r.memory.budget_bytes == r.memory.available_bytes - reserve > 0
        assert probe_device(*key).total_bytes == r.memory.total_bytes
        assert r.profile.name == profile and r.auto == auto
    text = format_report(list(reports.values()))
    assert "auto     int4: MLX's CPU qmv" in text and "auto     none:" in text
    assert f"total {_fmt(_mem_total())}" in text
    assert "[0] mlx cpu" in text and "torch cpu" in text
    assert format_report([]).startswith("no devices found")


def test_report_of_a_simulated_gpu():
    from mlxrun.devices import DeviceReport, format_report

    mem = DeviceMemory("cuda", "NVIDIA H100 80GB HBM3", 80 * GiB, 79 * GiB, False)
    p = match_profile("torch", "cuda:0", cc=(9, 0))
    auto, why = resolve_auto("torch", "cuda:0", cc=(9, 0))
    r = DeviceReport("torch", "cuda:0", mem.name, mem, p, auto, why, (9, 0), 132)
    text = format_report([r], verbose=True)
    assert "[0] torch cuda:0: NVIDIA H100 80GB HBM3, sm_90, 132 SMs" in text
    assert "budget 76.60 GiB = free VRAM 79.00 GiB - reserve 2.40 GiB" in text
    assert "nvidia-hopper" in text and "auto     int4: decode is memory-bound" in text
    assert text.count(TRITON) == 5 and "tiles    all formats: M<=4: GEMV" in text
    assert "tensor cores: FP8 MMA" in text  # fp8 row, verbose


def test_devices_module_imports_no_backend():
    """`import mlxrun.devices` stays light: torch and mlx load only when detect() runs."""
    import subprocess
    import sys

    code = "import sys, mlxrun.devices; print('torch' in sys.modules, 'mlx.core' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    ).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.cuda
def test_cuda_graph_timer_times_the_kernel_not_the_launch(tmp_path):
    """On a GPU: a 64 MiB copy under CudaGraphTimer takes about bytes / bandwidth, and the
    autotuner picks the copy of half the size."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mlxrun.quant.autotune import CudaGraphTimer

    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(big)
    timer = CudaGraphTimer(inner=5)
    cands = {"full": lambda: out.copy_(big), "half": lambda: out[: 32 << 20].copy_(big[: 32 << 20])}
    t_full = timer(cands["full"])
    assert 128 * 2**20 / t_full < 10e12  # read + write under 10 TB/s: the copy really ran
    tuner = Autotuner(tmp_path / "at.json", versions="v", timer=timer)
    assert tuner.best("copy", (64,), cands, device_key=device_key_for("torch", "cuda")) == "half"
