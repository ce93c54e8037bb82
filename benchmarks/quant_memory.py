"""Peak memory of loading a model and running one forward pass, bf16 vs int4, on
PyTorch-CPU and MLX; target: int4 <= 0.35x of bf16.

    python benchmarks/quant_memory.py [--cases smollm2,llama-1b] [--backends cpu,mlx]

Each measurement runs in a fresh subprocess (nothing cached from an earlier case):
- cpu: the process's resident high-water mark (ru_maxrss). It includes the interpreter and
  torch (the "baseline" row: same child, no model) and the safetensors pages the loader
  touches through its memory map, which count as resident while mapped.
- mlx: mx.get_peak_memory() (MLX's own allocations: weights and activations), and RSS.

Weights are random with the real models' shapes (SmolLM2-135M; Llama-3.2-1B), written once
to a temporary directory as bf16 safetensors, and as int4 (g64, bf16 scales) by
`mlxrun.convert.convert(..., quant="int4")`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}
TOKENS = 8


def word_tokenizer_json(vocab_size: int) -> str:
    """A whitespace word-level tokenizer over w0..wN: the benchmark needs ids, not text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


def write_case(root: Path, case: str) -> None:
    """root/bf16 (random) and root/int4 (its `mlxrun convert --quant int4`)."""
    from mlxrun.convert import convert

    write_dense(root / "bf16", SHAPES[case])
    convert(str(root / "bf16"), str(root / "int4"), quant="int4", progress=False)


def write_dense(d: Path, shape: dict) -> None:
    """A random bf16 llama checkpoint with `shape` (one tensor in memory at a time)."""
    from mlxrun.weights import Tensor, bf16_bits, save_safetensors

    H, I, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    rng = np.random.default_rng(0)

    def rand(*s):
        return Tensor("BF16", bf16_bits(rng.standard_normal(s, dtype=np.float32) * 0.02))

    def ones(n):
        return Tensor("BF16", bf16_bits(np.ones(n, np.float32)))

    t = {"model.embed_tokens.weight": rand(V, H), "model.norm.weight": ones(H)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = ones(H)
        t[f"{p}.post_attention_layernorm.weight"] = ones(H)
        for n, (o, k) in {
            "self_attn.q_proj": (H, H),
            "self_attn.k_proj": (kv, H),
            "self_attn.v_proj": (kv, H),
            "self_attn.o_proj": (H, H),
            "mlp.gate_proj": (I, H),
            "mlp.up_proj": (I, H),
            "mlp.down_proj": (H, I),
        }.items():
            t[f"{p}.{n}.weight"] = rand(o, k)
    d.mkdir(parents=True)
    save_safetensors(d / "model.safetensors", t, {"format": "pt"})
    cfg = dict(shape, model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg.update(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    (d / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16")))
    (d / "tokenizer.json").write_text(word_tokenizer_json(V))
    (d / "tokenizer_config.json").write_text("{}")


def _maxrss() -> int:
    """The process's resident high-water mark in bytes (Linux reports KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024)


def child(path: str | None, backend: str) -> None:
    """Load `path` (None: only import the backend) on `backend` in bf16, run one forward
    of TOKENS tokens, print a JSON line of peak numbers."""
    import mlxrun
    from mlxrun.backends import get_backend

    out = {}
    if path is None:
        be = get_backend(backend, "bfloat16")
        be.array(np.ones(4, np.float32))
    else:
        t0 = time.perf_counter()
        m = mlxrun.load(path, backend=backend, dtype="bfloat16", progress=False)
        out["load_s"] = time.perf_counter() - t0
        out["weights"] = m.transformer.weight_bytes()
        out["rss_load"] = _maxrss()
        if backend == "mlx":
            import mlx.core as mx

            out["mlx_load"] = int(mx.get_peak_memory())
        m.logits(list(range(3, 3 + TOKENS)))
    out["rss"] = _maxrss()
    if backend == "mlx":
        import mlx.core as mx

        out["mlx_peak"] = int(mx.get_peak_memory())
    print(json.dumps(out))


def measure(path: Path | None, backend: str) -> dict:
    cmd = [sys.executable, __file__, "--child", backend, str(path) if path else "-"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    if r.returncode:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def file_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="smollm2,llama-1b")
    ap.add_argument("--backends", default="cpu,mlx")
    ap.add_argument("--child", nargs=2, metavar=("BACKEND", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--write", nargs=2, metavar=("CASE", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(None if args.child[1] == "-" else args.child[1], args.child[0])
        return 0
    if args.write:
        write_case(Path(args.write[1]), args.write[0])
        return 0

    gb = 2**30
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = {b: measure(None, b) for b in args.backends.split(",")}
        for case in args.cases.split(","):
            # written by a child too, so this process stays small (its RSS is what a
            # forked child starts from)
            subprocess.run(
                [sys.executable, __file__, "--write", case, str(Path(tmp) / case)], check=True
            )
            dense, q = Path(tmp) / case / "bf16", Path(tmp) / case / "int4"
            files = {"bf16": file_bytes(dense), "int4": file_bytes(q)}
            for b in args.backends.split(","):
                r = {fmt: measure(p, b) for fmt, p in (("bf16", dense), ("int4", q))}
                rows.append((case, b, files, r, base[b]))
    print(f"peak memory: load + one {TOKENS}-token forward, bf16 compute, fresh process each\n")
    print("| model | backend | measure | bf16 GB | int4 GB | int4/bf16 | files bf16 / int4 GB |")
    print("|---|---|---|---:|---:|---:|---:|")
    for case, b, files, r, bl in rows:
        f = f"{files['bf16'] / gb:.3f} / {files['int4'] / gb:.3f}"
        raw = (r["bf16"]["rss"], r["int4"]["rss"])
        net = (raw[0] - bl["rss"], raw[1] - bl["rss"])
        load = (r["bf16"]["rss_load"] - bl["rss"], r["int4"]["rss_load"] - bl["rss"])
        held = (r["bf16"]["weights"], r["int4"]["weights"])
        out = [("RSS", raw), ("RSS - baseline", net), ("  of which load", load)]
        out.append(("weights held", held))
        if b == "mlx":
            out.append(("mx peak", (r["bf16"]["mlx_peak"], r["int4"]["mlx_peak"])))
            out.append(("  mx peak, load", (r["bf16"]["mlx_load"], r["int4"]["mlx_load"])))
        for name, (x, y) in out:
            print(f"| {case} | {b} | {name} | {x / gb:.3f} | {y / gb:.3f} | {y / x:.3f} | {f} |")
    for b, bl in base.items():
        print(f"baseline ({b}: interpreter + backend, no model): RSS {bl['rss'] / gb:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
