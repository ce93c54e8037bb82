"""Load test of `mlxrun serve`: N concurrent streaming `openai` clients against a server in
this process, then the same prompts through the batched generate loop that `mlxrun bench
--batch N` times, in the same run and on the same model.

Reports, per client count N: the server's aggregate generated tok/s (prefills included),
its decode tok/s while all N clients generate, TTFT p50/p99 and per-request latency
p50/p99/max; the bench-equivalent decode tok/s and TTFT at batch N (and at batch 1, also
when 1 is not among the counts); serve_over_bench = serve decode / bench decode. With
--prefix-tokens, the TTFT of a request whose long prefix is already cached against the
first one's (ratio).

  python benchmarks/serve_load.py --model smollm2 --backend cpu --clients 1,4 \
      --prompt-tokens 64 --gen-tokens 16
  python benchmarks/serve_load.py --model shape:llama3-8b --backend cuda --quant int4 \
      --clients 1,32 --prompt-tokens 1024 --gen-tokens 128 --prefix-tokens 1000 \
      --json $OUT/serve-load.json

A `shape:` model has random weights; it gets a word-level tokenizer over its whole
vocabulary (token i is the word "w<i>", no end-of-sequence token), so every prompt is
exactly --prompt-tokens tokens and every answer runs --gen-tokens tokens.

Needs the `serve` extra and the `openai` client (1.x: its 2.x/3.x releases need httpx2).
Where those are wheels in a directory (a machine without an index), install them beside
the system's packages with `pip install --no-index --no-deps --target DIR WHEELS/*.whl`
and run with PYTHONPATH=DIR.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

import numpy as np


def word_tokenizer(vocab: int):
    """An mlxrun Tokenizer whose token i is the word w<i>, for random-weight models."""
    from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

    from mlxrun.tokenizer import Tokenizer  # noqa: PLC0415

    tok = HfTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return Tokenizer.from_json(tok.to_str(), {}, set())


def start_server(eng, name: str, poll: float = 0.1):
    """`mlxrun serve`'s app over `eng` (serving model `name`) in a thread on a free loopback
    port, polled every `poll` s until it listens: (uvicorn server, port). Stop it with
    `server.should_exit = True`."""
    import uvicorn  # noqa: PLC0415

    from mlxrun.server import Server, serve_app  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(serve_app(Server(eng, name)), host="127.0.0.1",
                                           port=port, log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(poll)
    return server, port


def write_json(path: str, report: dict) -> None:
    """`report` to `path` by way of `path`.partial, so that a run cut short leaves no file."""
    with open(path + ".partial", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".partial", path)


def load_model(args):
    """(Transformer, Tokenizer) for --model: a checkpoint or alias, or shape:NAME."""
    from mlxrun.bench import SHAPE_PREFIX, build_random, shape_config  # noqa: PLC0415

    if args.model.startswith(SHAPE_PREFIX):
        from mlxrun.backends import get_backend  # noqa: PLC0415
        from mlxrun.bench import _quant_specs  # noqa: PLC0415
        from mlxrun.distributed import join  # noqa: PLC0415
        from mlxrun.shard import shard_config  # noqa: PLC0415

        cfg = shape_config(args.model)
        be = get_backend(args.backend, args.dtype)
        group = join(be)  # under torchrun: this rank's shard, as tp_decode.py builds it
        tp, rank = (1, 0) if group is None else (group.size, group.rank)
        spec = _quant_specs([args.quant or "none"]).get(args.quant or "none")
        model = build_random(shard_config(cfg, tp), be, spec, seed=rank)
        return model, word_tokenizer(cfg.vocab_size)
    import mlxrun  # noqa: PLC0415

    m = mlxrun.load(args.model, backend=args.backend, dtype=args.dtype, quant=args.quant,
                    progress=False)  # fmt: skip
    return m.transformer, m.tokenizer


def make_prompts(tok, vocab: int, n: int, length: int, seed: int, prefix: list[int] | None = None):
    """n prompts of `length` tokens (after `prefix`), as text the tokenizer maps back to them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = (prefix or []) + rng.integers(3, vocab, length).tolist()
        out.append(tok.decode(ids))
    return out


def _client(url, model, prompts, gen, ready, go, results):
    """Stream every prompt at once (one thread each) once `go` is set; puts on `results` per
    prompt (request start, chunk arrival times, completion tokens, end).

    Times are time.monotonic(): CLOCK_MONOTONIC on Linux, one clock for every process."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    import openai  # noqa: PLC0415

    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)

    def one(p):
        t0, arrivals, toks = time.monotonic(), [], 0
        for ch in c.completions.create(model=model, prompt=p, max_tokens=gen, temperature=0,
                                       stream=True, stream_options={"include_usage": True}):  # fmt: skip
            if ch.choices and ch.choices[0].text:
                arrivals.append(time.monotonic())
            if ch.usage:
                toks = ch.usage.completion_tokens
        return (t0, arrivals, toks, time.monotonic())

    # One short request first: the client's lazy imports and first connection (~0.4 s)
    # would otherwise land in the first TTFT.
    for _ in c.completions.create(model=model, prompt=prompts[0][:8], max_tokens=1, stream=True):
        pass
    with ThreadPoolExecutor(max(1, len(prompts))) as ex:
        ready.put(True)
        go.wait()
        results.put(list(ex.map(one, prompts)))


def run_clients(url, model, prompts, gen, per_proc: int = 8):
    """The clients in processes of their own (`per_proc` streams each), so neither their
    Python nor their parsing of a few thousand chunks a second slows the server's; all
    start together once every process has imported the client."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    groups = [prompts[i : i + per_proc] for i in range(0, len(prompts), per_proc)]
    procs = [ctx.Process(target=_client, args=(url, model, g, gen, ready, go, results))
             for g in groups]  # fmt: skip
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    go.set()
    res = [r for _ in procs for r in results.get()]
    for p in procs:
        p.join()
    return res


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def serve_round(url, name, prompts, gen) -> dict:
    """Aggregate tok/s over the whole round (prefills included), and the decode tok/s while
    every client is generating: the chunks that arrive between the last client's first
    token and the first client's end, over that time (for one client, tokens 2..gen over
    their time: what `bench` reports as decode)."""
    res = run_clients(url, name, prompts, gen)
    ttft = [(r[1][0] if r[1] else r[3]) - r[0] for r in res]
    lat = [r[3] - r[0] for r in res]
    toks = sum(r[2] for r in res)
    wall = max(r[3] for r in res) - min(r[0] for r in res)
    lo = max(r[1][0] for r in res if r[1]) if all(r[1] for r in res) else None
    hi = min(r[1][-1] for r in res) if lo is not None else None
    steady = None
    if lo is not None and hi > lo:
        n = sum(sum(lo < t <= hi for t in r[1]) for r in res)
        steady = n / (hi - lo) if n >= len(res) else None  # at least a step's worth
    return {
        "clients": len(prompts),
        "generated_tokens": toks,
        "aggregate_tps": toks / wall,
        "decode_tps": steady,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "latency_p50_s": pct(lat, 50),
        "latency_p99_s": pct(lat, 99),
        "latency_max_s": max(lat),
    }


def bench_round(model, tok, prompts, gen) -> dict:
    """The same prompts through generate_step at batch len(prompts): `mlxrun bench`'s loop."""
    from mlxrun.bench_timing import _run_once  # noqa: PLC0415
    from mlxrun.sampling import SamplingParams  # noqa: PLC0415

    ids = [tok.encode(p) for p in prompts]
    L = min(len(i) for i in ids)
    ids = [i[:L] for i in ids]  # bench's batches are of one length
    _run_once(model, ids, gen, SamplingParams())  # warm-up
    ttft, steps = _run_once(model, ids, gen, SamplingParams())
    return {"batch": len(ids), "decode_tps": len(ids) * steps, "ttft_ms": 1e3 * ttft}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--clients", default="1,4", help="Comma-separated client counts.")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=0,
                    help="Also time a request whose prefix of this many tokens is cached.")  # fmt: skip
    ap.add_argument("--json", default=None, help="Write the numbers to this file.")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]

    import uvicorn  # noqa: F401, PLC0415  (without the serve extra, fail before the model loads)

    from mlxrun.engine import Engine  # noqa: PLC0415

    model, tok = load_model(args)
    vocab = model.config.vocab_size
    context = max(args.prompt_tokens, args.prefix_tokens + 16) + args.gen_tokens + 16
    # each round's client first sends a short warm-up request: with one slot it would take
    # the slot that holds the prefix the cached request is to reuse
    slots = max(max(counts), 2 if args.prefix_tokens else 1)
    eng = Engine(model, tok, max_batch=slots, context=context, max_queue=4 * slots)
    name = args.model
    split = eng.sync is not None  # under torchrun: rank 0 serves, the others follow
    if split and not eng.sync.leader:
        eng.wait()
        return
    server, port = start_server(eng, name)
    url = f"http://127.0.0.1:{port}/v1"
    report = {"model": name, "backend": model.be.describe(), "quant": args.quant,
              "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "rounds": []}  # fmt: skip
    serve_round(url, name, make_prompts(tok, vocab, 1, 8, 99), 4)  # warm-up
    for i, n in enumerate(counts):
        prompts = make_prompts(tok, vocab, n, args.prompt_tokens, seed=i)
        row = {"serve": serve_round(url, name, prompts, args.gen_tokens)}
        if not split:  # (bench's loop would need every rank: tp_decode.py times it)
            row["bench"] = bench_round(model, tok, prompts, args.gen_tokens)
            # the targets compare decode with decode: the server's while all N clients generate
            d = row["serve"]["decode_tps"]
            row["serve_over_bench"] = None if d is None else d / row["bench"]["decode_tps"]
        report["rounds"].append(row)
        print(json.dumps(row), flush=True)
    if 1 not in counts and not split:  # the batch-1 decode the one-client target is set against
        report["bench_batch1"] = bench_round(model, tok, prompts[:1], args.gen_tokens)
        print(json.dumps({"bench_batch1": report["bench_batch1"]}), flush=True)
    if args.prefix_tokens:
        # a first pair with another prefix compiles and tunes the shapes this path runs (a
        # short chunk after a long cached prefix), so the timed pair measures the reuse alone
        for seed in (6, 7):
            head = np.random.default_rng(seed).integers(3, vocab, args.prefix_tokens).tolist()
            a, b = (make_prompts(tok, vocab, 1, 8, s, prefix=head)[0] for s in (8, 9))
            if seed == 6:
                serve_round(url, name, [a], 4), serve_round(url, name, [b], 4)
        first = serve_round(url, name, [a], 4)["ttft_p50_ms"]
        phases = [eng.recent[-1].breakdown()]  # where the engine's part of it went
        second = serve_round(url, name, [b], 4)["ttft_p50_ms"]
        phases.append(eng.recent[-1].breakdown())
        report["prefix"] = {"prefix_tokens": args.prefix_tokens, "first_ttft_ms": first,
                            "cached_ttft_ms": second, "ratio": second / first,
                            "first_phases_ms": phases[0], "cached_phases_ms": phases[1]}  # fmt: skip
        print(json.dumps(report["prefix"]), flush=True)
    report["health"] = eng.health()
    server.should_exit = True
    eng.close()
    print(json.dumps(report["health"]), flush=True)
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    sys.exit(main())
