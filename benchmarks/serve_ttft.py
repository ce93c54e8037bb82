"""Time to first token of a cold request and of one whose long prefix is cached, with the
engine's breakdown of where the time went (mlxrun/phases.py), straight into the engine and
through the HTTP server (a raw streaming request on loopback).

Each round sends a prompt of --prefix-tokens random tokens and --tail-tokens more (cold),
then one with the same prefix and another tail (cached: only the tail is prefilled), a new
prefix every round; the first round of each path is a warm-up (kernels compiled and tuned
for these shapes, graphs captured) and is not reported. Prints one JSON line per timed
request (client-side ttft_ms and the engine's phases in ms), then the medians and the
cached/cold ratio per path.

  python benchmarks/serve_ttft.py --model shape:tiny --backend cpu --prefix-tokens 200
  python benchmarks/serve_ttft.py --model shape:llama3-8b --backend cuda --quant int4 \
      --prefix-tokens 1000 --tail-tokens 8 --json $OUT/serve-ttft.json

Needs the `serve` extra (FastAPI, uvicorn) for the HTTP path; --no-http skips it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import load_model, start_server, write_json  # noqa: E402


def engine_ttft(eng, ids: list[int], gen: int) -> tuple[float, dict]:
    """Submit `ids` to the engine; (client-side TTFT in ms, the request's phases)."""
    from mlxrun.engine import Request  # noqa: PLC0415

    req = Request(list(ids), max_tokens=gen)
    t0 = time.perf_counter()
    first = None
    for ev in eng.stream(req):
        if first is None and ev.token is not None:
            first = time.perf_counter()
    return 1e3 * (first - t0), req.phases.breakdown()


def http_ttft(port: int, name: str, ids: list[int], gen: int, eng) -> tuple[float, dict]:
    """Stream a /v1/completions request of token ids over one new connection; (TTFT in ms
    to the first data line with text, the engine's phases of that request)."""
    body = json.dumps({"model": name, "prompt": ids, "max_tokens": gen, "temperature": 0,
                       "stream": True})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.connect()  # the connection is not what is timed
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = None
    for line in resp:
        if first is None and line.startswith(b"data: {") and b'"text": ""' not in line:
            first = time.perf_counter()
        if line.strip() == b"data: [DONE]":
            break
    conn.close()
    return 1e3 * (first - t0), eng.recent[-1].breakdown()


def run(path: str, ttft, rounds: int, vocab: int, args) -> dict:
    rows = {"cold": [], "cached": []}
    for r in range(rounds + 1):
        rng = np.random.default_rng(1000 * (path == "http") + r)
        head = rng.integers(3, vocab, args.prefix_tokens).tolist()
        for kind in ("cold", "cached"):
            ids = head + rng.integers(3, vocab, args.tail_tokens).tolist()
            ms, phases = ttft(ids)
            if r == 0:  # warm-up
                continue
            rows[kind].append(ms)
            print(json.dumps({"path": path, "request": kind, "ttft_ms": round(ms, 3),
                              "phases_ms": phases}), flush=True)  # fmt: skip
    cold, cached = (float(np.median(rows[k])) for k in ("cold", "cached"))
    out = {"path": path, "cold_ttft_ms": cold, "cached_ttft_ms": cached, "ratio": cached / cold}
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--tail-tokens", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="Timed rounds per path.")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--no-http", action="store_true", help="Only the engine-direct path.")
    ap.add_argument("--eager", action="store_true",
                    help="No fixed-shape steps (CUDA graphs): every pass eager, for A/B.")  # fmt: skip
    ap.add_argument("--json", default=None, help="Write the summary to this file.")
    args = ap.parse_args(argv)

    from mlxrun.engine import Engine  # noqa: PLC0415

    model, tok = load_model(args)
    vocab = model.config.vocab_size
    context = args.prefix_tokens + args.tail_tokens + args.gen_tokens + 16
    eng = Engine(model, tok, max_batch=args.max_batch, context=context,
                 fixed_steps=not args.eager)  # fmt: skip
    name = args.model
    report = {"model": name, "backend": model.be.describe(), "quant": args.quant,
              "prefix_tokens": args.prefix_tokens, "tail_tokens": args.tail_tokens,
              "prefill_chunk": eng.prefill_chunk, "fixed_steps": eng.graphs is not None,
              "paths": []}  # fmt: skip
    try:
        report["paths"].append(
            run(
                "engine",
                lambda ids: engine_ttft(eng, ids, args.gen_tokens),
                args.rounds,
                vocab,
                args,
            )  # fmt: skip
        )
        if not args.no_http:
            server, port = start_server(eng, name, poll=0.05)
            report["paths"].append(
                run(
                    "http",
                    lambda ids: http_ttft(port, name, ids, args.gen_tokens, eng),
                    args.rounds,
                    vocab,
                    args,
                )  # fmt: skip
            )
            server.should_exit = True
        report["health"] = eng.health()
    finally:
        eng.close()
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    sys.exit(main())
