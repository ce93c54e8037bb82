"""Decode speed with a JSON-schema constraint against the same decode without one, in the
same run on the same model, at batch 1 and batch 32; and schema compile times.

    python benchmarks/structured_decode.py --model shape:llama3-8b --backend cuda \
        --quant int4 --batch 1,32 --gen-tokens 128
    python benchmarks/structured_decode.py --model shape:tiny --backend cpu --batch 1,4 \
        --gen-tokens 16     # a check at a tiny size

A `shape:` model has random weights. Its tokenizer is the bundled SmolLM2's byte-level BPE
cut or grown to the shape's vocabulary (grown with concatenations of pairs of its tokens,
so a 128,256-token vocabulary has the shape of Llama 3's): every token is text, so the
grammar engine's mask is computed over the whole vocabulary as for a real model.

Each row follows a nested-object schema; a row whose document is complete starts a new
one (a fresh matcher), so every step of every row is constrained. Both runs are greedy.
Reported: decode tok/s (summed over the batch, timed after --warmup steps) unconstrained
and constrained, their ratio, the tokenizer setup (llguidance's token trie, once per
model) and the schema's compile time, cold and cached.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                },
            },
            "required": ["street", "city", "zip", "geo"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["id", "name", "active", "address", "tags", "role"],
    "additionalProperties": False,
}


def json_tokenizer(vocab: int):
    """An mlxrun Tokenizer of exactly `vocab` byte-level BPE tokens (see the module doc)."""
    from mlxrun.loader import open_checkpoint  # noqa: PLC0415
    from mlxrun.tokenizer import Tokenizer  # noqa: PLC0415

    base = open_checkpoint("smollm2").tokenizer
    spec = json.loads(base._tok.to_str())
    model = spec["model"]
    items = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    if vocab <= len(items):
        keep = dict(items[:vocab])
        merges = []
        for m in model["merges"]:
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            if a in keep and b in keep and a + b in keep:
                merges.append(m)
        model["merges"] = merges
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < vocab]
    else:
        keep = dict(items)
        words = [w for w, i in items if i >= 17]  # past the special tokens
        n, i = len(words), 0
        while len(keep) < vocab:
            w = words[i % n] + words[(i * 7919 + i // n) % n]
            if w not in keep:
                keep[w] = len(keep)
            i += 1
    model["vocab"] = keep
    eos = min(base.eos_token_ids)
    return Tokenizer.from_json(json.dumps(spec), {}, {eos})


def load(args):
    """(Transformer, Tokenizer) for --model: shape:NAME (random weights) or a checkpoint."""
    from mlxrun.bench import SHAPE_PREFIX, _quant_specs, build_random, shape_config  # noqa: PLC0415

    if not args.model.startswith(SHAPE_PREFIX):
        import mlxrun  # noqa: PLC0415

        m = mlxrun.load(args.model, backend=args.backend, dtype=args.dtype, quant=args.quant,
                        progress=False)  # fmt: skip
        return m.transformer, m.tokenizer
    from mlxrun.backends import get_backend  # noqa: PLC0415

    cfg = shape_config(args.model)
    be = get_backend(args.backend, args.dtype)
    spec = _quant_specs([args.quant or "none"]).get(args.quant or "none")
    return build_random(cfg, be, spec), json_tokenizer(cfg.vocab_size)


def decode_tps(model, prompts, n: int, warmup: int, grammars=None, constraint=None) -> float:
    """Decode tok/s summed over the batch, timed over the steps after `warmup`."""
    from mlxrun.generate import generate_step  # noqa: PLC0415
    from mlxrun.sampling import SamplingParams  # noqa: PLC0415

    B = len(prompts)
    matchers = None if constraint is None else [grammars.matcher(constraint) for _ in range(B)]
    t0 = None
    for i, _ in enumerate(generate_step(model, prompts, SamplingParams(), warmup + n,
                                        matchers=matchers)):  # fmt: skip
        if i == warmup - 1:
            t0 = time.perf_counter()
        if matchers is not None:
            for b, m in enumerate(matchers):
                if m.done or m.error is not None:  # a new document: every step constrained
                    matchers[b] = grammars.matcher(constraint)
    return B * n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:llama3-8b")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="Runs of each; the median is shown.")
    ap.add_argument("--json", dest="json_path", default=None, help="Write the numbers here.")
    args = ap.parse_args()

    from mlxrun.structured import Constraint, Grammars  # noqa: PLC0415

    model, tok = load(args)
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    grammars = Grammars(tok, vocab)
    setup = time.perf_counter() - t0
    c = Constraint.json_schema(NESTED)
    t0 = time.perf_counter()
    m = grammars.matcher(c)
    m.fill(np.zeros(grammars.words, np.int32))  # the first mask builds the lexer's states
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.matcher(c).fill(np.zeros(grammars.words, np.int32))
    warm = time.perf_counter() - t0
    out = {"model": args.model, "backend": model.be.describe(), "quant": args.quant,
           "vocab": vocab, "tokenizer_setup_s": setup, "compile_cold_s": cold,
           "compile_cached_s": warm, "rows": []}  # fmt: skip
    print(f"{args.model} on {model.be.describe()}, vocab {vocab}: tokenizer setup {setup:.2f} s, "
          f"schema compile + first mask {cold * 1e3:.1f} ms cold, {warm * 1e3:.2f} ms cached")  # fmt: skip
    rng = np.random.default_rng(0)
    for B in [int(b) for b in args.batch.split(",")]:
        prompts = [rng.integers(17, vocab, args.prompt_tokens).tolist() for _ in range(B)]
        free, held = [], []
        for _ in range(args.repeat):  # interleaved, so drift affects both alike
            free.append(decode_tps(model, prompts, args.gen_tokens, args.warmup))
            held.append(decode_tps(model, prompts, args.gen_tokens, args.warmup, grammars, c))
        f, h = float(np.median(free)), float(np.median(held))
        out["rows"].append({"batch": B, "unconstrained_tps": f, "constrained_tps": h,
                            "ratio": h / f, "runs": {"free": free, "held": held}})  # fmt: skip
        print(f"batch {B:3d}: unconstrained {f:9.1f} tok/s, constrained {h:9.1f} tok/s "
              f"({100 * h / f:.1f}%)")  # fmt: skip
    if args.json_path:
        with open(args.json_path + ".tmp", "w") as fh:
            json.dump(out, fh, indent=1)
        import os  # noqa: PLC0415

        os.replace(args.json_path + ".tmp", args.json_path)


if __name__ == "__main__":
    main()
