"""Shared set-up of the K-quant kernel tests (test_triton_kquant.py, test_kquant_model.py):
without a GPU the kernels run under TRITON_INTERPRET=1, set before triton decorates them, and
re-decorated where another test module imported them first. Skips the importing module where
torch, gguf (the oracle) or triton is missing."""

import importlib
import os

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
pytest.importorskip("triton", reason="triton is not installed")

import mlxrun.quant.kquant_kernels as kk  # noqa: E402
import mlxrun.quant.triton_gemm as tgm  # noqa: E402
import mlxrun.quant.triton_gemv as tg  # noqa: E402
import mlxrun.quant.triton_kernels as tk  # noqa: E402
import mlxrun.quant.triton_kquant as kq  # noqa: E402

if not HAS_CUDA and type(kk._kq_lane_gemv_kernel).__name__ != "InterpretedFunction":
    importlib.reload(importlib.import_module("mlxrun.quant.triton_decode"))
    importlib.reload(importlib.import_module("mlxrun.quant.triton_gemv_step"))
    tg = importlib.reload(tg)  # imported earlier without the interpreter: decorate again,
    tgm = importlib.reload(tgm)  # the kernels the K-quant kernels call first
    tk = importlib.reload(tk)
    kk = importlib.reload(kk)
    kq = importlib.reload(kq)

DEV = "cuda" if HAS_CUDA else "cpu"
# over a minute on 2 cores under the interpreter: `pytest -m long`; on a GPU by default
LONG_ON_CPU = pytest.mark.long if not HAS_CUDA else pytest.mark.cuda
