"""Batch-1 GEMV launch variants timed in the model's decode step (CUDA, random weights).

    python3 benchmarks/gemv_loop_ab.py [--model shape:llama3-8b] [--quant int4,fp4]
        [--variants default,seq,down-w2] [--context 512] [--steps 64] [--rounds 3]
    python3 benchmarks/gemv_loop_ab.py --warm seq --quant int4   # compile only (no model)

Each variant changes `choose_config`'s GEMV settings for some shapes (names below, joined
by "+"); the decode step is captured as a CUDA graph once per variant over one KV cache
(prefilled with `context` tokens), and the graphs are replayed alternately, `steps` steps a
measurement, `rounds` rounds, the cache rewound to `context` each time: ms a step. A
variant that touches one shape class gives that shape's cost in the loop (isolated timings
have disagreed with the loop before: KERNEL_NOTES.md). --warm builds each shape's weight
alone and runs the variant's kernels once, filling Triton's cache (run one process a
variant in parallel before the timed run: the compiles dominate).

Variants: default; early (each k-step's scales loaded with its words: the first before the
PDL wait); early-1 (early where a split has one k-step); late (early off); seq (16-row tiles: each k-step's two 8-row halves one after the other);
down-w2 (K > N, the down projection: 8 rows, 2 warps, no split: whole k-steps, no masks);
down-s2 (down: split K in 2 across programs); small-r8 (q/k/v and o: 8-row tiles);
o-w2 (N == K: 2 warps); qkv-w2 (K < N < 2K: 2 warps); gu-r8 (the joint gate/up in 8-row
tiles); head-r8 (the head in 8-row tiles); gemv4-old (the fp4 formats' launches with
MLXRUN_GEMV4=old: before their 2026-11-26 sweep).
8-bit (int8, fp8): old (the one-shot GEMV everywhere, MLXRUN_GEMV8=old); rules (without the
per-linear launch table, MLXRUN_GEMV8_LAUNCH=none); gu-old, down-old,
head-old (the one-shot GEMV on that shape only); and of the streaming GEMV: p2, p3, p5
(programs a SM), bal (as many tiles for every program), down-r8 / down-r16 (the down
projection's stream in 8- / 16-row tiles), head-r8, gu-r8s (the gate/up's stream at 8 rows),
ahead (every stream in 8-row tiles, the next tile's words issued ahead: MLXRUN_STREAM_AHEAD=1);
ROLE=V (ROLE: qkv, o, small = both, gu, down, head) gives that shape gemv8_sweep.py's launch
variant V (gBNwWsS[nopf], sBNwWpP[b], cBNwWpP[b], aBNwWpP), e.g. small=g8w4s2+gu=c16w4p3.
fp4 (mxfp4, nvfp4): xvec (the GEMV's x a k-step at a time in 16-byte loads; xvec-nd: not on
the down projection); quads (the gate/up's scales as two 4-row runs a lane, not through
shared memory; no-quads: off); loads-old (neither, nor early, nor nvfp4's decodes:
MLXRUN_GEMV4_LOADS=0); cvt (nvfp4's E4M3 scales by the hardware conversion), pair (that and
E2M1 positions 3 and 7 from one mask, mxfp4's too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

FMT = {"int4": ("affine", 4, 64), "fp4": ("mxfp4", 4, 32), "nvfp4": ("nvfp4", 4, 16),
       "int8": ("affine", 8, 64), "fp8": ("mxfp8", 8, 32)}  # fmt: skip


def _role(w) -> str:
    """The 8B-style linear a weight is, by its shape, q/k/v and o together as "small"."""
    from mlxrun.quant.triton_launch import role8

    role = role8(w)
    return "small" if role in ("qkv", "o") else role


def _old(c, w, orig, args):
    """choose_config's pick with the one-shot 8-bit GEMV (MLXRUN_GEMV8=old)."""
    from mlxrun.quant import triton_launch

    saved = triton_launch.GEMV8
    triton_launch.GEMV8 = "old"
    try:
        return orig(*args)
    finally:
        triton_launch.GEMV8 = saved


def _apply8(part: str, c, w, orig, args):
    """The 8-bit parts: None where `part` is not one of them."""
    r = dataclasses.replace
    if "=" in part:  # ROLE=V: gemv8_sweep.py's variant V on that shape
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from gemv8_sweep import config  # noqa: PLC0415

        role, v = part.split("=")
        if v in ("old", "new"):  # those call choose_config, patched here
            raise SystemExit(f"{part!r}: name a launch (g16w4s1, c16w4p4), not {v!r}")
        from mlxrun.quant.triton_launch import role8  # noqa: PLC0415

        ok = role == role8(w) or (role == "small" and _role(w) == "small")
        return config(v, 1, w, None) if ok else c
    if part == "old":
        return _old(c, w, orig, args)
    if part == "rules":  # choose_config without its per-linear table (MLXRUN_GEMV8_LAUNCH=none)
        from mlxrun.quant import triton_launch

        saved, triton_launch.GEMV8_LAUNCH = triton_launch.GEMV8_LAUNCH, {}
        try:
            return orig(*args)
        finally:
            triton_launch.GEMV8_LAUNCH = saved
    if part in ("gu-old", "down-old", "head-old"):
        return _old(c, w, orig, args) if _role(w) == part.split("-")[0] else c
    if c.kernel != "stream":
        return (
            c
            if part in ("p2", "p3", "p5", "bal", "down-r8", "down-r16", "gu-r8s", "ahead")
            else None
        )
    if part == "ahead":
        return r(c, block_n=8, ahead=True)
    if part in ("p2", "p3", "p5"):
        return r(c, per_sm=int(part[1]))
    if part == "bal":
        return r(c, balance=True)
    if part in ("down-r8", "down-r16"):
        return r(c, block_n=int(part[6:])) if _role(w) == "down" else c
    if part == "gu-r8s":
        return r(c, block_n=8) if _role(w) == "gu" else c
    if part == "head-r8":
        return r(c, block_n=8) if _role(w) == "head" else c
    return None


def _apply(part: str, c, w):
    r = dataclasses.replace
    if part in ("default", "gemv4-old", "cvt", "pair"):  # applied in patch
        return c
    if part == "xvec":  # fp4: a k-step's x as 16-byte loads a lane
        return r(c, xvec=True) if c.kernel == "gemv" else c
    if part == "xvec-nd":  # xvec but not on the down projection (K > N)
        return r(c, xvec=w.k <= w.n) if c.kernel == "gemv" else c
    if part == "loads-old":  # fp4: x a position at a time, the scales after the FMAs, the
        # old decodes (MLXRUN_GEMV4_LOADS=0; those in patch)
        fp4 = w.mode in ("mxfp4", "nvfp4")
        return r(c, xvec=False, early=False, quads=False) if fp4 and c.kernel == "gemv" else c
    if part == "no-quads":
        return r(c, quads=False) if c.kernel == "gemv" else c
    if part == "quads":  # fp4 gate/up (SiLU, 8 rows): the scales as two 4-row runs a lane
        return r(c, quads=True) if c.kernel == "gemv" else c
    if part == "early":
        return r(c, early=True)
    if part == "late":  # the scales after the FMAs (the shipped default before early)
        return r(c, early=False)
    if part == "early-1":  # only where a split has one k-step
        from mlxrun.quant import triton_kernels as tk

        return r(c, early=True) if tk._gemv_constexprs(w, c)["KB_PER_SPLIT"] == 1 else c
    if part == "seq":
        return r(c, seq=True) if c.block_n == 16 else c
    if part == "down-w2":
        return r(c, num_warps=2, block_n=8, split_k=1) if w.k > w.n else c
    if part == "down-s2":
        return r(c, split_k=2) if w.k > w.n else c
    if part == "small-r8":
        return r(c, block_n=8) if w.n * w.k <= 6144 * 4096 and w.k >= w.n * 2 // 3 else c
    if part == "o-w2":
        return r(c, num_warps=2) if w.n == w.k else c
    if part == "gu-r8":  # the joint gate/up (SiLU epilogue: 4 gate rows and their 4 up)
        return r(c, block_n=8) if 2 * w.k < w.n < 16 * w.k else c
    if part == "head-r8":
        return r(c, block_n=8) if w.n >= 16 * w.k else c
    if part == "qkv-w2":
        return r(c, num_warps=2) if w.k < w.n < 2 * w.k else c
    raise SystemExit(f"unknown variant part {part!r}")


def patch(name: str):
    """Make triton_kernels.choose_config pick the variant's GEMV settings; returns undo."""
    from mlxrun.quant import triton_kernels as tk

    orig = tk.choose_config
    parts = name.split("+")

    def choose(m, w, device, x_dtype=None):
        if "gemv4-old" in parts:  # the fp4 launches before the 2026-11-26 sweep
            from mlxrun.quant import triton_launch

            saved, triton_launch.GEMV4 = triton_launch.GEMV4, "old"
            try:
                c = orig(m, w, device, x_dtype)
            finally:
                triton_launch.GEMV4 = saved
        else:
            c = orig(m, w, device, x_dtype)
        if c.kernel not in ("gemv", "stream"):
            return c
        for p in parts:
            c8 = _apply8(p, c, w, orig, (m, w, device, x_dtype)) if w.bits == 8 else None
            c = c8 if c8 is not None else c if c.kernel == "stream" else _apply(p, c, w)
        return c

    tk.choose_config = choose
    restore = _decode_variant(parts)

    def undo():
        tk.choose_config = orig
        restore()

    return undo


def _decode_variant(parts):
    """cvt / pair / loads-old (fp4): the GEMV recompiled with nvfp4's E4M3 scales by cvt
    (pair: and E2M1 positions 3 and 7 from one mask, mxfp4's too; MLXRUN_GEMV4=new decodes,
    with the default launches), or with the decodes before GEMV4_LOADS
    (MLXRUN_GEMV4_LOADS=0), until the returned restore() (the modules are reloaded, as the
    decode switches are read at import; the variant's kernels must be compiled and captured
    before it)."""
    dec = [p for p in parts if p in ("cvt", "pair", "loads-old")]
    if not dec:
        return lambda: None
    import importlib

    from mlxrun.quant import triton_decode, triton_gemv, triton_gemv_step, triton_launch
    from mlxrun.quant import triton_kernels as tk

    saved = (triton_launch.GEMV4, triton_launch.E2M1_PAIR_ON, triton_launch.GEMV4_LOADS,
             tk._gemv_kernel)  # fmt: skip
    if "loads-old" in dec:
        triton_launch.GEMV4_LOADS = False
    else:
        triton_launch.GEMV4, triton_launch.E2M1_PAIR_ON = "new", "pair" in dec
    importlib.reload(triton_decode)
    importlib.reload(triton_gemv_step)
    tk._gemv_kernel = importlib.reload(triton_gemv)._gemv_kernel
    triton_launch.GEMV4 = saved[0]  # the launches stay the default's
    triton_launch.GEMV4_LOADS = saved[2]

    def restore():
        triton_launch.E2M1_PAIR_ON = saved[1]
        importlib.reload(triton_decode)
        importlib.reload(triton_gemv_step)
        importlib.reload(triton_gemv)
        tk._gemv_kernel = saved[3]

    return restore


def _shapes(cfg):
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return [(q + 2 * kv, H, False), (H, q, False), (2 * I, H, True), (H, I, False), (V, H, False)]


def changes(cfg, quant: str, variant: str) -> bool:
    """Whether the variant changes any of the shapes' GEMV settings under this quant."""
    import types

    from mlxrun.quant import triton_kernels as tk

    mode, bits, g = FMT[quant]
    dev = torch.device("cuda", torch.cuda.current_device())
    ws = [types.SimpleNamespace(n=n, k=k, bits=bits, group_size=g, mode=mode)
          for n, k, _ in _shapes(cfg)]  # fmt: skip
    parts = variant.split("+")
    if "pair" in parts or "cvt" in parts:  # a decode, not a launch (cvt: nvfp4's scales)
        return mode in ("mxfp4", "nvfp4") if "pair" in parts else mode == "nvfp4"
    old = [tk.choose_config(1, w, dev, torch.bfloat16) for w in ws]
    undo = patch(variant)
    new = [tk.choose_config(1, w, dev, torch.bfloat16) for w in ws]
    undo()
    return old != new


def warm(cfg, quant: str, variant: str) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from kernels import make_weight  # noqa: PLC0415

    from mlxrun.quant import triton_kernels as tk

    undo = patch(variant)
    mode, bits, g = FMT[quant]
    for n, k, silu in _shapes(cfg):
        w = make_weight(n, k, mode, bits, g)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t0 = time.time()
        tk.qmatmul(x, w, silu=silu and tk.silu_fusable(x, w))
        torch.cuda.synchronize()
        c = tk.choose_config(1, w, x.device, x.dtype)
        print(f"{quant} {variant} {n}x{k}: {c.kernel} {c.block_n} rows w{c.num_warps} "
              f"s{c.split_k} p{c.per_sm} bal={c.balance} {time.time() - t0:.1f} s", flush=True)  # fmt: skip
        del w
    undo()


def profile(model, cache, context: int, variant: str, steps: int = 3) -> dict:
    """Per-kernel device time of eager decode steps under `variant` (torch.profiler); the
    GEMVs by role, from their order in a step (q/k/v, o, gate/up, down a layer, then the
    head). Launched with PDL, a kernel's time includes its wait for the one before."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    undo = patch(variant)
    be = model.be
    y = torch.zeros((1, 1), dtype=torch.int64, device="cuda")
    cache.offset = context
    for _ in range(2):
        y = be.argmax(model(y, cache, None, last_only=True)).view(1, 1)
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            y = be.argmax(model(y, cache, None, last_only=True)).view(1, 1)
        torch.cuda.synchronize()
    undo()
    evs = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per: dict = {}
    gemv = [e for e in evs if "_gemv_kernel" in e.name or "_gemv_stream_kernel" in e.name]
    n = len(gemv) // steps
    roles = ["qkv", "o", "gate_up", "down"]
    for i, e in enumerate(gemv):
        j = i % n
        r = "head" if j >= n - 1 else roles[j % 4]
        per.setdefault("gemv " + r, []).append(e.device_time_total)
    for e in evs:
        if "_gemv_kernel" not in e.name and "_gemv_stream_kernel" not in e.name:
            per.setdefault(e.name[:60], []).append(e.device_time_total)
    return {k: (sum(v) / steps, len(v) // steps) for k, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:llama3-8b")
    ap.add_argument("--quant", default="int4,fp4")
    ap.add_argument("--variants", default="default,seq")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", default=None, help="compile this variant's kernels only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default="", help="variants to profile (per-kernel times)")
    a = ap.parse_args()
    from mlxrun.backends.cuda_graph import GraphDecoder
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.bench import _quant_specs, build_random, shape_config
    from mlxrun.memory import prefill_chunk_for

    cfg = shape_config(a.model)
    if a.warm:
        for q in a.quant.split(","):
            warm(cfg, q, a.warm)
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    out = {}
    be = TorchBackend("cuda", "bfloat16")
    for qn, spec in _quant_specs(a.quant.split(",")).items():
        variants = a.variants.split(",")
        variants = variants[:1] + [v for v in variants[1:] if changes(cfg, qn, v)]
        t0 = time.time()
        model = build_random(cfg, be, spec)
        cache = model.make_cache(1, a.context + a.steps + 16)
        ids = torch.randint(0, cfg.vocab_size, (1, a.context), device="cuda")
        chunk = prefill_chunk_for(be.name, be.memory_kind, 1)
        for s in range(0, a.context, chunk):
            model(ids[:, s : s + chunk], cache, None, last_only=True)
        torch.cuda.synchronize()
        print(f"{qn}: model and prefill {time.time() - t0:.1f} s", flush=True)
        if a.profile:
            for v in a.profile.split(","):
                try:
                    per = profile(model, cache, a.context, v)
                except Exception as e:  # the A/B below matters more
                    print(f"  profile {qn} {v} failed: {type(e).__name__}: {e}")
                    break
                tot = sum(t for t, _ in per.values())
                print(f"  profile {qn} {v}: {tot / 1e3:.3f} ms of kernels a step", flush=True)
                for k, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:9]:
                    print(f"    {t / 1e3:7.3f} ms x{c:<4d} {t / max(c, 1):6.2f} us  {k}")
                out.setdefault("profile", {})[f"{qn} {v}"] = per
        decs, toks = {}, {}
        for v in variants:
            t0 = time.time()
            undo = patch(v)
            cache.offset = a.context
            decs[v] = GraphDecoder(model, cache, 1, None)
            undo()
            toks[v] = decs[v].tok.view(-1)
            print(f"  captured {v} in {time.time() - t0:.1f} s", flush=True)
        res = {v: [] for v in variants}
        for _ in range(a.rounds):
            for v in variants:
                dec = decs[v]
                cache.offset = a.context
                cache.rewind()
                dec(toks[v])  # warm
                cache.offset = a.context
                cache.rewind()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(a.steps):
                    dec(toks[v])
                e1.record()
                torch.cuda.synchronize()
                res[v].append(e0.elapsed_time(e1) / a.steps)
        base = min(res[variants[0]])
        for v in variants:
            ms = res[v]
            print(f"  {qn} {v:24s} ms/step " + " ".join(f"{t:.4f}" for t in ms)
                  + f"  min {min(ms):.4f} ({1e3 / min(ms):.1f} tok/s, "
                  f"{100 * (min(ms) / base - 1):+.2f}% vs {variants[0]})", flush=True)  # fmt: skip
        out[qn] = res
        if a.json:  # after each quant: a later one may run out of time
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        for d in decs.values():
            d.close()
        del decs, model, cache
        be.release()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
