"""mlxrun: run Llama-family models on MLX and PyTorch (CPU, CUDA, MPS).

>>> import mlxrun
>>> m = mlxrun.load("smollm2", backend="cpu", dtype="float32")
>>> m.generate("What is the capital of France?", max_tokens=32)
"""

from .api import Model, load
from .errors import MlxrunError
from .planning import plan

__all__ = ["Model", "MlxrunError", "load", "plan"]
__version__ = "0.1.0"
