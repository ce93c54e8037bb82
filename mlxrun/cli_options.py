"""Options that several CLI commands share (--model/--backend/--dtype, --quant on load,
the sampling options, --json, --kv-quant, --verbose/--quiet), and how a command shows what
loading decided. Each is defined once here, so its help and default cannot drift between
commands; an option whose meaning differs by command (bench's comma lists) stays there."""

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
    return dtype_option(f)


dtype_option = click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default=None,
    help="Compute dtype [default: float32 on CPU, bfloat16 on GPUs, float16 on MPS].",
)
# The formats `load` takes as quant=, for every command that quantizes on load
LOAD_QUANTS = "int4, int8, fp8, fp4, nvfp4, auto or none"
# generate's --quant (serve and chat load without `fastest`, so their default differs)
load_quant_option = click.option(
    "--quant",
    default=None,
    help=f"Quantize on load: {LOAD_QUANTS}. On an already "
    "quantized model, layers already in that format are kept and the others re-quantized; "
    "none dequantizes them [default: as stored, or dequantized where the device runs dense "
    "weights faster and they fit (PyTorch on the CPU)].",
)
group_size_option = click.option(
    "--group-size", type=int, default=None, help="Quantization group size."
)
bits_option = click.option(
    "--bits", type=int, default=None, help="Quantization bits (int formats)."
)

# Sampling (mlxrun.sampling.SamplingParams)
temp_option = click.option(
    "--temp", type=float, default=0.0, show_default=True, help="Sampling temperature; 0 is greedy."
)
top_p_option = click.option(
    "--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass."
)
top_k_option = click.option(
    "--top-k", type=int, default=0, show_default=True, help="Keep the k likeliest (0: off)."
)
min_p_option = click.option(
    "--min-p",
    type=float,
    default=0.0,
    show_default=True,
    help="Drop tokens under min-p x the top probability.",
)
seed_option = click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")

# Speculative decoding without a draft model, and the draft length either way
draft_option = click.option(
    "--draft",
    type=click.Choice(["ngram"]),
    default=None,
    help="Speculative decoding with prompt lookup: draft the tokens that followed the "
    "latest earlier occurrence of the last few tokens.",
)
num_draft_option = click.option(
    "--num-draft",
    type=int,
    default=None,
    help="Tokens drafted per verify pass [default: 4 with --draft-model, 8 with --draft ngram].",
)


def show_notes(notes: list[str], quiet: bool) -> None:
    """Notes say what loading decided; warnings (a choice known to be wrong or slow) show
    even with --quiet."""
    for note in notes:
        if note.startswith("warning: "):
            click.echo(note, err=True)
        elif not quiet:
            click.echo(f"note: {note}", err=True)
