"""`mlxrun serve | chat`: the commands that run the engine (continuous batching over
cache slots)."""

from __future__ import annotations

import os
import signal
import sys

import click

from .cli_options import (
    LOAD_QUANTS,
    kv_quant_option,
    model_options,
    seed_option,
    temp_option,
    top_p_option,
)
from .cli_structured import (
    compile_timeout_option,
    constraint_from,
    constraint_options,
    tool_parser_option,
)
from .errors import MlxrunError


def engine_options(f):
    f = click.option(
        "--quant",
        default=None,
        help=f"Quantize on load (as generate): {LOAD_QUANTS} [default: as stored].",
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


@click.command()
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


@click.command()
@model_options
@engine_options
@click.option("--system", default=None, help="System message.")
@click.option("--max-tokens", type=int, default=512, show_default=True, help="Most tokens a turn.")
@temp_option
@top_p_option
@seed_option
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
