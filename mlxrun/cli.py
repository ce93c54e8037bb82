"""Command line: `mlxrun generate | convert | devices | plan | eval | bench | serve | chat`.

Only argument parsing and printing live here; the work is in the library. User errors
(MlxrunError) print one line on stderr and exit with status 1.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import click

from .cli_io import (
    check_writable,
    convert_summary,
    emit_json,
    read_prompts,
    stdin_text,
    write_jsonl,
)
from .cli_structured import (
    compile_timeout_option,
    constraint_from,
    constraint_options,
    tool_parser_option,
)
from .errors import MlxrunError

BACKEND_CHOICES = ["auto", "mlx", "cuda", "mps", "cpu"]
DTYPE_CHOICES = ["float32", "bfloat16", "float16"]


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GB"


def _weights_line(m) -> str:
    """The weights' bytes as held on the device, after any quantization on load."""
    q = m.quant
    if q:
        how = f"quantized on load to {q.mode} {q.bits}-bit g{q.group_size}"
    else:
        how = f"dequantized on load to {m.backend.dtype}" if m.expanded else "as stored"
    n = m.transformer.weight_bytes()
    return f"Weights: {_gib(n)} ({n} bytes, {how})"


def verbosity_options(f):
    f = click.option(
        "--verbose", "-v", is_flag=True, help="Say more: load time, details per step."
    )(f)
    f = click.option(
        "--quiet", "-q", is_flag=True, help="Only the answer: no stats, notes or progress bars."
    )(f)
    return f


def json_option(f):
    return click.option(
        "--json",
        "json_out",
        is_flag=False,
        flag_value="-",
        default=None,
        metavar="[PATH]",
        help="Print the numbers as JSON (or write them to PATH) instead of the table.",
    )(f)


def kv_quant_option(f):
    return click.option(
        "--kv-quant",
        default=None,
        help="Keep the KV cache quantized: int8 or fp8 (about half the bytes of a 16-bit "
        "cache; see docs/long-context.md), or none [default: none].",
    )(f)


def model_options(f):
    f = click.option(
        "--model",
        "-m",
        default="smollm2",
        show_default=True,
        help="Model directory, .gguf file, Hugging Face repo id, or alias "
        "('smollm2' is bundled and needs no network; 'llama' is "
        "Llama 3.2 1B Instruct from the Hub).",
    )(f)
    f = click.option(
        "--backend",
        "-b",
        type=click.Choice(BACKEND_CHOICES),
        default="auto",
        show_default=True,
        help="mlx (Metal / mlx-cuda / CPU), cuda, mps or cpu (PyTorch); auto picks "
        "MLX on Apple Silicon, CUDA where present, else PyTorch CPU.",
    )(f)
    f = click.option(
        "--dtype",
        type=click.Choice(DTYPE_CHOICES),
        default=None,
        help="Compute dtype [default: float32 on CPU, bfloat16 on GPUs, float16 on MPS].",
    )(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlxrun")
def cli():
    """Run Llama-family language models on MLX and PyTorch (CPU, CUDA, MPS)."""


@cli.command()
@model_options
@click.option(
    "--prompt",
    "-p",
    "prompts",
    multiple=True,
    help="The user message (repeat for a batch); '-' reads it from stdin [default: piped "
    "stdin, else 'What is the capital of France?'].",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=str,
    default=None,
    help="File with one prompt per line, or JSONL with a 'prompt' field (other fields "
    "come back on the --output row); '-' reads stdin.",
)
@click.option(
    "--batch-size",
    "--batch",
    default="auto",
    show_default=True,
    help="Prompts run together: a number, or auto (the largest the memory plan "
    "allows for the longest prompt plus --max-tokens).",
)
@click.option(
    "--output",
    "-o",
    default=None,
    help="Write results as JSONL (the input's fields, prompt, text, tokens, finish_reason), "
    "in input order.",
)
@click.option("--system", default=None, help="System message (chat models).")
@click.option(
    "--chat/--no-chat",
    default=None,
    help="Wrap the prompt in the model's chat template [default: when it has one].",
)
@click.option(
    "--max-tokens",
    "--gen-tokens",
    type=int,
    default=256,
    show_default=True,
    help="Most tokens to generate (>= 1).",
)
@click.option(
    "--temp", type=float, default=0.0, show_default=True, help="Sampling temperature; 0 is greedy."
)
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")
@click.option(
    "--top-k", type=int, default=0, show_default=True, help="Keep the k likeliest (0: off)."
)
@click.option(
    "--min-p",
    type=float,
    default=0.0,
    show_default=True,
    help="Drop tokens under min-p x the top probability.",
)
@click.option(
    "--repetition-penalty",
    type=float,
    default=1.0,
    show_default=True,
    help="Penalise recently generated tokens (1: off).",
)
@click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option(
    "--quant",
    default=None,
    help="Quantize on load: int4, int8, fp8, fp4, nvfp4, auto or none. On an already "
    "quantized model, layers already in that format are kept and the others re-quantized; "
    "none dequantizes them [default: as stored, or dequantized where the device runs dense "
    "weights faster and they fit (PyTorch on the CPU)].",
)
@click.option("--group-size", type=int, default=None, help="Quantization group size.")
@click.option("--bits", type=int, default=None, help="Quantization bits (int formats).")
@click.option(
    "--check-weights/--no-check-weights",
    default=True,
    show_default=True,
    help="Refuse weights that hold NaN or inf (one pass over their bytes while loading).",
)
@kv_quant_option
@constraint_options
@click.option(
    "--draft-model",
    default=None,
    help="Speculative decoding with this small model (same tokenizer) drafting tokens "
    "that the model checks in one pass; greedy output is unchanged.",
)
@click.option(
    "--draft",
    type=click.Choice(["ngram"]),
    default=None,
    help="Speculative decoding with prompt lookup: draft the tokens that followed the "
    "latest earlier occurrence of the last few tokens.",
)
@click.option(
    "--num-draft",
    type=int,
    default=None,
    help="Tokens drafted per verify pass [default: 4 with --draft-model, 8 with --draft ngram].",
)
@verbosity_options
def generate(
    model,
    backend,
    dtype,
    prompts,
    prompts_file,
    batch_size,
    output,
    system,
    chat,
    max_tokens,
    temp,
    top_p,
    top_k,
    min_p,
    repetition_penalty,
    seed,
    stop,
    quant,
    group_size,
    bits,
    check_weights,
    kv_quant,
    json_schema,
    grammar,
    draft_model,
    draft,
    num_draft,
    quiet,
    verbose,
):
    """Generate text: one prompt streams to the terminal; many run as batches. With no
    --prompt, piped stdin is the prompt."""
    from .api import load  # noqa: PLC0415
    from .sampling import SamplingParams  # noqa: PLC0415

    if max_tokens < 1:
        raise MlxrunError(f"--max-tokens must be at least 1, got {max_tokens}")
    if batch_size != "auto" and not (batch_size.isdigit() and int(batch_size) >= 1):
        raise MlxrunError(f"--batch-size must be a positive integer or 'auto', got {batch_size!r}")
    if output is not None:
        check_writable(output)
    rows = [{"prompt": sys.stdin.read().rstrip("\n") if p == "-" else p} for p in prompts]
    if prompts_file:
        rows += read_prompts(prompts_file)
    if not rows:
        piped = stdin_text()
        piped = piped.rstrip("\n") if piped and piped.strip() else None
        rows = [{"prompt": piped or "What is the capital of France?"}]
    prompts = [r["prompt"] for r in rows]
    if any(not p.strip() for p in prompts):
        raise MlxrunError("the prompt is empty; pass some text with --prompt")
    sampling = SamplingParams(temp, top_p, top_k, min_p, repetition_penalty, seed=seed)
    constraint = constraint_from(json_schema, grammar)
    speculative = draft_model is not None or draft is not None
    if speculative and (len(prompts) > 1 or output is not None):
        raise MlxrunError(
            "speculative decoding (--draft-model / --draft) runs one prompt streamed to the "
            "terminal; drop it for batches and --output"
        )
    if draft_model is not None and draft is not None:
        raise MlxrunError("give --draft-model or --draft ngram, not both")
    if num_draft is not None and not speculative:
        raise MlxrunError("--num-draft needs --draft-model or --draft ngram")
    m = load(
        model,
        backend=backend,
        dtype=dtype,
        quant=quant,
        group_size=group_size,
        bits=bits,
        progress=sys.stderr.isatty() and not quiet,
        check_weights=check_weights,
        fastest=True,
        kv_quant=kv_quant,
    )
    _notes(m.notes, quiet)
    if verbose:
        click.echo(f"Loaded {m.source} in {m.load_time:.2f} s", err=True)
    drafter = m.drafter(draft, draft_model, num_draft) if speculative else None
    if len(prompts) == 1 and output is None:
        _stream_one(m, prompts[0], max_tokens, system, chat, list(stop), sampling, quiet,
                    constraint, drafter)  # fmt: skip
        return
    results, stats = m.generate_many(
        prompts,
        max_tokens=max_tokens,
        system=system,
        chat=chat,
        stop=list(stop),
        batch_size=batch_size,
        params=sampling,
        **_constraint_kw(constraint),
    )
    if output:
        write_jsonl(output, rows, results)
    else:
        for i, (p, r) in enumerate(zip(prompts, results)):
            click.echo(f"[{i}] {p}\n{r.text}\n")
    if quiet:
        return
    click.echo("=" * 10, err=True)
    click.echo(
        f"Prompts: {len(prompts)} in batches of {stats['batch_size']}; "
        f"{stats['tokens']} tokens generated in {stats['seconds']:.2f} s, "
        f"{stats['tokens'] / stats['seconds']:.3f} tokens-per-sec",
        err=True,
    )
    click.echo(f"Peak memory: {_gib(m.backend.peak_memory())}", err=True)
    click.echo(_weights_line(m), err=True)
    click.echo(f"Backend: {m.backend.describe()}", err=True)


def _notes(notes: list[str], quiet: bool) -> None:
    """Notes say what loading decided; warnings (a choice known to be wrong or slow) show
    even with --quiet."""
    for note in notes:
        if note.startswith("warning: "):
            click.echo(note, err=True)
        elif not quiet:
            click.echo(f"note: {note}", err=True)


def _constraint_kw(c) -> dict:
    """A Constraint as the API's keyword (json_schema, grammar or regex)."""
    if c is None:
        return {}
    if c.kind == "json_schema":
        return {"json_schema": c.source}
    return {"regex" if c.kind == "regex" else "grammar": c.source}


def _stream_one(
    m, prompt, max_tokens, system, chat, stop, sampling, quiet=False, c=None, drafter=None
) -> None:
    last = None
    for r in m.stream(
        prompt,
        max_tokens=max_tokens,
        system=system,
        chat=chat,
        stop=stop,
        **_constraint_kw(c),
        draft=drafter,
        **dataclasses.asdict(sampling),
    ):
        click.echo(r.text, nl=False)
        sys.stdout.flush()
        last = r
    click.echo()
    if quiet:
        return
    click.echo("=" * 10, err=True)
    click.echo(
        f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", err=True
    )
    click.echo(
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
        err=True,
    )
    if drafter is not None:
        st = drafter.stats
        click.echo(
            f"Draft: {drafter.kind}, {drafter.k} a pass; {st.accepted} of {st.drafted} drafted "
            f"tokens accepted ({100 * st.acceptance:.1f}%) in {st.passes} verify passes",
            err=True,
        )
    click.echo(f"Peak memory: {last.peak_memory:.3f} GB", err=True)
    click.echo(_weights_line(m), err=True)
    click.echo(f"Finish: {last.finish_reason}", err=True)
    click.echo(f"Backend: {m.backend.describe()}", err=True)


@cli.command()
@model_options
@click.option("--quant", default=None, help="Plan for this quantization (int4, fp8, ...).")
@click.option(
    "--context",
    type=int,
    default=None,
    help="Tokens per sequence (prompt + generation) [default: the model's maximum].",
)
@click.option(
    "--batch-size",
    "--batch",
    "batch",
    type=int,
    default=1,
    show_default=True,
    help="Sequences at once.",
)
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


@cli.command()
@click.option(
    "--model",
    "-m",
    required=True,
    help="Model to convert (.gguf file, directory, Hub id or alias).",
)
@click.option("--output", "-o", "out_dir", required=True, help="New directory to write.")
@click.option(
    "--quant",
    default=None,
    help="Quantize: int4, int8, fp8, fp4 or nvfp4 (mlx-lm's format); none dequantizes a "
    "quantized source [default: keep the weights as stored].",
)
@click.option("--group-size", type=int, default=None, help="Quantization group size.")
@click.option("--bits", type=int, default=None, help="Quantization bits (a check for --quant).")
@click.option(
    "--calibrate",
    type=click.Choice(["awq", "gptq"]),
    default=None,
    help="Round with a calibrated method instead of to nearest: awq (activation-aware "
    "scales and clipping) or gptq (the same, then error feedback). Same format and size.",
)
@click.option(
    "--calib-data",
    default=None,
    help='Calibration text: a UTF-8 file, or .jsonl with a "text" field per line '
    "[default: the bundled English text].",
)
@click.option("--calib-samples", type=int, default=16, show_default=True, help="Windows of text.")
@click.option("--calib-seq-len", type=int, default=320, show_default=True, help="Tokens a window.")
@click.option("--seed", type=int, default=0, show_default=True, help="Picks the windows.")
@click.option(
    "--target-bpw",
    type=float,
    default=None,
    help="With --calibrate: bits per weight of the file (scales included); each linear "
    "gets 3-8 bits by its measured sensitivity, written as per-layer overrides.",
)
@click.option(
    "--backend",
    default="cpu",
    show_default=True,
    help="Where calibration runs the layers: mlx, cuda, mps or cpu.",
)
@verbosity_options
def convert(
    model,
    out_dir,
    quant,
    group_size,
    bits,
    calibrate,
    calib_data,
    calib_samples,
    calib_seq_len,
    seed,
    target_bpw,
    backend,
    quiet,
    verbose,
):
    """Write a model as a Hugging Face-layout directory of safetensors (GGUF -> safetensors,
    or quantized to the format mlx-lm reads)."""
    from .convert import convert as run_convert  # noqa: PLC0415

    opts = None
    if target_bpw is not None and calibrate is None:
        raise MlxrunError(
            "--target-bpw needs --calibrate (awq or gptq): it measures each layer on the "
            "calibration text"
        )
    if calibrate is not None:
        from mlxrun.quant.calibrate import CalibOptions  # noqa: PLC0415

        opts = CalibOptions(
            calibrate, calib_data, calib_samples, calib_seq_len, seed, target_bpw=target_bpw
        ).check()
    notes = run_convert(
        model,
        out_dir,
        quant=quant,
        group_size=group_size,
        bits=bits,
        progress=sys.stderr.isatty() and not quiet,
        calibrate=opts,
        backend=backend,
    )
    _notes(notes, quiet)
    click.echo(convert_summary(out_dir))


@cli.command("eval")
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
@click.option("--bits", type=int, default=None, help="Quantization bits (int formats).")
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


@cli.command()
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


@cli.command()
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
@click.option(
    "--batch-size",
    "--batch",
    "batch",
    type=int,
    default=1,
    show_default=True,
    help="Sequences at once.",
)
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
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of sampled rows.")
@click.option("--json", "json_path", default=None, help="Write every number to this file.")
@click.option("--plot", "plot_path", default=None, help="Draw decode tok/s vs roofline (PNG).")
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default=None,
    help="Compute dtype [default: float32 on CPU, bfloat16 on GPUs, float16 on MPS].",
)
@click.option(
    "--draft-model",
    default=None,
    help="Speculative decoding with this draft (shape:NAME with a shape: model): "
    "acceptance and effective tok/s against plain decode (random weights: the verify "
    "pass's cost instead).",
)
@click.option("--draft", type=click.Choice(["ngram"]), default=None, help="Prompt lookup drafts.")
@click.option("--num-draft", type=int, default=None, help="Tokens drafted per verify pass.")
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


def _quiet_other_ranks() -> None:
    """Under torchrun / mlx.launch every rank runs this command; only rank 0 prints (the
    others' errors are agreed on and reported by rank 0, see mlxrun.distributed)."""
    import os  # noqa: PLC0415

    from .distributed import env_rank  # noqa: PLC0415

    if env_rank() != 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the process)


def engine_options(f):
    f = click.option(
        "--quant", default=None, help="Quantize on load (as generate): int4, fp8, fp4, auto, none."
    )(f)
    f = click.option(
        "--max-batch",
        default="auto",
        show_default=True,
        help="Sequences decoded together (cache slots): a number, or auto (the memory plan's "
        "most at --context; at most 32 on CUDA, 8 elsewhere).",
    )(f)
    f = click.option(
        "--context",
        type=int,
        default=None,
        help="Tokens per sequence, prompt included [default: the model's, capped by the plan].",
    )(f)
    f = click.option(
        "--no-prefix-cache",
        is_flag=True,
        help="Do not reuse the keys and values of prompts that start alike.",
    )(f)
    return kv_quant_option(f)


def _engine(model, backend, dtype, quant, max_batch, context, no_prefix_cache, max_queue=64,
            kv_quant=None):  # fmt: skip
    from .api import load  # noqa: PLC0415
    from .engine import engine_for  # noqa: PLC0415

    m = load(model, backend=backend, dtype=dtype, quant=quant, progress=sys.stderr.isatty(),
             kv_quant=kv_quant)  # fmt: skip
    for note in m.notes:
        click.echo(f"note: {note}", err=True)
    eng = engine_for(m, max_batch, context, max_queue=max_queue, prefix_cache=not no_prefix_cache)
    click.echo(
        f"mlxrun: {m.source} on {m.backend.describe()}: {eng.max_batch} slots of "
        f"{eng.context} tokens",
        err=True,
    )
    return m, eng


@cli.command()
@model_options
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to listen on.")
@click.option(
    "--api-key",
    envvar="MLXRUN_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on every request [env: MLXRUN_API_KEY].",
)
@click.option(
    "--max-queue",
    type=int,
    default=64,
    show_default=True,
    help="Requests that may wait for a slot; more are answered 429 at once.",
)
@tool_parser_option
@compile_timeout_option
def serve(model, backend, dtype, quant, max_batch, context, no_prefix_cache, kv_quant, host,
          port, api_key, max_queue, tool_parser, compile_timeout):  # fmt: skip
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health)
    with continuous batching."""
    from .server import Server, run_server, serve_app  # noqa: PLC0415

    if max_queue < 0:
        raise MlxrunError(f"--max-queue must be >= 0, got {max_queue}")
    if not 0 <= port < 65536:
        raise MlxrunError(f"--port must be in 0..65535, got {port}")
    m, eng = _engine(model, backend, dtype, quant, max_batch, context, no_prefix_cache, max_queue,
                     kv_quant)  # fmt: skip
    if eng.sync is not None and not eng.sync.leader:
        # A tensor-parallel follower: rank 0 serves, and says when to stop (a signal from
        # the launcher must not end this rank while rank 0 still needs its sums).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        eng.wait()
        os._exit(0)
    server = Server(eng, model, api_key or None, tool_parser, compile_timeout)
    serve_app(server)  # the missing-extra error before we say we are listening
    click.echo(f"mlxrun: serving '{model}' on http://{host}:{port}/v1", err=True)
    run_server(server, host, port)
    # The engine thread is joined and every request answered. MLX (0.32, CPU) can abort
    # while the interpreter tears down arrays its engine thread made (seen as SIGABRT after
    # a clean shutdown), so leave now, with the output flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@cli.command()
@model_options
@engine_options
@click.option("--system", default=None, help="System message.")
@click.option("--max-tokens", type=int, default=512, show_default=True, help="Most tokens a turn.")
@click.option("--temp", type=float, default=0.0, show_default=True, help="Sampling temperature.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")
@click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@constraint_options
def chat(model, backend, dtype, quant, max_batch, context, no_prefix_cache, kv_quant, system,
         max_tokens, temp, top_p, seed, json_schema, grammar):  # fmt: skip
    """Chat in the terminal; the conversation's cache is kept between turns."""
    from .chat import chat_loop  # noqa: PLC0415
    from .sampling import SamplingParams  # noqa: PLC0415

    if max_tokens < 1:
        raise MlxrunError(f"--max-tokens must be at least 1, got {max_tokens}")
    params = SamplingParams(temp, top_p, seed=seed)
    constraint = constraint_from(json_schema, grammar)
    _, eng = _engine(
        model, backend, dtype, quant, "1" if max_batch == "auto" else max_batch, context,
        no_prefix_cache, kv_quant=kv_quant,
    )  # fmt: skip
    try:
        if constraint is not None:
            eng.grammars().compile(constraint)  # a bad schema fails before the first turn
        chat_loop(eng, params, max_tokens, system, constraint=constraint)
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit status 1."""
    _quiet_other_ranks()
    try:
        rv = cli.main(args=argv, prog_name="mlxrun", standalone_mode=False)
        sys.exit(rv if isinstance(rv, int) else 0)
    except MlxrunError as e:  # the library's words for an API user; the CLI's flags here
        click.echo(f"mlxrun: error: {getattr(e, 'cli_message', e)}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("mlxrun: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("\nmlxrun: interrupted", err=True)
        sys.exit(130)
