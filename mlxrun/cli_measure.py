"""`mlxrun plan | eval | devices | bench`: what a model needs, what quantization costs,
what the machine has, and how fast it runs."""

from __future__ import annotations

import dataclasses
import sys

import click

from .cli_io import check_writable, emit_json
from .cli_options import (
    batch_option,
    bits_option,
    draft_option,
    dtype_option,
    json_option,
    kv_quant_option,
    min_p_option,
    model_options,
    num_draft_option,
    top_k_option,
    top_p_option,
)
from .errors import MlxrunError


@click.command()
@model_options
@click.option("--quant", default=None, help="Plan for this quantization (int4, fp8, ...).")
@click.option(
    "--context",
    type=int,
    default=None,
    help="Tokens per sequence (prompt + generation) [default: the model's maximum].",
)
@batch_option
@click.option(
    "--prompt-tokens",
    type=int,
    default=None,
    help="Tokens of the context that are prompt, prefilled at once [default: all of it]; "
    "PyTorch on the CPU plans the whole context's workspace whatever this says.",
)
@click.option(
    "--tp",
    type=int,
    default=1,
    show_default=True,
    help="Plan one rank of the model split over this many processes (tensor parallel).",
)
@kv_quant_option
@json_option
def plan(model, backend, dtype, quant, context, batch, prompt_tokens, tp, kv_quant, json_out):
    """Show what the model needs in memory and what fits, without loading the weights.
    --model also takes shape:llama3-8b, shape:llama3-1b, shape:smollm2 (bench's shapes)."""
    from .memory import EAGER, format_plan  # noqa: PLC0415
    from .planning import plan_config  # noqa: PLC0415

    p, c = plan_config(
        model,
        quant=quant,
        context=context,
        batch=batch,
        backend=backend,
        dtype=dtype,
        prompt_tokens=prompt_tokens,
        tp=tp,
        kv_quant=kv_quant,
    )
    if tp > 1:
        from .shard import vocab_shard  # noqa: PLC0415

        v = vocab_shard(c, tp, 0)  # the rank's config keeps the whole vocabulary
        table = "embedding and head on every rank" if v is None else (
            f"{v.rows} vocabulary rows of the embedding and head"
        )  # fmt: skip
        click.echo(
            f"tensor parallel over {tp} ranks; each rank below: {c.num_attention_heads} heads, "
            f"{c.num_key_value_heads} KV heads, {c.intermediate_size} MLP rows, {table} "
            "(norms on every rank)"
        )
    if prompt_tokens is not None and (p.backend, p.device.kind) in EAGER:
        click.echo(
            f"note: --prompt-tokens does not change the plan on {p.backend} {p.device.kind}: "
            "it keeps the whole context's workspace, so that is what is planned",
            err=True,
        )
    if json_out:
        emit_json({**dataclasses.asdict(p), "peak_bytes": p.peak_bytes}, json_out)
    else:
        click.echo(format_plan(p))


@click.command("eval")
@model_options
@click.option(
    "--quant",
    default=None,
    help="Formats to measure, a comma list of NAME[:gG][:clip]: none, int4, int8, fp8, fp4, "
    "nvfp4; e.g. none,int8,int4:g32,int4:g64:clip,fp4 [default with --against: none].",
)
@click.option(
    "--against",
    multiple=True,
    help="A quantized checkpoint (directory, .gguf, Hub id) of the same model to score "
    "against --model's dense weights; repeat for several.",
)
@click.option("--group-size", type=int, default=None, help="Group size for entries without :gG.")
@bits_option
@click.option(
    "--text",
    default=None,
    help="UTF-8 text file to score [default: the bundled ~3900-token English sample].",
)
@click.option(
    "--max-tokens", type=int, default=4096, show_default=True, help="Most tokens of text scored."
)
@click.option("--window", type=int, default=512, show_default=True, help="Tokens per forward pass.")
@click.option(
    "--kv-quant",
    default=None,
    help="KV-cache formats to run each --quant with, a comma list of none, int8, fp8: "
    "scored against the unquantized model with an unquantized cache [default: none].",
)
@json_option
def eval_cmd(
    model, backend, dtype, quant, against, group_size, bits, text, max_tokens, window, kv_quant,
    json_out,
):  # fmt: skip
    """Measure what quantization costs: perplexity, KL divergence from the unquantized
    model and top-1 agreement, per format, over a text."""
    from .evaluate import (  # noqa: PLC0415
        evaluate_many,
        format_table,
        parse_choices,
        summarize_notes,
    )
    from .kvquant import parse_kv_list  # noqa: PLC0415

    if quant is None and not against and kv_quant is None:
        raise MlxrunError(
            "eval needs --quant (formats to measure), --kv-quant (cache formats) or --against "
            "(checkpoints)"
        )
    kv_quants = parse_kv_list(kv_quant)
    choices = parse_choices(quant or "none", group_size, bits)
    extra = []
    if against:
        from .against import against_candidates  # noqa: PLC0415
        from .loader import open_checkpoint  # noqa: PLC0415

        extra = against_candidates(open_checkpoint(model), against, backend, dtype)
    if json_out not in (None, "-"):
        check_writable(json_out)
    run = evaluate_many(
        model,
        choices,
        backend=backend,
        dtype=dtype,
        text=text,
        max_tokens=max_tokens,
        window=window,
        extra=extra,
        progress=sys.stderr.isatty(),
        kv_quants=kv_quants,
    )
    if json_out:
        info = {"model": model, "text": text or "bundled eval.txt", **dataclasses.asdict(run)}
        emit_json(info, json_out)
        return
    click.echo(f"{model} on {run.backend}; text: {text or 'bundled eval.txt'}")
    click.echo(run.reference)
    click.echo(format_table(run.results))
    for note in summarize_notes(run.notes):
        click.echo(f"note: {note}")


@click.command()
@click.option("--verbose", "-v", is_flag=True, help="Add each kernel's note and tile shapes.")
@json_option
def devices(verbose, json_out):
    """Show each device found, its memory and profile, the kernel and compute dtype per
    format, and what --quant auto picks there."""
    from .devices import detect, format_report  # noqa: PLC0415

    reports = detect()
    if json_out:
        emit_json(reports, json_out)
    else:
        click.echo(format_report(reports, verbose=verbose))


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@click.command()
@click.option(
    "--model",
    "-m",
    default="smollm2",
    show_default=True,
    help="Model (directory, .gguf, Hub id, alias such as smollm2), or shape:llama3-8b, "
    "shape:llama3-1b, shape:smollm2 for random weights of that shape (no download).",
)
@click.option(
    "--backends",
    default="mlx,cpu,cuda,mps",
    show_default=True,
    help="Comma list; those this machine cannot run are listed as skipped, with the reason.",
)
@click.option(
    "--quant",
    default="none,int4",
    show_default=True,
    help="Comma list of weight formats: none, int4, int8, fp8, fp4, nvfp4; for shape: "
    "models on cuda also q4_k_m, q6_k (GGUF K-quant layouts).",
)
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option(
    "--max-tokens", "--gen-tokens", "gen_tokens", type=int, default=128, show_default=True
)
@batch_option
@click.option(
    "--reps", type=int, default=5, show_default=True, help="Timed runs after one warm-up."
)
@click.option("--compare", default="", help="Peers to add as rows: transformers, mlx-lm.")
@click.option(
    "--temp",
    type=float,
    default=0.0,
    show_default=True,
    help="Above 0: each format is also timed sampling with this temperature (its own row).",
)
@top_p_option
@top_k_option
@min_p_option
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of sampled rows.")
@click.option("--json", "json_path", default=None, help="Write every number to this file.")
@click.option("--plot", "plot_path", default=None, help="Draw decode tok/s vs roofline (PNG).")
@dtype_option
@click.option(
    "--draft-model",
    default=None,
    help="Speculative decoding with this draft (shape:NAME with a shape: model): "
    "acceptance and effective tok/s against plain decode (random weights: the verify "
    "pass's cost instead).",
)
@draft_option
@num_draft_option
@click.option(
    "--kv-quant",
    default=None,
    help="KV-cache formats, a comma list of none, int8, fp8: a row each per backend and "
    "format; the roofline counts the KV bytes as stored [default: none].",
)
def bench(
    model, backends, quant, prompt_tokens, gen_tokens, batch, reps, compare, temp, top_p,
    top_k, min_p, seed, json_path, plot_path, dtype, draft_model, draft, num_draft, kv_quant,
):  # fmt: skip
    """Measure load time, TTFT, prefill and decode speed, peak memory and the fraction of
    the memory-bandwidth roofline, per backend and weight format, in one table."""
    from .bench import format_report, run_bench  # noqa: PLC0415
    from .sampling import SamplingParams  # noqa: PLC0415

    if draft_model is not None or draft is not None:
        from .bench_spec import format_spec, run_spec_bench  # noqa: PLC0415

        if batch != 1 or compare or temp or plot_path or kv_quant:
            raise MlxrunError(
                "bench with a draft measures greedy batch-1 decode; drop --batch-size, "
                "--compare, --temp, --plot and --kv-quant"
            )
        rows = run_spec_bench(
            model, _csv(backends), _csv(quant), draft, draft_model, num_draft,
            prompt_tokens, gen_tokens, reps, dtype, json_path,
        )  # fmt: skip
        click.echo(format_spec(rows))
        return

    from .kvquant import parse_kv_list  # noqa: PLC0415

    sampling = SamplingParams(temp, top_p, top_k, min_p, seed=seed)
    kv_quants = parse_kv_list(kv_quant)
    report = run_bench(
        model,
        _csv(backends),
        _csv(quant),
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        batch=batch,
        reps=reps,
        compare=_csv(compare),
        json_path=json_path,
        plot_path=plot_path,
        dtype=dtype,
        sampling=sampling,
        kv_quants=kv_quants,
    )
    click.echo(format_report(report))
    for path in (json_path, plot_path):
        if path is not None:
            click.echo(f"wrote {path}", err=True)
