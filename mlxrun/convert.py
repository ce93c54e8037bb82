"""`mlxrun convert`: write any supported source as a Hugging Face-layout directory, in the
canonical (mlx-lm) quantized format when asked. Written into a temporary sibling directory
and renamed only when complete, so a failure leaves nothing half-written.

A source that is already quantized follows the rules of quantize-on-load (`build.py`): a
stored layer already in the asked format keeps its bytes, any other is dequantized and
re-quantized, one layer at a time; `--quant none` writes every stored layer dequantized.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .build import stored_dense, target_spec
from .errors import MlxrunError
from .loader import Checkpoint, open_checkpoint
from .weights import Tensor, bf16_bits, save_safetensors

SHARD_BYTES = 5 * 10**9  # mlx-lm's and transformers' default shard limit
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
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


# `.NAME.partial-PID`: where convert writes before the rename (see `convert`).
_PARTIAL = re.compile(r"^\..+\.partial-(\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: checks that the process exists, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    except (OverflowError, ValueError):
        return False
    return True


def clean_stale_partials(parent: Path) -> list[str]:
    """Remove the `.NAME.partial-PID` directories in `parent` whose process is gone (a
    convert killed by SIGKILL or a power cut cannot clean up after itself); returns a
    note for each. A directory with subdirectories is not one convert wrote, and stays.
    PIDs are this machine's: on a directory shared between machines, a convert running
    on another one may look dead, so only its own machine's runs should share a parent."""
    notes = []
    for p in sorted(parent.glob(".*.partial-*")):
        m = _PARTIAL.match(p.name)
        if m is None or not p.is_dir() or p.is_symlink() or _alive(int(m.group(1))):
            continue
        try:
            if any(c.is_dir() for c in p.iterdir()):
                continue
            shutil.rmtree(p)
        except OSError as e:
            notes.append(f"could not remove {p}, left by a convert that was killed: {e}")
            continue
        notes.append(f"removed {p}, left by a convert that was killed")
    return notes


def is_matrix(path: str) -> bool:
    """Module path (no '.weight') of a linear or embedding layer."""
    return path.rsplit(".", 1)[-1] in MATRICES


def _as_dtype(w: np.ndarray, name: str) -> Tensor:
    """float32 values -> a Tensor of safetensors dtype `name` (F32, F16 or BF16)."""
    if name == "BF16":
        return Tensor("BF16", bf16_bits(w))
    return Tensor(name, w.astype(np.float16 if name == "F16" else np.float32))


def _quantize(path: str, t: Tensor, spec) -> Iterator[tuple[str, Tensor]]:
    """One dense [out, in] matrix -> its packed tensors, by the numpy reference (bit-exact
    with mx.quantize); affine scales and biases keep the matrix's float dtype."""
    from mlxrun.quant.reference import quantize  # noqa: PLC0415

    bf16 = t.dtype == "BF16"
    data = t.data if t.dtype in ("BF16", "F16") else t.float32()
    parts = quantize(data, spec, bf16=bf16, name=f"{path}.weight")
    for k, v in parts.items():
        bf = bf16 and k != "weight" and spec.mode == "affine"
        yield f"{path}.{k}", Tensor("BF16", v) if bf else Tensor.from_numpy(v)


def _check_packed(path: str, w: Tensor, s: Tensor | None, b: Tensor | None, spec) -> None:
    """The stored tensors of `path` have the shapes `spec` implies for its weight."""
    *lead, rows, words = w.shape if w.data.ndim >= 2 else (0, 0)
    inp = words * 32 // spec.bits
    groups = (*lead, rows, inp // spec.group_size)
    for k, x, want in (("scales", s, groups), ("biases", b, groups if spec.has_biases else None)):
        if want is None:
            continue
        if x is None or x.shape != want or inp % spec.group_size:
            have = "missing" if x is None else f"shape {list(x.shape)}"
            raise MlxrunError(
                f"tensor '{path}.{k}' is {have} but config.json's {spec.label} "
                f"g{spec.group_size} implies {list(want)} for weight {list(w.shape)}; "
                "fix the quantization block or re-download the model"
            )


class _Plan:
    """What happens to each tensor of a checkpoint: (name, Tensor) pairs to write, one
    layer at a time, and the quantization block and notes that describe them."""

    def __init__(self, ckpt: Checkpoint, spec, dense: bool, group_asked: bool):
        from mlxrun.quant.formats import from_config, to_config  # noqa: PLC0415

        self.t, self.dense = dict(ckpt.tensors), dense
        self.cfg = ckpt.config
        self.moe_sources = self._moe_sources(ckpt.config)
        self.qconfig = ckpt.config.quantization
        if self.qconfig is not None:
            from_config(self.qconfig)  # an unknown mode fails before anything is written
        self.spec = target_spec(spec, self.qconfig, group_asked)
        self.group_asked = group_asked
        # dequantized layers are written in the checkpoint's own float dtype
        self.float_name = _DTYPES.get(str(ckpt.raw_config.get("torch_dtype")), "F32")
        self.block = None if self.spec is None else to_config(self.spec)
        self.kept = self.requantized = self.expanded = 0
        self.sources: set[str] = set()
        self.notes: list[str] = []

    def __len__(self) -> int:
        return len(self.t)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        done: set[int] = set()
        for name in list(self.t):
            layer = self.moe_sources.get(name)
            if layer is None:
                yield from self._one(name, self.t[name])
            elif layer not in done:  # the layer's experts, stacked as mlx-lm stores them
                done.add(layer)
                made = self._stack(layer)
                for n in made:
                    yield from self._one(n, self.t[n])
                for n in made:  # written: the stacked copies go
                    del self.t[n]

    def _moe_sources(self, cfg) -> dict[str, int]:
        """Tensors stored per expert or fused (transformers' layouts) -> their layer."""
        if cfg.moe is None:
            return {}
        from .moe import expert_names  # noqa: PLC0415

        out = {}
        for i in range(cfg.num_hidden_layers):
            n = expert_names(cfg.model_type, f"model.layers.{i}")
            for name in self.t:
                if name.startswith(f"{n.per_expert}.") and name[len(n.per_expert) + 1].isdigit():
                    out[name] = i
                elif name.startswith(f"{n.stacked}.gate_up_proj") or name.startswith(
                    f"{n.stacked}.down_proj_"
                ) or name == f"{n.stacked}.down_proj":  # fmt: skip
                    out[name] = i
        return out

    def _stack(self, layer: int) -> list[str]:
        from .moe import expert_names, fused_experts, stack_per_expert  # noqa: PLC0415

        c = self.cfg
        n = expert_names(c.model_type, f"model.layers.{layer}")
        before = set(self.t)
        used = stack_per_expert(self.t, n, c.moe.num_experts) + fused_experts(self.t, n)
        for name in used:
            del self.t[name]
        return sorted(set(self.t) - before)

    def _one(self, name: str, t: Tensor) -> Iterator[tuple[str, Tensor]]:
        path, _, leaf = name.rpartition(".")
        if f"{path}.scales" in self.t and leaf != "bias":  # a linear's bias stays as is
            if leaf == "weight":  # scales/biases travel with their weight
                yield from self._stored(path)
        elif (
            self.spec is not None
            and leaf == "weight"
            and is_matrix(path)
            and t.data.ndim in (2, 3)  # a matrix, or stacked experts (E, out, in)
        ):
            yield from self._dense(path, t)
        else:
            yield name, t

    def _dense(self, path: str, t: Tensor):
        if t.shape[-1] % self.spec.group_size:
            self.notes.append(
                f"{path} stays unquantized: its input size {t.shape[-1]} is not a "
                f"multiple of the group size {self.spec.group_size}"
            )
            self.block[path] = False
            yield f"{path}.weight", t
            return
        yield from _quantize(path, t, self.spec)

    def _stored(self, path: str):
        from mlxrun.quant.formats import layer_spec, to_config  # noqa: PLC0415

        have = layer_spec(self.qconfig or {}, path)
        if have is None:
            raise MlxrunError(
                f"{path} is stored quantized but config.json has no quantization block for it"
            )
        w, s, b = (self.t.get(f"{path}.{k}") for k in ("weight", "scales", "biases"))
        _check_packed(path, w, s, b, have)
        q = self.spec
        if not self.dense:
            same = q is not None and (q.mode, q.bits) == (have.mode, have.bits)
            if q is None or same and (q == have or not self.group_asked):
                if q is not None:
                    self.kept += 1
                    if have != q:  # kept with its own group size
                        self.block[path] = to_config(have)
                yield from (
                    (f"{path}.{k}", x)
                    for k, x in (("weight", w), ("scales", s), ("biases", b))
                    if x is not None
                )
                return
        try:
            x = stored_dense(w, s, b, have)  # this one layer, float32 [out, in]
        except (ValueError, TypeError) as e:
            raise MlxrunError(
                f"{path}: the stored tensors do not match config.json's quantization "
                f"({have.label} g{have.group_size}): {e}"
            ) from None
        dense = _as_dtype(x, self.float_name)
        if self.dense:
            self.expanded += 1
            yield f"{path}.weight", dense
            return
        self.requantized += 1
        self.sources.add(f"{have.label} g{have.group_size}")
        yield from self._dense(path, dense)

    def summary(self) -> list[str]:
        out = []
        q = self.spec
        if self.kept:
            out.append(f"{self.kept} stored layer(s) already are {q.label}: copied without change")
        if self.requantized:
            out.append(
                f"re-quantized {self.requantized} layer(s) from a quantized source "
                f"({', '.join(sorted(self.sources))}) to {q.label} g{q.group_size}: the "
                "rounding errors add up; convert the full-precision checkpoint for the best "
                "quality"
            )
        if self.expanded:
            out.append(f"--quant none: dequantized {self.expanded} stored layer(s)")
        return out + self.notes


class _Calibrated:
    """The tensors and quantization block of a calibrated quantization, as a plan."""

    def __init__(self, tensors: dict[str, Tensor], block: dict, notes: list[str]):
        self.t, self.block, self.notes = tensors, block, notes

    def __len__(self) -> int:
        return len(self.t)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.t.items())

    def summary(self) -> list[str]:
        return self.notes


def _calibrated(ckpt: Checkpoint, spec, opts, backend: str, progress: bool) -> _Calibrated:
    from mlxrun.quant.calibrate import calibrate  # noqa: PLC0415

    from .dense import dense_checkpoint  # noqa: PLC0415

    notes = []
    if ckpt.config.quantization:
        notes.append(
            "the source is stored quantized: calibrated from its dequantized weights (the "
            "rounding errors add up; the full-precision checkpoint gives the best quality)"
        )
    tensors, block, more = calibrate(dense_checkpoint(ckpt), spec, opts, backend, progress)
    return _Calibrated(tensors, block, notes + more)


def _write_shards(tmp: Path, items, shard_bytes: int, progress: bool) -> None:
    """Write (name, Tensor) pairs as shards of at most `shard_bytes` (a larger single
    tensor gets a shard of its own), mlx-lm's names, an index when there are several."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    # Each shard is written as soon as it is full, so at most one shard of converted
    # tensors is held in memory; names are fixed once the count is known.
    parts: list[tuple[Path, list[str], int]] = []
    shard: dict[str, Tensor] = {}
    size = 0

    def flush():
        nonlocal shard, size
        part = tmp / f".part-{len(parts)}.safetensors"
        save_safetensors(part, shard, {"format": "mlx"})
        parts.append((part, list(shard), size))
        shard, size = {}, 0

    bar = tqdm(items, total=len(items), desc="converting", unit="tensor", disable=not progress)
    for name, t in bar:
        if shard and size + t.nbytes > shard_bytes:
            flush()
        shard[name] = t
        size += t.nbytes
    bar.close()
    if shard or not parts:
        flush()
    if len(parts) == 1:
        os.replace(parts[0][0], tmp / "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, (part, names, nbytes) in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(part, tmp / fname)
        weight_map.update(dict.fromkeys(names, fname))
        total += nbytes
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def _legacy_rope(config: dict) -> None:
    """Spell transformers 5's `rope_parameters` also as `rope_theta` / `rope_scaling`, as the
    published checkpoints do: mlx-lm reads only those, and without them it would run a YaRN
    or llama3-scaled model with plain rope, without a word. (Gemma 3's per-layer-type
    parameters have no legacy spelling and stay as they are.)"""
    rp = config.get("rope_parameters")
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        return
    config.setdefault("rope_theta", rp["rope_theta"])
    if rp.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", {k: v for k, v in rp.items() if k != "rope_theta"})


def convert(
    model: str,
    out_dir: str,
    quant: str | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    progress: bool = True,
    shard_bytes: int = SHARD_BYTES,
    calibrate=None,
    backend: str = "cpu",
) -> list[str]:
    """Write `model` to `out_dir` (new, or an empty directory): quantized to `quant` (int4, int8, fp8,
    fp4, nvfp4; 'none' dequantizes a quantized source; None keeps what is stored), in
    safetensors shards of at most `shard_bytes`. Returns notes for the user.

    The files are written under `.NAME.partial-PID` beside `out_dir` and renamed at the
    end; such directories left by killed runs are removed first (`clean_stale_partials`).
    calibrate: a `mlxrun.quant.calibrate.CalibOptions` to quantize with a calibrated method
    (AWQ, GPTQ) instead of rounding to nearest, running the layers on `backend`; a
    quantized source is dequantized first."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlxrunError(f"{out} already exists and is not empty; choose a new directory")
    spec = None
    dense = quant is not None and quant.strip().lower() == "none"
    if quant is not None and not dense:
        from mlxrun.quant.formats import resolve  # noqa: PLC0415

        spec = resolve(quant, group_size=group_size, bits=bits)
    elif group_size is not None or bits is not None:
        raise MlxrunError("--group-size and --bits refine --quant; give --quant too")
    if calibrate is not None and spec is None:
        raise MlxrunError("--calibrate needs --quant (int4, fp4, ...): it chooses how to round")
    ckpt = open_checkpoint(model)
    if calibrate is not None:
        plan = _calibrated(ckpt, spec, calibrate, backend, progress)
    else:
        plan = _Plan(ckpt, spec, dense, group_size is not None)
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = clean_stale_partials(out.parent)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise MlxrunError(f"cannot write to {out.parent}: {e.strerror}") from None
    try:
        _write_shards(tmp, plan, shard_bytes, progress)
        config = dict(ckpt.raw_config)  # no --quant: the checkpoint's own block, as is
        if plan.block is None and "quant_method" in (config.get("quantization_config") or {}):
            # a transformers format read as one of MLX's (gpt-oss's mxfp4): written as MLX's
            config["quantization"] = config["quantization_config"] = ckpt.config.quantization
        if plan.block is not None or dense:
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        if plan.block is not None:
            config["quantization"] = config["quantization_config"] = plan.block
        _legacy_rope(config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name, text in ckpt.tokenizer_files.items():
            (tmp / name).write_text(text)
        if ckpt.generation_config:
            (tmp / "generation_config.json").write_text(
                json.dumps(ckpt.generation_config, indent=2)
            )
        if out.exists():
            out.rmdir()  # empty (checked above); rmdir refuses if it has filled since
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MlxrunError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stale + ckpt.notes + plan.summary()
