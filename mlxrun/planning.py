"""`mlxrun plan` / `mlxrun.plan()`: what fits where, from config.json and checkpoint
headers only (no tensor data is read for safetensors checkpoints)."""

from __future__ import annotations

from .config import ModelConfig
from .errors import MlxrunError
from .memory import Plan, footprint, header_shapes, make_plan, probe_device

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def backend_device(backend: str) -> tuple[str, str, str]:
    """--backend value -> (backend name, device, default dtype), without loading a model."""
    from mlxrun.backends import get_backend  # noqa: PLC0415

    be = get_backend(backend)
    return be.name, be.device, be.dtype


def model_shapes(model: str) -> tuple[ModelConfig, dict]:
    """(config, {tensor: (shape, dtype)}) of any model source, or of `shape:NAME` (the
    shapes `mlxrun bench` builds random weights of, bfloat16)."""
    from .loader import _read_json, resolve_source  # noqa: PLC0415

    if model.startswith("shape:"):
        from .bench import shape_config  # noqa: PLC0415
        from .memory import config_shapes  # noqa: PLC0415

        cfg = shape_config(model)
        return cfg, config_shapes(cfg)

    path = resolve_source(model)
    if path.is_file():  # GGUF: the importer's tensors carry their canonical shapes
        from .gguf import read_gguf  # noqa: PLC0415

        g = read_gguf(path)
        return ModelConfig.from_dict(g.config), {
            n: (t.shape, t.dtype) for n, t in g.tensors.items()
        }
    if not (path / "config.json").exists():
        raise MlxrunError(
            f"{path} has no config.json; point --model at a Hugging Face model "
            "directory, a .gguf file or a Hub repo id"
        )
    return ModelConfig.from_dict(_read_json(path / "config.json")), header_shapes(path)


def plan_shapes(
    cfg: ModelConfig,
    shapes: dict,
    spec,
    backend: str,
    dtype: str | None,
    context: int | None,
    batch: int,
    prefill_chunk: int | None = None,
    mapped: bool = False,
    prompt_tokens: int | None = None,
    kv_quant: str | None = None,
) -> Plan:
    """The plan for a model given its config and {tensor: (shape, dtype)}; `mapped`: the
    weights load from a memory-mapped safetensors directory (counts toward loading's peak);
    `prompt_tokens`: the longest prompt, where known (see make_plan); `kv_quant`: the KV
    cache's format (int8, fp8; None: the compute dtype)."""
    from .kvquant import kv_footprint  # noqa: PLC0415

    name, device, default_dtype = backend_device(backend)
    dtype = dtype or default_dtype
    dev = probe_device(name, device)
    fp = kv_footprint(footprint(cfg, shapes, dtype, spec, name), cfg, kv_quant, name)
    return make_plan(
        cfg,
        fp,
        dev,
        context=cfg.context_length if context is None else context,
        batch=batch,
        prefill_chunk=prefill_chunk,
        dtype_bytes=_DTYPE_BYTES[dtype],
        backend=name,
        mapped=mapped,
        prompt_tokens=prompt_tokens,
    )


def plan(
    model: str = "smollm2",
    quant: str | None = None,
    context: int | None = None,
    batch: int = 1,
    backend: str = "auto",
    dtype: str | None = None,
    prefill_chunk: int | None = None,
    prompt_tokens: int | None = None,
    tp: int = 1,
    kv_quant: str | None = None,
) -> Plan:
    """Plan `batch` sequences of `context` tokens (default: the model's maximum) of `model`
    on the device `backend` selects, `prompt_tokens` of them the prompt (default: all: the
    prefill workspace is the prompt's); see mlxrun.memory.Plan for the fields.

    tp: plan one rank of the model split over `tp` processes (mlxrun.shard), each on a
    device like this one; MlxrunError, naming the counts that work, when it does not split.
    kv_quant: int8 or fp8 counts the KV cache quantized (scales included).
    """
    args = (model, quant, context, batch, backend, dtype, prefill_chunk, prompt_tokens, tp)
    return plan_config(*args, kv_quant=kv_quant)[0]


def plan_config(
    model: str = "smollm2",
    quant: str | None = None,
    context: int | None = None,
    batch: int = 1,
    backend: str = "auto",
    dtype: str | None = None,
    prefill_chunk: int | None = None,
    prompt_tokens: int | None = None,
    tp: int = 1,
    kv_quant: str | None = None,
) -> tuple[Plan, ModelConfig]:
    """`plan`, and the config it planned (one rank's, with `tp`)."""
    from .kvquant import check_head_dim, parse_kv_quant  # noqa: PLC0415

    kv_quant = parse_kv_quant(kv_quant)
    spec = None
    if quant not in (None, "none"):
        from mlxrun.quant.formats import resolve  # noqa: PLC0415

        spec = resolve(quant)
    from .loader import resolve_source  # noqa: PLC0415

    cfg, shapes = model_shapes(model)
    mapped = not model.startswith("shape:") and resolve_source(model).is_dir()
    if tp != 1:
        from .build import target_spec  # noqa: PLC0415
        from .shard import check, shard_config, shard_shapes, stored_groups  # noqa: PLC0415

        groups = stored_groups(cfg, shapes)
        if spec is not None:
            groups.add(target_spec(spec, cfg.quantization, group_asked=True).group_size)
        check(cfg, tp, groups)
        cfg, shapes = shard_config(cfg, tp), shard_shapes(shapes, tp, cfg)
    check_head_dim(kv_quant, cfg.head_dim, backend_device(backend)[0])
    p = plan_shapes(
        cfg, shapes, spec, backend, dtype, context, batch, prefill_chunk, mapped, prompt_tokens,
        kv_quant,
    )  # fmt: skip
    return p, cfg
