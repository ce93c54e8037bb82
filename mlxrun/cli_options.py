"""Options that several CLI commands share (--model/--backend/--dtype, --json, --kv-quant,
--verbose/--quiet), and how a command shows what loading decided."""

from __future__ import annotations

import click

BACKEND_CHOICES = ["auto", "mlx", "cuda", "mps", "cpu"]
DTYPE_CHOICES = ["float32", "bfloat16", "float16"]


def verbosity_options(f):
    f = click.option(
        "--verbose", "-v", is_flag=True, help="Say more: load time, details per step."
    )(f)
    f = click.option(
        "--quiet", "-q", is_flag=True, help="Only the answer: no stats, notes or progress bars."
    )(f)
    return f


def batch_option(f):
    return click.option(
        "--batch-size", "--batch", "batch", type=int, default=1, show_default=True,
        help="Sequences at once.",
    )(f)  # fmt: skip


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


def show_notes(notes: list[str], quiet: bool) -> None:
    """Notes say what loading decided; warnings (a choice known to be wrong or slow) show
    even with --quiet."""
    for note in notes:
        if note.startswith("warning: "):
            click.echo(note, err=True)
        elif not quiet:
            click.echo(f"note: {note}", err=True)
