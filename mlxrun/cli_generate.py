"""`mlxrun generate`: one prompt streamed to the terminal, or many run as batches."""

from __future__ import annotations

import dataclasses
import sys

import click

from .cli_io import check_writable, read_prompts, stdin_text, write_jsonl
from .cli_options import (
    bits_option,
    draft_option,
    group_size_option,
    kv_quant_option,
    load_quant_option,
    min_p_option,
    model_options,
    num_draft_option,
    seed_option,
    show_notes,
    temp_option,
    top_k_option,
    top_p_option,
    verbosity_options,
)
from .cli_structured import constraint_from, constraint_options
from .errors import MlxrunError


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


@click.command()
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
@temp_option
@top_p_option
@top_k_option
@min_p_option
@click.option(
    "--repetition-penalty",
    type=float,
    default=1.0,
    show_default=True,
    help="Penalise recently generated tokens (1: off).",
)
@seed_option
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@load_quant_option
@group_size_option
@bits_option
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
@draft_option
@num_draft_option
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
    show_notes(m.notes, quiet)
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
