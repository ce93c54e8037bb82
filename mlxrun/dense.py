"""Dense copies of quantized checkpoints, and dense tensors quantized with the numpy reference.

`mlxrun eval` scores every format against one dense model: a checkpoint stored quantized
(the bundled SmolLM2 GGUF) is dequantized once (`dense_checkpoint`), and its clip-search
rows quantize those dense tensors (`quantize_tensors`). `save_dense` writes the dense copy
to disk, e.g. for mlx-lm or transformers; `mlxrun convert` reads it for calibration.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from .convert import is_matrix
from .errors import MlxrunError
from .loader import Checkpoint, open_checkpoint
from .weights import Tensor, bf16_bits, save_safetensors


def dense_tensors(ckpt: Checkpoint) -> dict[str, Tensor]:
    """Every packed matrix of `ckpt` (weight/scales[/biases]) dequantized to an F32
    `[out, in]` `<path>.weight`; other tensors unchanged. A dense checkpoint comes back
    as is. Affine groups are expanded in float32 (scales and biases widened first), which
    is what the float32 backends compute for the packed layer, so the dense model gives
    the packed model's logits."""
    from mlxrun.quant.formats import layer_spec  # noqa: PLC0415
    from mlxrun.quant.reference import dequantize  # noqa: PLC0415

    t = ckpt.tensors
    out: dict[str, Tensor] = {}
    for name, x in t.items():
        path, _, leaf = name.rpartition(".")
        if f"{path}.scales" not in t:
            out[name] = x
            continue
        if leaf in ("scales", "biases"):
            continue  # folded into the dense weight
        if leaf != "weight":  # a layer's `.bias` (gpt-oss's experts) stays as it is
            out[name] = x
            continue
        spec = layer_spec(ckpt.config.quantization or {}, path)
        if spec is None:
            raise MlxrunError(
                f"{path} is stored quantized but config.json has no quantization block for it"
            )
        scales = t[f"{path}.scales"]
        if spec.mode == "affine":
            s, b = scales.float32(), t[f"{path}.biases"].float32()
            w = dequantize(x.data, s, b, spec)
        else:
            w = dequantize(x.data, np.asarray(scales.data), None, spec, dtype="float32")
        out[name] = Tensor("F32", w)
    return out


def dense_checkpoint(model: str | Checkpoint) -> Checkpoint:
    """`open_checkpoint(model)` (or an open checkpoint) with its packed matrices dequantized
    (see `dense_tensors`) and the quantization blocks dropped from the config."""
    ckpt = open_checkpoint(model) if isinstance(model, str) else model
    raw = {
        k: v for k, v in ckpt.raw_config.items() if k not in ("quantization", "quantization_config")
    }
    return dataclasses.replace(
        ckpt,
        config=ckpt.config.replace(quantization=None),
        raw_config=raw,
        tensors=dense_tensors(ckpt),
    )


def save_dense(model: str, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write `model` dequantized as a Hugging Face-layout directory (config.json,
    model.safetensors in `dtype` float32 | bfloat16 | float16, tokenizer files), e.g. to
    feed a dense copy of the bundled GGUF to mlx-lm or transformers. Returns the path."""
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    if dtype not in names:
        raise MlxrunError(f"unknown dtype {dtype!r}: use {', '.join(names)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlxrunError(f"{out} already exists and is not empty; choose a new directory")
    ckpt = dense_checkpoint(model)
    tensors = {}
    for name, t in ckpt.tensors.items():
        if t.dtype in ("F32", "F16", "BF16", "F64"):
            v = t.float32()
            data = bf16_bits(v) if dtype == "bfloat16" else v.astype(np.dtype(dtype))
            t = Tensor(names[dtype], data)
        tensors[name] = t
    config = dict(ckpt.raw_config, torch_dtype=dtype)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name, text in ckpt.tokenizer_files.items():
            (tmp / name).write_text(text)
        if ckpt.generation_config:
            (tmp / "generation_config.json").write_text(json.dumps(ckpt.generation_config))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MlxrunError(f"cannot write {out}: {e.strerror or e}") from None
    return out


def quantize_tensors(
    tensors: dict[str, Tensor], spec, *, dtype: str = "float32", clip_search: bool = False
) -> tuple[dict[str, Tensor], list[str]]:
    """Dense matrices -> packed canonical tensors with the numpy reference, from the values
    rounded to the compute `dtype` (so stored scales match what quantizing on the backend
    would give). Matrices whose input size is not a multiple of the group stay dense (a
    note says so). Returns (tensors, notes)."""
    from mlxrun.quant.reference import quantize  # noqa: PLC0415

    out: dict[str, Tensor] = {}
    notes: list[str] = []
    for name, t in tensors.items():
        path = name.removesuffix(".weight")
        if not (name.endswith(".weight") and is_matrix(path) and t.data.ndim == 2):
            out[name] = t
            continue
        if t.shape[1] % spec.group_size:
            notes.append(
                f"{path} stays unquantized: its input size {t.shape[1]} is not a "
                f"multiple of the group size {spec.group_size}"
            )
            out[name] = t
            continue
        v = t.float32()
        w = bf16_bits(v) if dtype == "bfloat16" else v.astype(np.dtype(dtype))
        parts = quantize(w, spec, bf16=dtype == "bfloat16", name=name, clip_search=clip_search)
        for k, a in parts.items():
            bf = dtype == "bfloat16" and k != "weight" and spec.mode == "affine"
            out[f"{path}.{k}"] = Tensor("BF16", a) if bf else Tensor.from_numpy(a)
    return out, notes
