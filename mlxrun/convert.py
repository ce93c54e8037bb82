"""`mlxrun convert`: write any supported source as a Hugging Face-layout directory, in the
canonical (mlx-lm) quantized format when asked. Written into a temporary sibling directory
and renamed only when complete, so a failure leaves nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .errors import MlxrunError
from .loader import open_checkpoint
from .weights import Tensor, save_safetensors

SHARD_BYTES = 5 * 10**9
# Linear and embedding weights: what mlx-lm quantizes (norms and biases stay dense).
MATRICES = (
    "embed_tokens",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)


def is_matrix(path: str) -> bool:
    """Module path (no '.weight') of a linear or embedding layer."""
    return path.rsplit(".", 1)[-1] in MATRICES


def quantize_tensors(tensors: dict[str, Tensor], spec, notes: list[str]):
    """Yield (name, Tensor) with every dense matrix quantized by the numpy reference
    (bit-exact with mx.quantize), one tensor at a time."""
    from mlxrun.quant.reference import quantize  # noqa: PLC0415

    for name, t in tensors.items():
        path = name.removesuffix(".weight")
        if not (name.endswith(".weight") and is_matrix(path) and t.data.ndim == 2):
            yield name, t
            continue
        if t.shape[1] % spec.group_size:
            notes.append(
                f"{path} stays unquantized: its input size {t.shape[1]} is not a "
                f"multiple of the group size {spec.group_size}"
            )
            yield name, t
            continue
        bf16 = t.dtype == "BF16"
        parts = quantize(
            t.data if t.dtype in ("BF16", "F16") else t.float32(), spec, bf16=bf16, name=name
        )
        for k, v in parts.items():
            yield (
                f"{path}.{k}",
                Tensor("BF16", v)
                if bf16 and k != "weight" and spec.mode == "affine"
                else Tensor.from_numpy(v),
            )


def _write_shards(tmp: Path, items, progress: bool) -> None:
    from tqdm.auto import tqdm  # noqa: PLC0415

    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tqdm(items, desc="converting", unit="tensor", disable=not progress, leave=False):
        if size and size + t.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if len(shards) == 1:
        save_safetensors(tmp / "model.safetensors", shards[0], {"format": "mlx"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(tmp / fname, shard, {"format": "mlx"})
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.nbytes
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def convert(
    model: str,
    out_dir: str,
    quant: str | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    progress: bool = True,
) -> list[str]:
    """Write `model` to `out_dir` (a new directory); returns notes for the user."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlxrunError(f"{out} already exists and is not empty; choose a new directory")
    spec = None
    if quant not in (None, "none"):
        from mlxrun.quant.formats import resolve, to_config  # noqa: PLC0415

        spec = resolve(quant, group_size=group_size, bits=bits)
    ckpt = open_checkpoint(model)
    config = dict(ckpt.raw_config)
    notes: list[str] = []
    items = iter(ckpt.tensors.items())
    if spec is not None:
        if ckpt.config.quantization is not None:
            raise MlxrunError(
                f"{model} is already quantized; convert from the full-precision checkpoint"
            )
        items = quantize_tensors(ckpt.tensors, spec, notes)
        config["quantization"] = config["quantization_config"] = to_config(spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise MlxrunError(f"cannot write to {out.parent}: {e.strerror}") from None
    try:
        _write_shards(tmp, items, progress)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name, text in ckpt.tokenizer_files.items():
            (tmp / name).write_text(text)
        if ckpt.generation_config:
            (tmp / "generation_config.json").write_text(
                json.dumps(ckpt.generation_config, indent=2)
            )
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MlxrunError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return notes
