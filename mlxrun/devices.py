"""`mlxrun devices`: every device this machine offers, its memory, its profile, and what each
quantized format runs as there.

torch and mlx are imported when `detect` runs, not at import, and a backend that is not
installed is simply absent from the report.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from mlxrun.device_memory import DeviceMemory, _fmt, probe_device
from mlxrun.errors import MlxrunError
from mlxrun.quant.formats import USER_FORMATS
from mlxrun.quant.profiles import DeviceProfile, apple_chip, match_profile, resolve_auto

# Where the timings quoted in quant/profiles.py's reasons were measured.
REFERENCE_MACHINES = {
    "torch-cpu": "a 2-core AMD EPYC (x86-64) server",
    "mlx-cpu": "a 2-core AMD EPYC (x86-64) server",
    "nvidia-hopper": "an NVIDIA H100",
}


@dataclass(frozen=True)
class DeviceReport:
    """One (backend, device) pair as `probe_device` names it, e.g. ("torch", "cuda:0").

    memory is None when probing failed (`error` says why). cc and sm_count are CUDA-only;
    chip is the Apple chip name where known. auto / auto_reason: what `--quant auto` picks.
    """

    backend: str
    device: str
    name: str
    memory: DeviceMemory | None
    profile: DeviceProfile
    auto: str
    auto_reason: str
    cc: tuple[int, int] | None = None
    sm_count: int | None = None
    chip: str | None = None
    details: dict[str, str] = field(default_factory=dict)
    error: str = ""


def _report(
    backend: str,
    device: str,
    *,
    cc: tuple[int, int] | None = None,
    chip: str | None = None,
    sm_count: int | None = None,
    details: dict[str, str] | None = None,
) -> DeviceReport:
    try:
        mem, error = probe_device(backend, device), ""
    except MlxrunError as e:
        mem, error = None, str(e)
    profile = match_profile(backend, device, cc=cc, chip=chip)
    auto, why = resolve_auto(backend, device, cc=cc, chip=chip)
    name = mem.name if mem is not None else (chip or device)
    return DeviceReport(
        backend, device, name, mem, profile, auto, why, cc, sm_count, chip, details or {}, error
    )


def _mlx_reports() -> list[DeviceReport]:
    import mlx.core as mx  # noqa: PLC0415

    out = []
    version = {"mlx": mx.__version__}
    if mx.metal.is_available():
        info = mx.device_info()
        chip = str(info.get("device_name") or "") or apple_chip()
        arch = str(info.get("architecture", ""))
        out.append(_report("mlx", "gpu", chip=chip, details={**version, "architecture": arch}))
    elif getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        # mlx-cuda: the compute capability comes from torch when it is installed too
        cc = None
        if importlib.util.find_spec("torch") is not None:
            import torch  # noqa: PLC0415

            if torch.cuda.is_available():
                cc = tuple(torch.cuda.get_device_capability(0))
        out.append(_report("mlx", "gpu", cc=cc, details=version))
    info = mx.device_info(mx.cpu) if hasattr(mx, "device_info") else {}
    arch = str(info.get("architecture", "")) if isinstance(info, dict) else ""
    out.append(_report("mlx", "cpu", details={**version, "architecture": arch}))
    return out


def _torch_reports() -> list[DeviceReport]:
    import torch  # noqa: PLC0415

    version = {"torch": torch.__version__}
    out = [_report("torch", "cpu", details={**version, "threads": str(torch.get_num_threads())})]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(
                _report(
                    "torch",
                    f"cuda:{i}",
                    cc=(p.major, p.minor),
                    sm_count=p.multi_processor_count,
                    details={**version, "cuda": str(torch.version.cuda)},
                )
            )
    if torch.backends.mps.is_available():
        out.append(_report("torch", "mps", chip=apple_chip(), details=version))
    return out


def detect() -> list[DeviceReport]:
    """Every device here: MLX's GPU (Metal or CUDA) and CPU when mlx is installed; torch's
    CPU, each CUDA GPU and MPS when torch is installed. Memory from `probe_device`."""
    reports: list[DeviceReport] = []
    if importlib.util.find_spec("mlx") is not None:
        reports += _mlx_reports()
    if importlib.util.find_spec("torch") is not None:
        reports += _torch_reports()
    return reports


def _memory_line(r: DeviceReport) -> str:
    m = r.memory
    if m is None:
        return f"not probed: {r.error}"
    line = f"total {_fmt(m.total_bytes)}, available {_fmt(m.available_bytes)}, "
    line += f"budget {_fmt(m.budget_bytes)} = {m.budget_rule()}"
    return line + (", unified" if m.unified else "")


def format_report(reports: list[DeviceReport], verbose: bool = False) -> str:
    """A readable block per device: memory, profile, kernel and compute dtype per format,
    and the `--quant auto` pick with its reason. verbose adds notes and static tiles."""
    if not reports:
        return "no devices found: install mlx or torch (pip install 'mlxrun[mlx]')"
    blocks = []
    for i, r in enumerate(reports):
        where = r.name
        if r.cc is not None:
            where += f", sm_{r.cc[0]}{r.cc[1]}"
        if r.sm_count:
            where += f", {r.sm_count} SMs"
        extra = ", ".join(f"{k} {v}" for k, v in r.details.items() if v)
        lines = [f"[{i}] {r.backend} {r.device}: {where}" + (f" ({extra})" if extra else "")]
        lines.append(f"    memory   {_memory_line(r)}")
        lines.append(f"    profile  {r.profile.name}: {r.profile.match}")
        kw = max(len(r.profile.formats[f].kernel) for f in USER_FORMATS)
        for f in USER_FORMATS:
            k = r.profile.formats[f]
            tc = f"  tensor cores: {k.tensor_cores}" if k.tensor_cores and verbose else ""
            lines.append(f"    {f:<8} {k.kernel:<{kw}}  {k.compute_dtype}{tc}")
        if verbose:  # formats that share a note or tiles get it once, under their names
            for what in ("note", "tiles"):
                by_text: dict[str, list[str]] = {}
                for f in USER_FORMATS:
                    if text := getattr(r.profile.formats[f], what):
                        by_text.setdefault(text, []).append(f)
                for text, fs in by_text.items():
                    who = "all formats" if len(fs) == len(USER_FORMATS) else ", ".join(fs)
                    lines.append(f"    {what:<8} {who}: {text}")
        lines.append(f"    auto     {r.auto}: {r.auto_reason}")
        if r.profile.name in REFERENCE_MACHINES:
            lines.append(
                f"    timings  reference figures from mlxrun/quant/profiles.py, measured on "
                f"{REFERENCE_MACHINES[r.profile.name]}; not measured now "
                "(mlxrun bench measures this machine)"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
