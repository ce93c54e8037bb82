"""Prediction against measurement for the memory planner (issue: memory-aware batch sizing).

For each backend, weight format and batch size from 1 up to the planned maximum, run one
greedy generation of `--prompt-tokens` + `--gen-tokens` in a fresh process and compare the
planner's peak (Plan.peak_bytes: its total, weights + KV + prefill workspace + backend
overhead, or the peak of loading where the plan models it and it is higher: PyTorch CPU)
with the peak measured there: MLX's peak memory (mx.get_peak_memory),
torch.cuda.max_memory_allocated, or, on the PyTorch CPU backend, the process's resident
high-water mark minus its resident size before the model was opened (the interpreter and
libraries are not the model's memory), which includes loading.

The planned maximum batch comes from the device's real budget, or from `--budget-gib` to
plan for a smaller device (a 2-core CI machine cannot run SmolLM2's real maximum of ~270
sequences); the batches run are powers of two up to that maximum, and the maximum itself.

    python benchmarks/memory_vs_plan.py --model smollm2 --backends mlx,cpu --budget-gib 2
    python benchmarks/memory_vs_plan.py --model shape:llama3-8b --backends cuda \
        --quant none,int4 --prompt-tokens 1920 --gen-tokens 128

Models: anything `mlxrun.load` takes, or `shape:NAME` (random weights of a real model's
shapes, made on the device; see mlxrun.bench_models.SHAPES).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import types

GiB = 1 << 30


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_PLAN_FIELDS = ("max_batch", "peak_bytes", "total_bytes", "load_bytes", "weight_bytes",
                "kv_bytes", "workspace_bytes")  # fmt: skip


def _plan(model, backend, quant, prompt, gen, batch, budget_gib):
    """The plan's numbers, made in a process of its own: probing a GPU creates a CUDA
    context (~0.5 GB on an H100) that would stay in this process, beside the measured child,
    and take memory the plan counted as free (the 8B int4 run at its planned maximum ran
    out of memory that way, and completed alone)."""
    cmd = [sys.executable, __file__, "--model", model, "--backends", backend, "--quant", quant,
           "--prompt-tokens", str(prompt), "--gen-tokens", str(gen), "--batch", str(batch),
           "--plan-only"] + ([] if budget_gib is None else ["--budget-gib", str(budget_gib)])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return types.SimpleNamespace(**json.loads(out.stdout.strip().splitlines()[-1]))


def _plan_here(model, backend, quant, context, batch, budget_gib, prompt):
    """The planner's Plan for this run (`prompt` of its `context` tokens prefilled, as
    `generate --batch-size auto` plans it), on the real device or one with `budget_gib`."""
    import dataclasses  # noqa: PLC0415

    from mlxrun.memory import footprint, make_plan, probe_device  # noqa: PLC0415
    from mlxrun.planning import backend_device, model_shapes  # noqa: PLC0415
    from mlxrun.quant.formats import resolve  # noqa: PLC0415

    name, device, dtype = backend_device(backend)
    spec = None if quant == "none" else resolve(quant)
    if model.startswith("shape:"):
        from mlxrun.bench import shape_config  # noqa: PLC0415
        from mlxrun.memory import config_shapes  # noqa: PLC0415

        cfg = shape_config(model[len("shape:") :])
        shapes = config_shapes(cfg)
    else:
        cfg, shapes = model_shapes(model)
    # PyTorch copies a safetensors checkpoint's tensors out of its memory map; a GGUF import
    # (a file) or random weights (shape:) are not a mapped load the plan models.
    mapped = not model.startswith("shape:") and os.path.isdir(_source(model))
    dev = probe_device(name, device)
    if budget_gib is not None:  # a device whose budget is exactly budget_gib
        dev = dataclasses.replace(
            dev, available_bytes=int(budget_gib * GiB) + dev.reserve_bytes, sources={}
        )
    fp = footprint(cfg, shapes, dtype, spec, name)
    return make_plan(
        cfg, fp, dev, context=context, batch=batch, dtype_bytes=2 if dtype != "float32" else 4,
        backend=name, mapped=mapped, prompt_tokens=prompt,
    )  # fmt: skip


def _source(model: str) -> str:
    from mlxrun.loader import resolve_source  # noqa: PLC0415

    return str(resolve_source(model))


def child(args) -> None:
    """One measured run; prints a JSON line."""
    import numpy as np  # noqa: PLC0415

    import mlxrun  # noqa: PLC0415
    from mlxrun.backends import get_backend  # noqa: PLC0415
    from mlxrun.generate import generate_step  # noqa: PLC0415
    from mlxrun.sampling import SamplingParams  # noqa: PLC0415

    be = get_backend(args.backends)
    be.synchronize()
    base = _rss_now()
    if args.model.startswith("shape:"):
        from mlxrun.bench import build_random, shape_config  # noqa: PLC0415
        from mlxrun.quant.formats import resolve  # noqa: PLC0415

        cfg = shape_config(args.model[len("shape:") :])
        spec = None if args.quant == "none" else resolve(args.quant)
        model = build_random(cfg, be, spec)
    else:
        # "none" here means as stored, which is what the plan counts for it
        q = None if args.quant == "none" else args.quant
        m = mlxrun.load(args.model, backend=args.backends, quant=q, progress=False)
        model, cfg = m.transformer, m.transformer.config
        be = model.be
    be.synchronize()
    loaded = model.weight_bytes()
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    be.reset_peak_memory()
    for _ in generate_step(model, prompts, SamplingParams(), args.gen_tokens):
        pass
    be.synchronize()
    if be.name == "torch" and be.device == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    else:
        peak = be.peak_memory()
    print(json.dumps(dict(peak=int(peak), weights=int(loaded))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backends", default="mlx,cpu")
    ap.add_argument("--quant", default="none,int4")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--max-runs", type=int, default=8, help="batches per format, at most")
    ap.add_argument("--batches", default=None, help="these batch sizes (comma list) instead")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)  # child
    ap.add_argument("--plan-only", action="store_true", help=argparse.SUPPRESS)  # child
    args = ap.parse_args()
    if args.plan_only:
        plan = _plan_here(args.model, args.backends, args.quant, args.prompt_tokens + args.gen_tokens,
                          args.batch, args.budget_gib, args.prompt_tokens)  # fmt: skip
        print(json.dumps({f: int(getattr(plan, f)) for f in _PLAN_FIELDS}))
        return None
    if args.batch is not None:
        return child(args)
    context = args.prompt_tokens + args.gen_tokens
    rows = []
    print(
        f"{'backend':8} {'quant':6} {'batch':>5} {'planned':>10} {'measured':>10} "
        f"{'error':>7}   (MiB; context {context}; planned max batch in brackets; 'load': "
        "the plan's peak is loading's)",
        flush=True,
    )
    for backend in args.backends.split(","):
        for quant in args.quant.split(","):
            top = _plan(args.model, backend, quant, args.prompt_tokens, args.gen_tokens, 1,
                        args.budget_gib).max_batch  # fmt: skip
            batches = sorted({b for b in (2**i for i in range(12)) if b <= top} | {top})
            batches = [b for b in batches if b >= 1]
            if args.batches:
                batches = [int(b) for b in args.batches.split(",")]
            elif len(batches) > args.max_runs:  # keep the smallest, the largest, and spread
                pick = np.linspace(0, len(batches) - 1, args.max_runs).round().astype(int)
                batches = [batches[i] for i in sorted(set(pick))]
            for b in batches:
                plan = _plan(args.model, backend, quant, args.prompt_tokens, args.gen_tokens, b,
                             args.budget_gib)  # fmt: skip
                cmd = [sys.executable, __file__, "--model", args.model, "--backends", backend,
                       "--quant", quant, "--prompt-tokens", str(args.prompt_tokens),
                       "--gen-tokens", str(args.gen_tokens), "--batch", str(b)]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    # the error's own line (an OOM names what it tried to allocate and what
                    # was free and reserved), not the traceback around it
                    lines = out.stderr.strip().splitlines() or ["(no output)"]
                    why = next((x for x in lines if "Error" in x and ":" in x), lines[-1])
                    print(f"{backend:8} {quant:6} {b:>5}  failed: {why[:400]}")
                    continue
                got = json.loads(out.stdout.strip().splitlines()[-1])
                # the plan's peak: the generation's total, or loading where that is higher
                err = got["peak"] / plan.peak_bytes - 1
                rows.append(dict(backend=backend, quant=quant, batch=b, max_batch=top,
                                 context=context, planned=plan.peak_bytes,
                                 planned_total=plan.total_bytes, planned_load=plan.load_bytes,
                                 planned_weights=plan.weight_bytes, planned_kv=plan.kv_bytes,
                                 planned_workspace=plan.workspace_bytes,
                                 measured=got["peak"], loaded_weights=got["weights"],
                                 error=err))  # fmt: skip
                _save(args.json, rows)  # after every row: a long sweep cut short keeps them
                print(
                    f"{backend:8} {quant:6} {b:>5} {plan.peak_bytes / 2**20:>10.1f} "
                    f"{got['peak'] / 2**20:>10.1f} {100 * err:>+6.1f}%"
                    + (" load" if plan.load_bytes > plan.total_bytes else "")
                    + (f"   [{top}]" if b == top else ""),
                    flush=True,
                )
    if rows:
        worst = max(abs(r["error"]) for r in rows)
        print(f"worst |error| {100 * worst:.1f}% over {len(rows)} runs (target: within 10%)")


def _save(path: str | None, rows: list) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, path)


if __name__ == "__main__":
    import numpy as np

    main()
