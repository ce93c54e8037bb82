"""Load test of `mlxrun serve`: N concurrent streaming `openai` clients against a server in
this process, then the same prompts through the batched generate loop that `mlxrun bench
--batch N` times, in the same run and on the same model.

Reports aggregate generated tok/s, TTFT p50/p99 and per-request latency for the server, the
bench-equivalent decode tok/s at batch N and 1, and (with --prefix-tokens) the TTFT of a
request whose long prefix is already cached against the first one's.

  python benchmarks/serve_load.py --model smollm2 --backend cpu --clients 4 \
      --prompt-tokens 64 --gen-tokens 16
  python benchmarks/serve_load.py --model shape:llama3-8b --backend cuda --quant int4 \
      --clients 1,32 --prompt-tokens 1024 --gen-tokens 128 --prefix-tokens 1000

A `shape:` model has random weights; it gets a word-level tokenizer over its whole
vocabulary (token i is the word "w<i>", no end-of-sequence token), so every prompt is
exactly --prompt-tokens tokens and every answer runs --gen-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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


def load_model(args):
    """(Transformer, Tokenizer) for --model: a checkpoint or alias, or shape:NAME."""
    from mlxrun.bench import SHAPE_PREFIX, build_random, shape_config  # noqa: PLC0415

    if args.model.startswith(SHAPE_PREFIX):
        from mlxrun.backends import get_backend  # noqa: PLC0415
        from mlxrun.bench import _quant_specs  # noqa: PLC0415

        cfg = shape_config(args.model)
        be = get_backend(args.backend, args.dtype)
        spec = _quant_specs([args.quant or "none"]).get(args.quant or "none")
        model = build_random(cfg, be, spec)
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


def _client(url, model, prompts, gen, results):
    """Stream every prompt at once (one thread each); results: (ttft, latency, tokens)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    import openai  # noqa: PLC0415

    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)

    def one(p):
        t0 = time.perf_counter()
        first, toks = None, 0
        for ch in c.completions.create(model=model, prompt=p, max_tokens=gen, temperature=0,
                                       stream=True, stream_options={"include_usage": True}):  # fmt: skip
            if first is None and ch.choices and ch.choices[0].text:
                first = time.perf_counter()
            if ch.usage:
                toks = ch.usage.completion_tokens
        end = time.perf_counter()
        return ((first or end) - t0, end - t0, toks, t0, end)

    with ThreadPoolExecutor(len(prompts)) as ex:
        results.put(list(ex.map(one, prompts)))


def run_clients(url, model, prompts, gen):
    """The clients in a process of their own, so their Python does not slow the server's."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_client, args=(url, model, prompts, gen, q))
    p.start()
    res = q.get()
    p.join()
    return res


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def serve_round(url, name, prompts, gen) -> dict:
    res = run_clients(url, name, prompts, gen)
    ttft = [r[0] for r in res]
    lat = [r[1] for r in res]
    toks = sum(r[2] for r in res)
    wall = max(r[4] for r in res) - min(r[3] for r in res)
    return {
        "clients": len(prompts),
        "generated_tokens": toks,
        "aggregate_tps": toks / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "latency_p50_s": pct(lat, 50),
        "latency_max_s": max(lat),
    }


def bench_round(model, tok, prompts, gen) -> dict:
    """The same prompts through generate_step at batch len(prompts): `mlxrun bench`'s loop."""
    from mlxrun.bench import _run_once  # noqa: PLC0415

    ids = [tok.encode(p) for p in prompts]
    L = min(len(i) for i in ids)
    ids = [i[:L] for i in ids]  # bench's batches are of one length
    _run_once(model, ids, gen)  # warm-up
    ttft, steps = _run_once(model, ids, gen)
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

    import uvicorn  # noqa: PLC0415

    from mlxrun.engine import Engine  # noqa: PLC0415
    from mlxrun.server import Server, serve_app  # noqa: PLC0415

    model, tok = load_model(args)
    vocab = model.config.vocab_size
    context = max(args.prompt_tokens, args.prefix_tokens + 16) + args.gen_tokens + 16
    eng = Engine(model, tok, max_batch=max(counts), context=context, max_queue=4 * max(counts))
    name = args.model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(serve_app(Server(eng, name)), host="127.0.0.1",
                                           port=port, log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}/v1"
    report = {"model": name, "backend": model.be.describe(), "quant": args.quant,
              "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "rounds": []}  # fmt: skip
    serve_round(url, name, make_prompts(tok, vocab, 1, 8, 99), 4)  # warm-up
    for i, n in enumerate(counts):
        prompts = make_prompts(tok, vocab, n, args.prompt_tokens, seed=i)
        row = {"serve": serve_round(url, name, prompts, args.gen_tokens),
               "bench": bench_round(model, tok, prompts, args.gen_tokens)}  # fmt: skip
        row["serve_over_bench"] = row["serve"]["aggregate_tps"] / row["bench"]["decode_tps"]
        report["rounds"].append(row)
        print(json.dumps(row), flush=True)
    if args.prefix_tokens:
        head = np.random.default_rng(7).integers(3, vocab, args.prefix_tokens).tolist()
        a, b = (make_prompts(tok, vocab, 1, 8, s, prefix=head)[0] for s in (8, 9))
        first = serve_round(url, name, [a], 4)["ttft_p50_ms"]
        second = serve_round(url, name, [b], 4)["ttft_p50_ms"]
        report["prefix"] = {"prefix_tokens": args.prefix_tokens, "first_ttft_ms": first,
                            "cached_ttft_ms": second, "ratio": second / first}  # fmt: skip
        print(json.dumps(report["prefix"]), flush=True)
    report["health"] = eng.health()
    server.should_exit = True
    eng.close()
    print(json.dumps(report["health"]), flush=True)
    if args.json:
        with open(args.json + ".partial", "w") as f:
            json.dump(report, f, indent=1)
        import os  # noqa: PLC0415

        os.replace(args.json + ".partial", args.json)


if __name__ == "__main__":
    sys.exit(main())
