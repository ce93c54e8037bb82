"""Soak test of `mlxrun serve`: many short streaming requests, some clients hanging up
mid-stream; the server's resident memory must settle and no slot may leak.

  python benchmarks/serve_soak.py --model shape:tiny --backend cpu --requests 1000

The server runs in this process (its RSS is this process's); the clients run in another,
`--concurrency` at a time, and every 10th one closes its stream after two chunks. Prints
RSS after the first 100 requests and at the end, and /health (running must be 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve_load import load_model, make_prompts, start_server  # noqa: E402


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        import psutil  # noqa: PLC0415

        return psutil.Process().memory_info().rss


def _clients(url, model, prompts, gen, concurrency, drop_every, marks, done):
    """Run every prompt, `concurrency` at a time; put the request count on `marks` at 100."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    counter = {"n": 0, "dropped": 0, "errors": 0}
    lock = threading.Lock()

    def one(i):
        body = {"model": model, "prompt": prompts[i], "max_tokens": gen, "temperature": 0,
                "stream": True}  # fmt: skip
        drop = drop_every and i % drop_every == drop_every - 1
        try:
            with httpx.stream("POST", url + "/completions", json=body, timeout=600) as r:
                chunks = 0
                for line in r.iter_lines():
                    chunks += line.startswith("data:")
                    if drop and chunks == 2:
                        break  # hang up mid-stream
        except httpx.HTTPError:
            with lock:
                counter["errors"] += 1
        with lock:
            counter["n"] += 1
            counter["dropped"] += bool(drop)
            if counter["n"] == 100:
                marks.put(100)
            if counter["n"] % 100 == 0:
                print(f"soak: {counter['n']} requests", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(len(prompts))))
    done.put(counter)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="shape:tiny")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--drop-every", type=int, default=10, help="Every Nth client hangs up.")
    args = ap.parse_args(argv)

    import httpx  # noqa: PLC0415
    import uvicorn  # noqa: F401, PLC0415  (without the serve extra, fail before the model loads)

    from mlxrun.engine import Engine  # noqa: PLC0415

    model, tok = load_model(args)
    eng = Engine(model, tok, max_batch=args.concurrency,
                 context=args.prompt_tokens + args.gen_tokens + 8, max_queue=4 * args.concurrency)  # fmt: skip
    server, port = start_server(eng, args.model)
    url = f"http://127.0.0.1:{port}/v1"
    # distinct prompts (no two share a prefix), so every request prefills and decodes
    prompts = make_prompts(tok, model.config.vocab_size, args.requests, args.prompt_tokens, 0)
    ctx = mp.get_context("spawn")
    marks, done = ctx.Queue(), ctx.Queue()
    t0 = time.perf_counter()
    p = ctx.Process(target=_clients, args=(url, args.model, prompts, args.gen_tokens,
                                           args.concurrency, args.drop_every, marks, done))  # fmt: skip
    p.start()
    marks.get()
    rss_100 = rss_bytes()
    print(f"soak: RSS after 100 requests {rss_100 / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    counter = done.get()
    p.join()
    seconds = time.perf_counter() - t0
    time.sleep(1.0)  # a hang-up is noticed at the engine's next step
    health = httpx.get(f"http://127.0.0.1:{port}/health").json()
    rss_end = rss_bytes()
    server.should_exit = True
    eng.close()
    report = {
        "requests": counter["n"],
        "hung_up": counter["dropped"],
        "client_errors": counter["errors"],
        "seconds": round(seconds, 1),
        "rss_after_100_mib": round(rss_100 / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth": round(rss_end / rss_100 - 1, 4),
        "health": health,
    }
    print(json.dumps(report, indent=1))
    ok = health["running"] == 0 and health["waiting"] == 0 and rss_end <= 1.10 * rss_100
    sys.exit(0 if ok and not counter["errors"] else 1)


if __name__ == "__main__":
    main()
