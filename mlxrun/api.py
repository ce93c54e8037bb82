"""The Python API: `mlxrun.load(...)` returns a Model with generate / stream / logits.

This module finds, checks and builds the model (`load`); the Model class it returns, and
what it does with prompts, is in `mlxrun.api_model` (and importable from here)."""

from __future__ import annotations

import time
from typing import Any

from .api_model import Model, _api_names
from .errors import MlxrunError


@_api_names
def load(
    model: str = "smollm2",
    backend: str = "auto",
    dtype: str | None = None,
    quant: str | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    progress: bool = True,
    check_memory: bool = True,
    check_weights: bool = True,
    fastest: bool = False,
    kv_quant: str | None = None,
) -> Model:
    """Load a model: a local directory, a .gguf file, a Hugging Face repo id, or an alias
    ('smollm2' bundled, 'llama'). backend: auto | mlx | cuda | mps | cpu.

    With `check_memory`, a model that cannot fit (weights + KV for one 2048-token sequence)
    is refused before its weights are moved to the device. With `check_weights`, a weight
    holding NaN or inf is refused, naming the tensor (a pass over the weights' bytes on the
    host as they are copied; False skips it). With `fastest` and no `quant`, a packed
    checkpoint is expanded where the device profile says dense runs faster (PyTorch on the
    CPU: no packed kernel), if it fits; without it the weights load as stored.
    kv_quant: 'int8' or 'fp8' keeps the KV cache quantized (mlxrun/kvquant.py); None or
    'none' keeps it in the compute dtype."""
    from mlxrun.backends import get_backend  # noqa: PLC0415

    from .distributed import join  # noqa: PLC0415
    from .kvquant import parse_kv_quant  # noqa: PLC0415

    t0 = time.perf_counter()
    kv = parse_kv_quant(kv_quant)  # a bad name fails before anything is loaded
    be = get_backend(backend, dtype)
    group = join(be)  # under torchrun / mlx.launch: this process loads one shard
    args = (model, be, quant, group_size, bits, progress, check_memory, check_weights, fastest)
    args += (group, t0, kv)
    if group is None:
        return _load(*args)
    try:
        m, error = _load(*args), None
    except MlxrunError as e:
        m, error = None, str(e)
    error = group.agree(error)  # a failure on any rank ends them all, with its message
    if error is not None:
        raise MlxrunError(error)
    return m


def _load(
    model, be, quant, group_size, bits, progress, check_memory, check_weights, fastest, group, t0,
    kv=None,
) -> Model:  # fmt: skip
    from mlxrun.quant.formats import resolve  # noqa: PLC0415

    from .build import build_model, target_spec  # noqa: PLC0415
    from .kvquant import check_head_dim  # noqa: PLC0415
    from .loader import open_checkpoint  # noqa: PLC0415
    from .memory import check_fits  # noqa: PLC0415
    from .planning import plan_shapes  # noqa: PLC0415
    from .shard import check, shard_config, vocab_shard  # noqa: PLC0415

    where = "mlx" if be.name == "mlx" else be.device
    tp = 1 if group is None else group.size
    ckpt = open_checkpoint(model, None if tp == 1 else (tp, group.rank), be.gguf_blocks)
    cfg, tensors = ckpt.config, ckpt.tensors  # the tensors: this rank's slices
    check_head_dim(kv, cfg.head_dim, be.name)
    rank_cfg = shard_config(cfg, tp)  # this rank's heads, KV heads and MLP rows
    shapes = {n: _planned(t) for n, t in tensors.items()}
    ctx = min(cfg.max_position_embeddings, 2048)
    packed = any(n.endswith(".scales") for n in shapes)

    def plan_for(s):  # one 2048-token sequence: what loading must leave room for
        return plan_shapes(rank_cfg, shapes, s, where, be.dtype, ctx, 1, kv_quant=kv)

    def dense_fits() -> bool:  # the packed checkpoint expanded to the compute dtype
        p = plan_for(None)
        fp = p.footprint
        return p.total_bytes + fp.dense_weight_bytes - fp.weight_bytes <= p.budget_bytes

    key = None if quant is None else quant.strip().lower()
    auto_note = []
    if key == "auto":
        from mlxrun.quant.profiles import resolve_auto  # noqa: PLC0415

        def fits(fmt: str) -> bool:
            return plan_for(None if fmt == "none" else resolve(fmt, group_size, bits)).fits

        key, why = resolve_auto(be.name, be.device, fits=fits)
        # "none" from auto keeps the checkpoint as it is stored (packed stays packed).
        auto_note.append(f"--quant auto: {key} ({why})")
        if key == "none" and not (packed and dense_fits()):
            key = None  # a packed checkpoint stays packed when its dense copy cannot fit
    elif key is None and packed and fastest:
        from mlxrun.quant.profiles import match_profile  # noqa: PLC0415

        try:
            dense_first = match_profile(be.name, be.device).auto == "none"
        except MlxrunError:  # the device could not be probed: keep the weights as stored
            dense_first = False
        if dense_first and dense_fits():
            # This device reads dense weights faster than it expands packed ones per call.
            key = "none"
            auto_note.append(
                f"the checkpoint's packed weights are expanded to {be.dtype} on load: "
                f"{be.describe()} has no packed kernel and reads dense weights faster "
                "(--quant auto says why; --quant int4 keeps 4-bit layers packed)"
            )
    spec = None if key in (None, "none") else resolve(key, group_size=group_size, bits=bits)
    if tp > 1 and spec is not None:  # quantized here: a rank's o/down inputs, whole groups
        check(cfg, tp, {target_spec(spec, cfg.quantization, group_size is not None).group_size})
    auto_note += _known_bad(be, be.dtype, spec, cfg.quantization if packed else None)
    if check_memory:  # refuse before anything large is allocated
        check_fits(plan_for(spec))
    transformer, notes = build_model(
        rank_cfg,
        tensors,
        be,
        spec,
        progress=progress,
        dense=key == "none",
        group_asked=group_size is not None,
        check_weights=check_weights,
        vocab=None if tp == 1 else vocab_shard(cfg, tp, group.rank),
    )
    transformer.kv_quant = kv
    _reply_format(ckpt.tokenizer, cfg.model_type)
    notes = ckpt.notes + auto_note + notes
    if spec is not None:  # a quantized source keeps its group size when none was asked
        spec = target_spec(spec, ckpt.config.quantization, group_size is not None)
    be.synchronize()
    m = Model(
        transformer, ckpt.tokenizer, ckpt.source, notes, time.perf_counter() - t0, shapes, spec
    )
    m.expanded = packed and key == "none"
    return m


def _reply_format(tokenizer, model_type: str) -> None:
    """A model whose replies are written in special tokens (gpt-oss's harmony channels)
    keeps them in its generated text, and ends on each token that ends a reply."""
    from .tools import MARKUP, parser_name  # noqa: PLC0415

    fmt = parser_name(tokenizer.chat_template, model_type)
    if fmt in MARKUP:
        tokenizer.keep_markup(MARKUP[fmt])


def _planned(t) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of a tensor for the memory planner: GGUF blocks kept as stored count
    as their block type over the logical [out, in] (model_footprint.GGUF_HELD)."""
    if t.block is None:
        return t.shape, t.dtype
    from mlxrun.quant.gguf_blocks import BLOCKS  # noqa: PLC0415

    nbytes, per = BLOCKS[t.block]
    return (t.shape[0], t.shape[1] // nbytes * per), t.block


# (mode, bits) of a stored format -> its --quant name
_FORMAT_NAMES = {("affine", 4): "int4", ("affine", 8): "int8", ("mxfp8", 8): "fp8",
                 ("mxfp4", 4): "fp4", ("nvfp4", 4): "nvfp4"}  # fmt: skip


def _known_bad(be: Any, dtype: str | None, spec: Any, stored: dict | None) -> list[str]:
    """One-line warnings for choices known to lose accuracy or to run slowly here."""
    out = []
    if spec is not None and stored:
        have = (stored.get("mode", "affine"), int(stored.get("bits", 4)))
        if have != (spec.mode, spec.bits):
            name = _FORMAT_NAMES.get(have, f"{have[0]} {have[1]}-bit")
            out.append(
                f"warning: --quant {_FORMAT_NAMES.get((spec.mode, spec.bits), spec.mode)} "
                f"re-quantizes weights already stored as {name}: they are rounded twice and "
                f"lose accuracy; use --quant {name} (kept as stored) or --quant none, or "
                "start from an unquantized checkpoint"
            )
    if be.name == "mlx" and be.device == "cpu" and dtype in ("bfloat16", "float16"):
        out.append(
            f"warning: --dtype {dtype} on MLX's CPU runs several times slower than float32 "
            "(its CPU kernels are fast in fp32 only); drop --dtype"
        )
    return out
