"""`mlxrun convert`: a model written as safetensors, quantized (optionally calibrated) or
dequantized."""

from __future__ import annotations

import sys

import click

from .cli_io import convert_summary
from .cli_options import group_size_option, show_notes, verbosity_options
from .errors import MlxrunError


@click.command()
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
@group_size_option
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
    show_notes(notes, quiet)
    click.echo(convert_summary(out_dir))
