"""Command line: `mlxrun generate | convert | devices | plan | eval | bench`.

Only argument parsing and printing live here; the work is in the library. User errors
(MlxrunError) print one line on stderr and exit with status 1.
"""

from __future__ import annotations

import sys

import click

from .errors import MlxrunError

BACKEND_CHOICES = ["auto", "mlx", "cuda", "mps", "cpu"]
DTYPE_CHOICES = ["float32", "bfloat16", "float16"]


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GB"


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
    default="What is the capital of France?",
    show_default=True,
    help="The user message.",
)
@click.option("--system", default=None, help="System message (chat models).")
@click.option(
    "--chat/--no-chat",
    default=None,
    help="Wrap the prompt in the model's chat template [default: when it has one].",
)
@click.option(
    "--max-tokens", type=int, default=256, show_default=True, help="Most tokens to generate (>= 1)."
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
    "--quant", default=None, help="Quantize on load: int4, int8, fp8, fp4, nvfp4, auto or none."
)
@click.option("--group-size", type=int, default=None, help="Quantization group size.")
@click.option("--bits", type=int, default=None, help="Quantization bits (int formats).")
def generate(
    model,
    backend,
    dtype,
    prompt,
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
):
    """Generate text and stream it to the terminal, then print stats."""
    from .api import load  # noqa: PLC0415
    from .sampling import SamplingParams  # noqa: PLC0415

    if max_tokens < 1:
        raise MlxrunError(f"--max-tokens must be at least 1, got {max_tokens}")
    if not prompt.strip():
        raise MlxrunError("the prompt is empty; pass some text with --prompt")
    params = SamplingParams(temp, top_p, top_k, min_p, repetition_penalty, seed=seed)
    m = load(
        model,
        backend=backend,
        dtype=dtype,
        quant=quant,
        group_size=group_size,
        bits=bits,
        progress=sys.stderr.isatty(),
    )
    for note in m.notes:
        click.echo(f"note: {note}", err=True)
    last = None
    for r in m.stream(
        prompt,
        max_tokens=max_tokens,
        system=system,
        chat=chat,
        stop=list(stop),
        temperature=params.temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
    ):
        click.echo(r.text, nl=False)
        sys.stdout.flush()
        last = r
    click.echo()
    click.echo("=" * 10, err=True)
    click.echo(
        f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", err=True
    )
    click.echo(
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
        err=True,
    )
    click.echo(f"Peak memory: {_gib(last.peak_memory)}", err=True)
    click.echo(f"Finish: {last.finish_reason}", err=True)
    click.echo(f"Backend: {m.backend.describe()}", err=True)


@cli.command()
@click.option(
    "--model",
    "-m",
    required=True,
    help="Model to convert (.gguf file, directory, Hub id or alias).",
)
@click.option("--output", "-o", "out_dir", required=True, help="New directory to write.")
def convert(model, out_dir):
    """Write a model as a Hugging Face-layout directory (GGUF -> safetensors)."""
    from .convert import convert as run_convert  # noqa: PLC0415

    run_convert(model, out_dir)
    click.echo(f"wrote {out_dir}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit status 1."""
    try:
        cli.main(args=argv, prog_name="mlxrun", standalone_mode=False)
    except MlxrunError as e:
        click.echo(f"mlxrun: error: {e}", err=True)
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
