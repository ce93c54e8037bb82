"""Backends: `get_backend("auto" | "mlx" | "cuda" | "mps" | "cpu", dtype)`."""

from __future__ import annotations

import importlib.util
import platform
import sys

from mlxrun.errors import MlxrunError

BACKENDS = ("auto", "mlx", "cuda", "mps", "cpu")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(name: str) -> str:
    """'auto' -> MLX on Apple Silicon, CUDA where torch sees a GPU, else the CPU path we
    measured faster (PyTorch; MLX when torch is absent)."""
    if name not in BACKENDS:
        raise MlxrunError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    if sys.platform == "darwin" and platform.machine() == "arm64" and _has("mlx"):
        return "mlx"
    if _has("torch"):
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    if _has("mlx"):
        return "mlx"
    raise MlxrunError("no backend installed: pip install 'mlxrun[mlx]' or 'mlxrun[torch]'")


def get_backend(name: str = "auto", dtype: str | None = None):
    """A ready backend object; raises MlxrunError naming the extra to install."""
    name = resolve_backend_name(name)
    if name == "mlx":
        from .mlx_backend import MLXBackend  # noqa: PLC0415

        return MLXBackend(dtype=dtype)
    from .torch_backend import TorchBackend  # noqa: PLC0415

    return TorchBackend(device=name, dtype=dtype)
