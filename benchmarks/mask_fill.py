"""Host time to fill a batch's grammar masks, row by row against llguidance's parallel fill
(`mlxrun.structured.fill_masks`), at a Llama 3-sized vocabulary.

    python benchmarks/mask_fill.py --vocab 128256 --batch 1,8,32 --steps 64

Each row follows structured_decode.py's nested-object schema and walks it by tokens drawn
at random from its own mask (a finished row starts a new document), so every step of every
row is a real mask computation. Reported per step: the median and p90 of the serial fill
(one row after the other, as a single thread would) and of the parallel fill, and the
parallel one per row.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def walk(grammars, c, B: int, steps: int, seed: int = 0) -> tuple[list[float], list[float]]:
    from mlxrun.sampling import allowed_np  # noqa: PLC0415
    from mlxrun.structured import fill_masks  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    ms = [grammars.matcher(c) for _ in range(B)]
    words = grammars.words
    serial, parallel = [], []
    out = np.empty((B, words), np.int32)
    for i in range(steps):
        # alternated: the second fill of a state may find the lexer's states built
        for kind in ("serial", "parallel") if i % 2 else ("parallel", "serial"):
            t0 = time.perf_counter()
            if kind == "serial":
                for b, m in enumerate(ms):
                    m.fill(out[b])
            else:
                fill_masks(ms, words, out=out)
            (serial if kind == "serial" else parallel).append(time.perf_counter() - t0)
        ok = allowed_np(out, grammars.vocab)
        for b, m in enumerate(ms):
            ids = np.flatnonzero(ok[b])
            t = int(rng.choice(ids))
            if t in grammars.eos or not m.advance(t) or m.done:
                ms[b] = grammars.matcher(c)
    return serial, parallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()

    from structured_decode import NESTED, json_tokenizer  # noqa: PLC0415

    from mlxrun.structured import Constraint, Grammars  # noqa: PLC0415

    g = Grammars(json_tokenizer(args.vocab), args.vocab)
    c = Constraint.json_schema(NESTED)
    walk(g, c, 1, 4)  # the lexer's first states
    print(f"vocab {args.vocab}, nested-object schema, {args.steps} steps")
    for B in [int(b) for b in args.batch.split(",")]:
        s, p = walk(g, c, B, args.steps)
        s_ms, p_ms = np.array(s) * 1e3, np.array(p) * 1e3
        print(f"batch {B:3d}: serial {np.median(s_ms):7.3f} ms (p90 {np.percentile(s_ms, 90):7.3f})"
              f", parallel {np.median(p_ms):7.3f} ms (p90 {np.percentile(p_ms, 90):7.3f}), "
              f"{np.median(p_ms) * 1e3 / B:6.1f} us a row")  # fmt: skip


if __name__ == "__main__":
    main()
