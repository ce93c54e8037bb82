"""Command line: `mlxrun generate | convert | devices | plan | eval | bench | serve | chat`.

Only argument parsing and printing live here and in the cli_* modules (one per group of
commands); the work is in the library. User errors (MlxrunError) print one line on stderr
and exit with status 1.
"""

from __future__ import annotations

import sys

import click

from .cli_convert import convert
from .cli_generate import generate
from .cli_measure import bench, devices, eval_cmd, plan
from .cli_serve import chat, serve
from .errors import MlxrunError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlxrun")
def cli():
    """Run Llama-family language models on MLX and PyTorch (CPU, CUDA, MPS)."""


for _command in (generate, plan, convert, eval_cmd, devices, bench, serve, chat):
    cli.add_command(_command)


def _quiet_other_ranks() -> None:
    """Under torchrun / mlx.launch every rank runs this command; only rank 0 prints (the
    others' errors are agreed on and reported by rank 0, see mlxrun.distributed)."""
    import os  # noqa: PLC0415

    from .distributed import env_rank  # noqa: PLC0415

    if env_rank() != 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the process)


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
