"""The CLI's structured-output options: --json-schema FILE_OR_JSON and --grammar FILE for
`generate` and `chat`, --tool-parser and --compile-timeout for `serve`."""

from __future__ import annotations

from pathlib import Path

import click

from .errors import MlxrunError
from .structured import COMPILE_SECONDS, Constraint, constraint_of


def constraint_options(f):
    """--json-schema and --grammar on a command (its function takes json_schema, grammar)."""
    f = click.option(
        "--grammar",
        default=None,
        metavar="FILE",
        help="The answer follows this grammar (GBNF as llama.cpp writes it, or Lark).",
    )(f)
    f = click.option(
        "--json-schema",
        default=None,
        metavar="FILE_OR_JSON",
        help="The answer is JSON that validates against this schema (a file, or the JSON "
        "itself); '{}' for any JSON value.",
    )(f)
    return f


def tool_parser_option(f):
    from .tools import PARSERS  # noqa: PLC0415

    return click.option(
        "--tool-parser",
        type=click.Choice(sorted(PARSERS)),
        default=None,
        help="How tool calls are read from the model's answers [default: from the chat "
        "template, else the model family].",
    )(f)


def compile_timeout_option(f):
    return click.option(
        "--compile-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=COMPILE_SECONDS,
        show_default=True,
        metavar="SECONDS",
        help="A JSON schema or grammar whose compilation takes longer is refused (400); "
        "other requests go on meanwhile.",
    )(f)


def _read(value: str, flag: str) -> str:
    path = Path(value)
    looks_inline = value.lstrip().startswith(("{", "[")) or "\n" in value
    if not looks_inline:
        try:
            if path.is_file():
                return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MlxrunError(f"{flag} {value}: cannot be read ({e})") from None
        if flag == "--grammar" or not value.lstrip().startswith(("{", "[", "true", "false")):
            raise MlxrunError(f"{flag} {value}: no such file")
    return value


def constraint_from(json_schema: str | None, grammar: str | None) -> Constraint | None:
    """The Constraint of --json-schema / --grammar, read and checked (None without them)."""
    if json_schema is not None and grammar is not None:
        raise MlxrunError("give --json-schema or --grammar, not both")
    if json_schema is not None:
        return constraint_of(json_schema=_read(json_schema, "--json-schema"))
    if grammar is not None:
        return constraint_of(grammar=_read(grammar, "--grammar"))
    return None
