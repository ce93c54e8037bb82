"""The benchmark instrument behind `mlxrun bench`: per backend and weight format, load time,
time to first token, prefill and decode speed, peak memory, and the fraction of the memory
roofline that batch decode reaches.

Decode is memory-bound, so its ceiling is (copy bandwidth) / (bytes read per token). Both
numbers come from this run: the bandwidth from a large device-to-device copy timed here (bytes
read + bytes written), the bytes from the model's actual arrays (every weight once per step,
packed words, scales and biases included; an untied embedding by the rows it gathers; the KV
cache at the mean context length). roofline = decode tok/s x bytes/token / bandwidth.

Models: anything `mlxrun.load` takes, or `shape:NAME`, a real model's shapes with random
weights made on the device (no host copy), for speed runs of models we do not download.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from . import bench_mlxlm
from .bench_hf import _bench_hf, _PeerLoadError
from .bench_models import (
    KQUANT_MIXES,
    KQuantMix,
    _arrays,
    _dequantized,
    _layer_arrays,
    _open_source,
    _Source,
    _weights_label,
    build_random,
    mean_context,
)
from .bench_models import SHAPE_PREFIX as SHAPE_PREFIX
from .bench_models import kv_read_bytes as kv_read_bytes
from .bench_models import shape_config as shape_config
from .bench_models import weight_bytes as weight_bytes
from .bench_report import (
    BenchReport,
    BenchRow,
    Skipped,
    _config_summary,
    _environment,
    _matplotlib,
    _roofline,
    plot_report,
    write_json,
)
from .bench_report import format_report as format_report
from .bench_timing import (
    _bench_model,
    _device_key,
    _release,
    _Run,
    _short_device,
    measure_bandwidth,
)
from .errors import MlxrunError
from .memory import prefill_chunk_for
from .sampling import SamplingParams

COMPARE = ("transformers", "mlx-lm")


# --- rows ----------------------------------------------------------------------------------


def sampling_label(p: SamplingParams) -> str:
    """The setting as bench prints it: greedy, or the options that differ from the defaults."""
    if p.greedy:
        return "greedy"
    parts = [f"temp {p.temperature:g}"]
    parts += [f"top-p {p.top_p:g}"] if p.top_p < 1 else []
    parts += [f"top-k {p.top_k}"] if p.top_k else []
    parts += [f"min-p {p.min_p:g}"] if p.min_p else []
    parts += [f"rep-pen {p.repetition_penalty:g}"] if p.repetition_penalty != 1 else []
    return " ".join(parts)


def _bench_mlxrun(
    run: _Run, src: _Source, name: str, be, qname: str, spec, dtype, mlx_lm: bool = False
) -> list[BenchRow]:
    """Load (or build) the model on `be` in format `qname`, and measure it: greedy, and
    with the run's sampling setting too where it has one (a row each, same loaded model);
    with `mlx_lm` (MLX backend, batch 1), also mlx-lm's greedy generate on the same arrays,
    reps alternating with ours."""
    from mlxrun.quant.formats import from_config  # noqa: PLC0415

    from .api import load  # noqa: PLC0415

    run.say(f"{be.name}:{be.device} {qname}: loading")
    notes: list[str] = []
    how = ""
    t0 = time.perf_counter()
    if src.shape:
        from .distributed import join  # noqa: PLC0415
        from .shard import check, shard_config, vocab_shard  # noqa: PLC0415

        group = join(be)  # under a launcher each rank builds its shard only
        tp, rank = (1, 0) if group is None else (group.size, group.rank)
        check(src.config, tp, set() if spec is None else {spec.group_size})
        vocab = vocab_shard(src.config, tp, rank)
        model = build_random(shard_config(src.config, tp), be, spec, vocab=vocab)
        be.synchronize()
        load_s = time.perf_counter() - t0
    else:
        stored = src.stored is not None
        # A stored-quantized checkpoint loads as stored; `none` then expands it (below).
        m = load(
            src.model, backend=name, dtype=dtype, quant=None if stored else qname, progress=False
        )
        model, notes = m.transformer, list(m.notes)
        # MLX converts dtypes lazily: finish every weight so load time is all of it.
        t1 = time.perf_counter()
        model.be.eval(*_arrays(model.embed, model.norm, model.head))
        for L in model.layers:
            model.be.eval(*_arrays(*_layer_arrays(L)))
        if stored:
            how = "stored"
            if spec is None:
                how = f"dequantized from stored {_weights_label(model)}"
                model = _dequantized(model)
            elif spec.group_size != from_config(src.stored).group_size:
                notes.append(
                    f"runs the stored group size {from_config(src.stored).group_size}, not "
                    f"{spec.group_size}: re-quantizing stored weights would round them twice"
                )
        model.be.synchronize()
        load_s = m.load_time + time.perf_counter() - t1
        del m
    peer = None
    if mlx_lm:
        t1 = time.perf_counter()
        mlm = bench_mlxlm.mlx_lm_model(model)
        peer_load_s = load_s + time.perf_counter() - t1

        def peer(prompt, gen):
            return bench_mlxlm.run_once(mlm, prompt, gen)

    rows = []
    label = _weights_label(model, how)
    settings = [SamplingParams()] + ([] if run.sampling.greedy else [run.sampling])
    from .kvquant import kv_label  # noqa: PLC0415

    for params, kv in [(p, kv) for p in settings for kv in run.kv_quants]:
        mode = sampling_label(params)
        model.kv_quant = kv
        theirs = peer if params.greedy and kv is None else None  # mlx-lm's row: greedy, plain
        also = " (and mlx-lm, alternating)" if theirs else ""
        what = f"{qname} {mode}" + ("" if kv is None else f" kv-{kv}")
        run.say(f"{be.name}:{be.device} {what}: timing {run.reps} x {run.gen_tokens}{also}")
        fields, peer_fields = _bench_model(run, model, params, theirs)
        rows.append(
            BenchRow(
                engine="mlxrun",
                backend=name,
                device=_short_device(model.be),
                quant=qname,
                weights=label,
                load_s=load_s,
                notes=notes,
                sampling=mode,
                kv_quant=kv_label(kv),
                **fields,
            )
        )
        if peer_fields is not None:
            rows.append(
                BenchRow(
                    engine="mlx-lm",
                    backend="mlx-lm",
                    device=_short_device(model.be),
                    quant=qname,
                    weights=label,
                    load_s=peer_load_s,  # ours, plus building mlx-lm's model on the same arrays
                    description=f"mlx-lm {bench_mlxlm.version()} generate_step on mlxrun's arrays",
                    **peer_fields,
                )
            )
    return rows


# --- the run -------------------------------------------------------------------------------


def _check_args(backends, quants, prompt_tokens, gen_tokens, batch, reps, compare, paths):
    if reps < 1:
        raise MlxrunError(f"--reps must be at least 1, got {reps}")
    if gen_tokens < 2:
        raise MlxrunError(f"--gen-tokens must be at least 2 to time decoding, got {gen_tokens}")
    if prompt_tokens < 1:
        raise MlxrunError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    if batch < 1:
        raise MlxrunError(f"--batch must be at least 1, got {batch}")
    if not backends:
        raise MlxrunError("--backends is empty: name at least one of mlx, cpu, cuda, mps")
    if not quants:
        raise MlxrunError("--quant is empty: name at least one format, e.g. none,int4")
    for c in compare:
        if c not in COMPARE:
            raise MlxrunError(f"--compare {c!r} is not supported: use {', '.join(COMPARE)}")
    for p in paths:
        if p is not None and not Path(p).expanduser().resolve().parent.is_dir():
            raise MlxrunError(f"{p}: its directory does not exist; create it first")


def _quant_specs(quants: list[str]) -> dict:
    from mlxrun.quant.formats import resolve  # noqa: PLC0415

    specs = {}
    for q in quants:
        key = q.strip().lower()
        if key == "auto":
            raise MlxrunError("--quant auto is not measurable: list formats, e.g. none,int4,fp8")
        if key in KQUANT_MIXES:
            specs[key] = KQuantMix(key)
            continue
        specs[key] = None if key == "none" else resolve(key)
    return specs


def run_bench(
    model: str,
    backends: list[str],
    quants: list[str],
    *,
    prompt_tokens: int = 512,
    gen_tokens: int = 128,
    batch: int = 1,
    reps: int = 5,
    compare: list[str] | tuple[str, ...] = (),
    json_path: str | os.PathLike | None = None,
    plot_path: str | os.PathLike | None = None,
    dtype: str | None = None,
    progress: bool = True,
    sampling: SamplingParams | None = None,
    kv_quants: list[str | None] | None = None,
) -> BenchReport:
    """Measure `model` on each backend in each weight format; returns the report (and writes
    the JSON / PNG when paths are given).

    model: anything `mlxrun.load` takes, or `shape:llama3-8b` / `shape:llama3-1b` /
    `shape:smollm2` / `shape:tiny` (random weights made on the device). backends: mlx, cpu,
    cuda, mps (auto allowed); those that cannot run here are listed in `report.skipped`.
    quants: none, int4, int8, fp8, fp4, nvfp4; a checkpoint stored quantized (GGUF Q4_1,
    an MLX 4-bit model) runs dequantized to the compute dtype under `none`, as stored under
    its own format (int4 for affine 4-bit, whatever its group size), and skips the others.
    compare: "transformers" adds HF generate() on the first torch device listed; "mlx-lm"
    adds mlx-lm's generate_step beside each mlx row, on the same arrays (batch 1). The
    prompt is batch x prompt_tokens random ids; decoding is greedy for gen_tokens tokens,
    after one untimed warm-up generation. A non-greedy `sampling` adds a row of each
    mlxrun backend and format decoding with it (seeded), beside its greedy row.
    kv_quants: KV-cache formats (None, 'int8', 'fp8'), a row each per backend and format;
    the roofline counts the KV bytes as the format stores them.
    """
    from mlxrun.backends import get_backend, resolve_backend_name  # noqa: PLC0415

    _check_args(
        backends, quants, prompt_tokens, gen_tokens, batch, reps, compare, (json_path, plot_path)
    )
    if plot_path is not None:
        _matplotlib()  # fail before the run, not after it
    names = list(dict.fromkeys(resolve_backend_name(b.strip().lower()) for b in backends))
    specs = _quant_specs(quants)
    src = _open_source(model)
    if "mlx" in names:
        from .kvquant import check_head_dim  # noqa: PLC0415

        for kv in kv_quants or []:
            check_head_dim(kv, src.config.head_dim, "mlx")
    run = _Run(prompt_tokens, gen_tokens, batch, reps, progress, sampling or SamplingParams(),
               list(kv_quants or [None]))  # fmt: skip
    rows: list[BenchRow] = []
    skipped: list[Skipped] = []
    bandwidth: dict[str, dict] = {}
    torch_be = None
    chunks: dict[str, int] = {}
    # mlx-lm runs beside each MLX row, on its arrays; its generate_step takes one sequence.
    peer_mlx = ("mlx",) if "mlx-lm" in compare and batch == 1 else ()
    if "mlx-lm" in compare:
        if batch > 1:
            skipped.append(Skipped("mlx-lm", "*", "mlx-lm's generate_step runs batch 1 only"))
        elif "mlx" not in names:
            skipped.append(
                Skipped("mlx-lm", "*", "it runs on the mlx backend: add mlx to --backends")
            )
        elif (why := bench_mlxlm.unavailable()) is not None:
            skipped.append(Skipped("mlx-lm", "*", why))
            peer_mlx = ()
    for name in names:
        try:
            be = get_backend(name, dtype)
        except MlxrunError as e:
            skipped.append(Skipped(name, "*", str(e)))
            continue
        chunks[name] = prefill_chunk_for(be.name, be.memory_kind, batch)
        if be.name == "torch" and torch_be is None:
            torch_be = be
        key = f"{be.name}:{be.device}"
        if key not in bandwidth:
            run.say(f"{key}: measuring copy bandwidth")
            trials = measure_bandwidth(be)
            bandwidth[key] = dict(
                memory=_device_key(be), median_Bps=statistics.median(trials), trials_Bps=trials
            )
        for qname, spec in specs.items():
            why = _mix_skip(src, be, spec) if isinstance(spec, KQuantMix) else None
            why = why or _stored_skip(src, spec)
            if why is not None:
                skipped.append(Skipped(name, qname, why))
                continue
            try:
                rows += _bench_mlxrun(run, src, name, be, qname, spec, dtype, be.name in peer_mlx)
            except MlxrunError as e:
                skipped.append(Skipped(name, qname, str(e)))
            _release(be)
    if not rows:
        why = "; ".join(f"{s.backend} {s.quant}: {s.reason}" for s in skipped)
        raise MlxrunError(f"nothing could be measured here ({why})")
    if "transformers" in compare:
        if torch_be is None:
            skipped.append(
                Skipped(
                    "transformers",
                    "none",
                    "no torch backend (cpu, cuda, mps) ran; add cpu to --backends",
                )
            )
        elif src.stored is not None and not src.source.endswith(".gguf"):
            skipped.append(
                Skipped(
                    "transformers", "none", "transformers cannot load MLX-quantized checkpoints"
                )
            )
        else:
            try:
                rows.append(_bench_hf(run, src, torch_be))
            except _PeerLoadError as e:
                skipped.append(Skipped("transformers", "none", str(e)))
    _roofline(rows, bandwidth)
    report = BenchReport(
        model=model,
        source=src.source,
        config=_config_summary(src.config),
        settings=dict(
            prompt_tokens=prompt_tokens,
            gen_tokens=gen_tokens,
            batch=batch,
            reps=reps,
            prefill_chunk=chunks,  # per backend: its prefill chunk (tokens)
            dtype=dtype,
            mean_context=mean_context(prompt_tokens, gen_tokens),
            sampling=sampling_label(run.sampling),
        ),
        rows=rows,
        skipped=skipped,
        bandwidth=bandwidth,
        environment=_environment(),
    )
    if json_path is not None:
        write_json(report, json_path)
    if plot_path is not None:
        plot_report(report, plot_path)
    return report


def _mix_skip(src: _Source, be, spec: KQuantMix) -> str | None:
    """Why a K-quant mix cannot run here: it lays out a shape: model's random weights, for
    a backend with the K-quant kernels."""
    if not src.shape:
        return (
            f"{spec.name} lays out the random weights of a shape: model; a .gguf file runs "
            "its own types as stored (--quant none)"
        )
    if "Q4_K" not in be.gguf_blocks:
        return f"{spec.name} runs on the K-quant kernels of --backends cuda"
    return None


def _stored_skip(src: _Source, spec) -> str | None:
    """Why format `spec` cannot run on a checkpoint stored quantized; None where it can:
    `none` (dequantized) and the stored format itself (as stored)."""
    from mlxrun.quant.formats import USER_FORMATS, from_config  # noqa: PLC0415

    if src.stored is None or spec is None:
        return None
    st = from_config(src.stored)
    if (st.mode, st.bits) == (spec.mode, spec.bits):
        return None
    name = next(
        (k for k, v in USER_FORMATS.items() if (v.mode, v.bits) == (st.mode, st.bits)), None
    )
    runs = f"it runs as stored under {name} and " if name else "it runs "
    return (
        f"the checkpoint is stored quantized ({st.mode} {st.bits}-bit g{st.group_size}): {runs}"
        f"dequantized under none; re-quantizing it to {spec.label} would round the weights twice"
    )
