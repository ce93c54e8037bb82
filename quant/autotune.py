"""A small autotuner: time the candidate launch configurations of a kernel once per device,
software versions and shape, and remember the winner on disk.

Cache file (JSON), `$MLXRUN_CACHE/autotune.json` or `~/.cache/mlxrun/autotune.json`:

    {"schema": 1, "versions": "mlx=0.32.4 mlxrun=0.1.0 torch=2.13.0 triton=3.6.0",
     "entries": {"<device_key>|<kernel>|<shape>": {"winner": "gemv-split4",
                                                  "median_s": {"gemv-split4": 1.2e-05, ...}}}}

A file written under other versions (a new torch, triton, mlx or mlxrun changes which
configuration is fastest) is stale; an unreadable one is corrupt. Either is dropped with one
warning on stderr and rebuilt as shapes are tuned again: the cache is never a reason to fail.
Writes go to a temporary file in the same directory and `os.replace` it into place, so a
crash mid-write leaves the previous file (or none), never half a file.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SCHEMA = 1
# Packages whose versions decide which configuration wins (their kernels and compilers).
VERSIONED = ("mlx", "mlxrun", "torch", "triton")

Timer = Callable[[Callable[[], None]], float]  # runs fn once, returns its time in seconds

_warned: set[tuple[str, str]] = set()  # (cache path, "load" | "save") warned about already


def default_cache_path() -> Path:
    """`$MLXRUN_CACHE/autotune.json` when MLXRUN_CACHE is set, else
    `~/.cache/mlxrun/autotune.json`."""
    root = os.environ.get("MLXRUN_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "mlxrun"
    return base / "autotune.json"


def software_versions() -> str:
    """ "mlx=0.32.4 mlxrun=0.1.0 torch=2.13.0 triton=3.6.0" (absent packages left out).

    Read from package metadata, so nothing heavy is imported.
    """
    parts = []
    for name in VERSIONED:
        try:
            parts.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return " ".join(parts)


def wall_timer(fn: Callable[[], None]) -> float:
    """Seconds of one call by the wall clock; right for MLX (fn must mx.eval its result) and
    CPU work. GPU work needs `cuda_event_timer`, since launches return before the kernel ends."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cuda_event_timer(fn: Callable[[], None]) -> float:
    """Seconds of one call measured with CUDA events on the current stream."""
    import torch  # noqa: PLC0415

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class CudaGraphTimer:
    """Seconds per call of fn replayed from a CUDA graph of `inner` back-to-back calls.

    A decode-sized kernel runs for microseconds, less than Python takes to launch it, so
    `cuda_event_timer` on an eager call measures the launch. A captured decode step pays no
    launch cost, and this timer measures what it does pay. fn must be capturable (no host
    syncs); the first call per fn warms it up on a side stream and captures it.
    """

    def __init__(self, inner: int = 10):
        self.inner = inner
        self._graphs: dict[int, tuple[Callable[[], None], object]] = {}

    def __call__(self, fn: Callable[[], None]) -> float:
        import torch  # noqa: PLC0415

        entry = self._graphs.get(id(fn))
        if entry is None or entry[0] is not fn:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as capture needs
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(self.inner):
                    fn()
            entry = self._graphs[id(fn)] = (fn, graph)  # keeps fn alive, so its id stays unique
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        entry[1].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / self.inner


def device_key_for(backend: str, device: str) -> str:
    """A stable name for the chip a result was measured on.

    CUDA: "NVIDIA H100 80GB HBM3 sm_90 132SM"; Apple GPU: the chip ("Apple M2 Max");
    CPU: "cpu-<model name>". (backend, device) as `probe_device` takes them.
    """
    if backend == "torch" and (device == "cuda" or device.startswith("cuda:")):
        import torch  # noqa: PLC0415

        idx = int(device.partition(":")[2] or torch.cuda.current_device())
        p = torch.cuda.get_device_properties(idx)
        return f"{p.name} sm_{p.major}{p.minor} {p.multi_processor_count}SM"
    if device == "cpu":
        from mlxrun.device_memory import _cpu_name  # noqa: PLC0415

        return f"cpu-{_cpu_name()}"
    if backend == "torch" and device == "mps":
        from mlxrun.quant.profiles import apple_chip  # noqa: PLC0415

        return apple_chip() or "Apple GPU"
    if backend == "mlx" and device == "gpu":
        import mlx.core as mx  # noqa: PLC0415

        info = mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or "mlx-gpu")
    raise ValueError(f"no device key for backend {backend!r}, device {device!r}")


def _shape_key(shape: tuple) -> str:
    return "x".join(str(s) for s in shape)


def _dump(data: dict, f) -> None:
    """Serialise the cache (split out so tests can fail in the middle of a write)."""
    json.dump(data, f, indent=1, sort_keys=True)


class Autotuner:
    """Pick the fastest of several candidates per (device, versions, kernel, shape), cached.

    cache_path: the JSON file (default `default_cache_path()`). versions: the software
    versions string (default `software_versions()`). timer: runs a callable once and returns
    seconds (default `wall_timer`; `CudaGraphTimer()` for decode-sized CUDA kernels,
    `cuda_event_timer` for larger ones).
    """

    def __init__(
        self,
        cache_path: Path | None = None,
        *,
        versions: str | None = None,
        timer: Timer | None = None,
    ):
        self.cache_path = Path(cache_path) if cache_path is not None else default_cache_path()
        self.versions = software_versions() if versions is None else versions
        self.timer = timer or wall_timer
        self.entries: dict[str, dict] = self._load()

    # -- public --------------------------------------------------------------------------

    def best(
        self,
        kernel: str,
        shape: tuple,
        candidates: dict[str, Callable[[], None]],
        *,
        device_key: str,
        reps: int = 20,
        warmup: int = 2,
        timer: Timer | None = None,
    ) -> str:
        """The name of the fastest candidate for `kernel` at `shape` on `device_key`.

        candidates: name -> callable that runs that configuration once. On a cache hit
        (same device, versions, kernel, shape, and the winner still among the candidates)
        nothing runs. Otherwise each candidate runs `warmup` times untimed (compilation,
        caches), then `reps` timed runs; the lowest median wins and is saved. A candidate
        that raises (e.g. out of shared memory) is skipped; if all raise, the last error
        propagates.
        """
        assert candidates, "autotuning needs at least one candidate"
        key = f"{device_key}|{kernel}|{_shape_key(shape)}"
        hit = self.entries.get(key)
        if hit is not None and hit.get("winner") in candidates:
            return hit["winner"]
        timer = timer or self.timer
        medians: dict[str, float] = {}
        error: Exception | None = None
        for name, fn in candidates.items():
            try:
                for _ in range(warmup):
                    fn()
                medians[name] = statistics.median(timer(fn) for _ in range(max(1, reps)))
            except Exception as e:  # a configuration that cannot run here is not a winner
                error = e
        if not medians:
            assert error is not None
            raise error
        winner = min(medians, key=medians.__getitem__)
        self.entries[key] = {"winner": winner, "median_s": medians}
        self._save(key)
        return winner

    # -- cache file ----------------------------------------------------------------------

    def _warn(self, what: str, message: str) -> None:
        path = str(self.cache_path)
        if (path, what) not in _warned:
            _warned.add((path, what))
            print(f"mlxrun: autotune cache {path}: {message}", file=sys.stderr)

    def _read(self) -> tuple[dict[str, dict], str]:
        """(entries, problem) of the file on disk; problem is "" when it is usable."""
        try:
            raw = self.cache_path.read_bytes()
        except FileNotFoundError:
            return {}, ""
        except OSError as e:
            return {}, f"unreadable ({e.strerror}); retuning"
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}, "not valid JSON; rebuilding it"
        ok = (
            isinstance(data, dict)
            and data.get("schema") == SCHEMA
            and isinstance(data.get("versions"), str)
            and isinstance(data.get("entries"), dict)
            and all(
                isinstance(v, dict) and isinstance(v.get("winner"), str)
                for v in data["entries"].values()
            )
        )
        if not ok:
            return {}, "unexpected contents (not an mlxrun autotune cache); rebuilding it"
        if data["versions"] != self.versions:
            return {}, (
                f"tuned under {data['versions'] or 'no versions'!r}, now {self.versions!r}; "
                "retuning"
            )
        return data["entries"], ""

    def _load(self) -> dict[str, dict]:
        entries, problem = self._read()
        if problem:
            self._warn("load", problem)
        return entries

    def _save(self, key: str) -> None:
        """Merge our new entry into the file as it is now (another process may have added
        entries since we loaded it) and replace the file atomically."""
        on_disk, _ = self._read()
        on_disk[key] = self.entries[key]
        self.entries = {**on_disk, **self.entries}
        data = {"schema": SCHEMA, "versions": self.versions, "entries": self.entries}
        tmp = None
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(
                prefix=self.cache_path.name + ".", suffix=".tmp", dir=self.cache_path.parent
            )
            with os.fdopen(fd, "w") as f:
                _dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.cache_path)
            tmp = None
        except Exception as e:  # a read-only or full disk costs retuning next time, no more
            self._warn(
                "save", f"could not be written ({e}); results are kept for this process only"
            )
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
