"""Grammar engines compared at a Llama-3-sized vocabulary: schema compile time and the
time to compute one token bitmask, for llguidance and xgrammar (whichever is installed).

The vocabulary: the bundled SmolLM2 tokenizer's 49,152 byte-level tokens, grown to 128,256
with concatenations of pairs of them (so the token strings have the shape of a real BPE
vocabulary's: JSON punctuation, spaces, word pieces). The text walked is a document that
fits the schema, tokenized greedily by the engine's own tokenizer; each step computes the
mask for the whole vocabulary, then consumes the next token.

    python benchmarks/grammar_engines.py [--vocab 128256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "address", "tags", "role"],
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@engine.com",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "tags": ["mathematics", "poetry", "engines"],
    "role": "admin",
    "scores": [1.5, 2.25, 99.0],
}


def vocabulary(n: int) -> tuple[list[bytes], int]:
    """(n token byte strings, eos id): SmolLM2's tokens, then pairs of them."""
    import llguidance  # noqa: PLC0415

    import mlxrun  # noqa: PLC0415

    tok = mlxrun.load("smollm2", backend="cpu", progress=False).tokenizer
    lt = llguidance.LLTokenizer(tok._tok.to_str())
    base = [lt.decode_bytes([i]) for i in range(tok.vocab_size)]
    out = list(base)
    i = 0
    while len(out) < n:
        a, b = base[(i * 7919) % len(base)], base[(i * 104729 + 13) % len(base)]
        if a and b:
            out.append(a + b)
        i += 1
    return out[:n], min(tok.eos_token_ids)


def greedy_ids(tokens: list[bytes]) -> list[int]:
    """The document as the longest-match tokens of the vocabulary (both engines walk it)."""
    index = {t: i for i, t in enumerate(tokens)}
    text, ids, p = json.dumps(DOC).encode(), [], 0
    longest = max(len(t) for t in tokens)
    while p < len(text):
        for k in range(min(longest, len(text) - p), 0, -1):
            if text[p : p + k] in index:
                ids.append(index[text[p : p + k]])
                p += k
                break
        else:
            raise SystemExit(f"byte {text[p]} has no token")
    return ids


def bench_llguidance(tokens: list[bytes], eos: int, repeat: int) -> dict:
    import llguidance  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    class G:
        eos_token_id = eos
        bos_token_id = None
        special_token_ids = [eos]

        def __init__(self):
            self.tokens = tokens

        def __call__(self, s):
            return []

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(G()))
    tok_s = time.perf_counter() - t0
    ids = greedy_ids(tokens)
    compiles, masks = [], []
    words = (len(tokens) + 31) // 32
    buf = np.zeros(words, dtype=np.int32)
    for _ in range(repeat):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(NESTED)
        m = llguidance.LLMatcher(lt, grammar)
        assert not m.is_error(), m.get_error()
        # the first mask builds the lexer's states: count it as compile, as xgrammar's does
        m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        compiles.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            masks.append(time.perf_counter() - t0)
            ok = m.consume_token(t)
            assert ok, m.get_error()
    return {"engine": f"llguidance {llguidance.__version__}", "tokenizer_s": tok_s,
            "compile_s": compiles, "mask_us": masks, "tokens": len(ids)}  # fmt: skip


def bench_xgrammar(tokens: list[bytes], eos: int, repeat: int) -> dict:
    import xgrammar as xgr  # noqa: PLC0415

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens),
                             stop_token_ids=[eos])  # fmt: skip
    tok_s = time.perf_counter() - t0
    ids = greedy_ids(tokens)
    bitmask = xgr.allocate_token_bitmask(1, len(tokens))
    compiles, masks = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        cg = compiler.compile_json_schema(json.dumps(NESTED))
        m = xgr.GrammarMatcher(cg)
        compiles.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - t0)
            assert m.accept_token(t)
    return {"engine": f"xgrammar {version('xgrammar')}", "tokenizer_s": tok_s,
            "compile_s": compiles, "mask_us": masks, "tokens": len(ids)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    args = ap.parse_args()
    tokens, eos = vocabulary(args.vocab)
    print(f"vocabulary: {len(tokens)} tokens")
    for name in args.engines.split(","):
        fn = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[name]
        try:
            r = fn(tokens, eos, args.repeat)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        m = sorted(r["mask_us"])
        print(
            f"{r['engine']}: tokenizer setup {r['tokenizer_s']:.2f} s; schema compile "
            f"{', '.join(f'{c * 1e3:.1f}' for c in r['compile_s'])} ms; mask per token over "
            f"{r['tokens']} tokens x {args.repeat}: median {statistics.median(m) * 1e6:.0f} us, "
            f"p90 {m[int(len(m) * 0.9)] * 1e6:.0f} us, max {m[-1] * 1e6:.0f} us"
        )


if __name__ == "__main__":
    main()
