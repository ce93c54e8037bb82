"""Benchmark the fused quantized-linear Triton kernels against cuBLAS bf16 on CUDA.

For Llama-3-8B linear shapes (N x K) and each format: median time (triton.testing.do_bench,
which flushes L2 before every call, so weights come from DRAM as in decode), achieved GB/s
over the bytes the kernel must read/write (packed codes + scales + biases + x + y), the
fraction of the device-to-device copy bandwidth measured in the same run (1 GiB copy, read +
write), and torch.matmul on the dense bf16 weight (cuBLAS) for the same shape. M=1 runs the
GEMV, M=2048 the tensor-core GEMM. Prints a table; with $OUT set, writes $OUT/kernels.json.

    python3 benchmarks/kernels.py [--modes affine4g64,mxfp4] [--sweep] [--m 1,2048] [--flush read]
    python3 benchmarks/kernels.py --modes affine4g64,q4_k,q5_k,q6_k --m 1,32   # GGUF K-quants
    python3 benchmarks/kernels.py --modes q4_k,q5_k,q6_k --check-cpu           # no GPU

K-quant formats (q4_k, q5_k, q6_k: random blocks in quant/kquant_layout.py's layout) run
kqmatmul with its default launch (the sweep is for the affine/fp formats). Every format's
kernel is first checked against its dequantized product; --check-cpu does that alone, at a
tiny size, under the Triton interpreter.

--sweep times several launch configs per shape at M=1 (and a few GEMM tiles at M=2048) and
reports the best next to the default heuristic. Compiles run first in a process pool.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
# per decoder layer: q, k, v, o, gate, up, down; x32 layers, + lm_head
LLAMA_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096)]
LLAMA_LAYER += [(14336, 4096), (14336, 4096), (4096, 14336)]
FORMATS = {
    "affine4g64": ("affine", 4, 64),
    "affine4g32": ("affine", 4, 32),
    "affine4g128": ("affine", 4, 128),
    "mxfp4": ("mxfp4", 4, 32),
    "nvfp4": ("nvfp4", 4, 16),
    "mxfp8": ("mxfp8", 8, 32),
    "affine8g64": ("affine", 8, 64),
    # GGUF K-quants (quant/triton_kquant.py): mode is the GGUF type, "group" its super-block
    "q4_k": ("Q4_K", 4, 256),
    "q5_k": ("Q5_K", 5, 256),
    "q6_k": ("Q6_K", 6, 256),
}


def make_weight(n, k, mode, bits, g, device="cuda", seed=0):
    """Random canonical packed weight (uint32 codes as int32, scales, biases) -> QLinear;
    a K-quant mode (Q4_K, ...): random blocks in the kernels' layout -> KQLinear."""
    from mlxrun.quant import triton_kernels as tk
    from mlxrun.quant import triton_kquant as kq

    if mode in kq.KINDS:
        return kq.random_kquant(mode, n, k, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), generator=gen, device=device)
    w = w.to(torch.int32)
    kg = k // g
    if mode == "affine":
        s = (torch.rand(n, kg, generator=gen, device=device) * 0.01 + 1e-3).to(torch.bfloat16)
        b = (-8 * s.float()).to(torch.bfloat16)
    elif mode == "nvfp4":
        s, b = torch.randint(0x10, 0x3F, (n, kg), generator=gen, device=device), None
        s = s.to(torch.uint8)
    else:
        s, b = torch.randint(118, 125, (n, kg), generator=gen, device=device), None
        s = s.to(torch.uint8)
    return tk.prepare(w, s, b, mode, bits, g)


def matmul(x, w, cfg=None):
    """x @ W^T by the kernel of W's kind: qmatmul (QLinear) or kqmatmul (KQLinear)."""
    from mlxrun.quant import triton_kernels as tk
    from mlxrun.quant import triton_kquant as kq

    if isinstance(w, kq.KQLinear):
        return kq.kqmatmul(x, w, cfg)
    return tk.qmatmul(x, w, cfg)


def default_config(m, w, x):
    """The launch parameters matmul picks for x [m, K] @ W^T."""
    from mlxrun.quant import triton_kernels as tk
    from mlxrun.quant import triton_kquant as kq

    if isinstance(w, kq.KQLinear):
        if m <= tk.GEMV_MAX_M:
            return kq.lane_config(m, w, x.device)
        return kq.choose_kq_config(m, w, x.device)
    return tk.choose_config(m, w, x.device, x.dtype)


def check(fmt, n, k, m, device="cuda") -> float:
    """Relative max error of matmul against x @ dequantized W^T (fp32) on a random weight:
    the kernel timed is the kernel that computes the product."""
    from mlxrun.quant import triton_kernels as tk
    from mlxrun.quant import triton_kquant as kq

    mode, bits, g = FORMATS[fmt]
    w = make_weight(n, k, mode, bits, g, device=device)
    x = torch.randn(m, k, device=device, dtype=torch.float32)
    dq = kq.dequantize_kquant(w) if isinstance(w, kq.KQLinear) else tk.dequantize_torch(w)
    want = x @ dq.float().T
    got = matmul(x, w).float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def cfg_str(c) -> str:
    if c.kernel == "gemv":
        pf = " pf" if getattr(c, "prefetch", False) else ""
        return f"gemv bn{c.block_n} s{c.split_k} w{c.num_warps}{pf}"
    ng = getattr(c, "ng", 1)
    swap = " swap" if getattr(c, "swap", False) else ""
    return f"gemm {c.block_m}x{c.block_n} ng{ng} s{c.split_k} w{c.num_warps}{swap}"


def gemv_sweep(n, k, bits):
    """Candidate GEMV configs for one shape: rows per warp x split-K x prefetch."""
    from mlxrun.quant import triton_kernels as tk

    ksteps = math.ceil(k * bits / 32 / 128)
    out, seen = [], set()
    for bn in (8, 16):
        for split in (1, 2, 4, 7, 14):
            if split > ksteps:
                continue
            per = math.ceil(ksteps / split)
            split = math.ceil(ksteps / per)
            for pf in (True, False) if per > 1 else (False,):
                key = (bn, split, pf)
                if key not in seen:
                    seen.add(key)
                    out.append(tk.KernelConfig("gemv", 1, bn, split, prefetch=pf))
    return out


def gemm_sweep(g):
    from mlxrun.quant import triton_kernels as tk

    kc = tk.KernelConfig
    return [
        kc("gemm", 128, 128, 1, ng=max(1, 128 // g), num_warps=8, num_stages=3),
        kc("gemm", 128, 128, 1, ng=max(1, 64 // g), num_warps=8, num_stages=3),
        kc("gemm", 128, 128, 1, ng=max(1, 128 // g), num_warps=8, num_stages=3, swap=True),
        kc("gemm", 128, 256, 1, ng=max(1, 64 // g), num_warps=8, num_stages=3),
        kc("gemm", 64, 128, 1, ng=max(1, 128 // g), num_warps=4, num_stages=4),
    ]


def _compile_job(job):
    """Worker: run one (shape, format, m, config) once so that Triton caches the binary."""
    fmt, n, k, m, cfg = job
    try:
        mode, bits, g = FORMATS[fmt]
        w = make_weight(n, k, mode, bits, g)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        matmul(x, w, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported by the main process, which runs the same call again
        return f"{fmt} {n}x{k} m={m} {cfg}: {type(e).__name__}: {str(e)[:300]}"


def precompile(jobs, procs):
    import multiprocessing as mp

    t0 = time.time()
    with mp.get_context("spawn").Pool(procs) as pool:
        errs = [e for e in pool.map(_compile_job, jobs, chunksize=1) if e]
    print(f"precompiled {len(jobs)} launches in {time.time() - t0:.0f} s, {len(errs)} errors")
    for e in errs[:10]:
        print("  ", e)


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median") * 1e-3
    return 2 * src.numel() / t


FLUSH = "zero"  # set from --flush


def bench(fn) -> float:
    """Median seconds of fn with L2 flushed before each call.

    zero: triton.testing.do_bench, which flushes by zeroing a 256 MB buffer. That leaves L2
    full of dirty lines, so a kernel reading B < 50 MB also pays ~B of write-back (seen in
    run 3: small shapes measure ~2x their bytes, cuBLAS too). read: flush by reading a
    256 MB buffer instead (clean lines), then keep the GPU busy ~100 us so that the host
    launch of fn never leaves the GPU idle inside the timed interval; CUDA events; not yet
    run on a GPU.
    """
    if FLUSH == "zero":
        from triton.testing import do_bench

        return do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e-3
    buf = _flush_buffer()
    for _ in range(5):
        fn()
    times = []
    for _ in range(60):
        buf.sum()  # reads only: evicts the previous call's lines without dirtying L2
        torch.cuda._sleep(200_000)  # GPU busy while the host launches fn
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return ms[len(ms) // 2] * 1e-3


_FLUSH_BUF = []


def _flush_buffer() -> torch.Tensor:
    if not _FLUSH_BUF:
        _FLUSH_BUF.append(torch.ones(64 << 20, dtype=torch.float32, device="cuda"))
    return _FLUSH_BUF[0]


_WEIGHTS = {}


def run_case(fmt, n, k, m, cfgs, copy_bw):

    mode, bits, g = FORMATS[fmt]
    if (fmt, n, k) not in _WEIGHTS:
        _WEIGHTS.clear()  # one weight at a time (the lm_head alone is 300 MB)
        _WEIGHTS[(fmt, n, k)] = make_weight(n, k, mode, bits, g)
    w = _WEIGHTS[(fmt, n, k)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    nbytes = w.nbytes + x.numel() * 2 + m * n * 2
    res = {"fmt": fmt, "n": n, "k": k, "m": m, "bytes": nbytes}
    times = {}
    for cfg in cfgs:
        try:
            t = bench(lambda cfg=cfg: matmul(x, w, cfg))
        except Exception as e:
            print(f"  {fmt} {n}x{k} m={m} {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        times[cfg] = t
    default = default_config(m, w, x)
    try:
        t_def = bench(lambda: matmul(x, w))
    except Exception as e:
        print(f"  {fmt} {n}x{k} m={m} default failed: {type(e).__name__}: {str(e)[:300]}")
        t_def = math.inf
    best_cfg = min(times, key=times.get) if times else default
    t_best = min(t_def, times.get(best_cfg, t_def))
    res.update(
        t_default=t_def,
        default_cfg=cfg_str(default),
        t_best=t_best,
        best_cfg=cfg_str(best_cfg if times.get(best_cfg, 1e9) < t_def else default),
        gbps=nbytes / t_def / 1e9,
        frac_copy=nbytes / t_def / copy_bw,
        best_frac_copy=nbytes / t_best / copy_bw,
        sweep={cfg_str(c): t for c, t in times.items()},
    )
    if m > 1:
        res["tflops"] = 2 * m * n * k / t_def / 1e12
    return res


def run_cublas(n, k, m):
    wd = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    t = bench(lambda: x @ wd.T)
    nbytes = (n * k + m * k + m * n) * 2
    return {"t": t, "bytes": nbytes, "gbps": nbytes / t / 1e9, "tflops": 2 * m * n * k / t / 1e12}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(FORMATS))
    ap.add_argument("--m", default="1,2048")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-modes", default="affine4g64,mxfp4,mxfp8")
    ap.add_argument("--procs", type=int, default=12)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--flush", choices=["zero", "read"], default="zero")
    ap.add_argument("--check-cpu", action="store_true",
                    help="check each format's kernel against its dequantized product at a "
                    "tiny size under TRITON_INTERPRET=1 (no GPU), then exit")  # fmt: skip
    args = ap.parse_args(argv)
    global FLUSH
    FLUSH = args.flush
    fmts = [f for f in args.modes.split(",") if f]
    if args.check_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by mlxrun's kernels)
        bad = 0
        for fmt in fmts:
            for m in (1, 20):  # the GEMV and the GEMM
                err = check(fmt, 16, 512, m, device="cpu")
                bad += err > 1e-5
                print(f"{fmt:12s} 16x512 m={m:<3d} max error {err:.1e} of the largest output")
        return 1 if bad else 0
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from mlxrun.quant import triton_kernels as tk

    for fmt in fmts:  # each kernel timed computes its product
        err = max(check(fmt, 512, 4096, m) for m in (1, 64))
        print(f"{fmt}: max error {err:.1e} of the largest output (M=1 and 64, 512x4096)")
        if err > 1e-3:
            print(f"  {fmt}: the kernel's product differs from the dequantized one")
            return 1
    ms = [int(v) for v in args.m.split(",")]
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")

    # what each (format, shape, m) will time: the default config plus the sweep candidates
    plan = {}
    for m in ms:
        for fmt in fmts:
            mode, bits, g = FORMATS[fmt]
            for n, k in shapes:
                if m > tk.GEMV_MAX_M and n > 100000:
                    continue
                cfgs = []
                if args.sweep and fmt in args.sweep_modes.split(",") and n < 100000:
                    if m <= tk.GEMV_MAX_M:
                        cfgs = gemv_sweep(n, k, bits)
                    elif (n, k) in ((4096, 4096), (14336, 4096)):
                        cfgs = gemm_sweep(g)
                plan[(fmt, n, k, m)] = cfgs
    jobs = [(f, n, k, m, c) for (f, n, k, m), cfgs in plan.items() for c in cfgs + [None]]
    if args.procs > 1:
        precompile(jobs, args.procs)

    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e12:.3f} TB/s (read + write)")
    out = {"device": props.name, "copy_bw": copy_bw, "results": [], "cublas": {}}
    for n, k in shapes:
        for m in ms:
            out["cublas"][f"{n}x{k}x{m}"] = run_cublas(n, k, m)
    for (fmt, n, k, m), cfgs in plan.items():
        r = run_case(fmt, n, k, m, cfgs, copy_bw)
        out["results"].append(r)
        if os.environ.get("OUT"):  # incremental: a run cut short still leaves its numbers
            with open(os.path.join(os.environ["OUT"], "kernels.json"), "w") as f:
                json.dump(out, f, indent=1, default=str)
        cb = out["cublas"][f"{n}x{k}x{m}"]
        extra = f" | sweep best {r['t_best'] * 1e6:7.1f} us {r['best_cfg']}" if cfgs else ""
        print(f"{fmt:12s} {n:6d}x{k:<6d} m={m:<5d} {r['t_default'] * 1e6:8.1f} us "
              f"{r['gbps']:7.0f} GB/s {r['frac_copy'] * 100:5.1f}% copy | cuBLAS bf16 "
              f"{cb['t'] * 1e6:8.1f} us x{cb['t'] / r['t_default']:.2f}{extra}")  # fmt: skip

    # summary table (the end of the output is what comes back first)
    print("\n== M=1 GEMV: GB/s, % of copy BW, speed-up over cuBLAS bf16 (default config)")
    rows = [r for r in out["results"] if r["m"] == 1]
    hdr = "format      " + "".join(f"{f'{n}x{k}':>24s}" for n, k in shapes)
    print(hdr)
    for fmt in fmts:
        cells = []
        for n, k in shapes:
            r = next((r for r in rows if r["fmt"] == fmt and (r["n"], r["k"]) == (n, k)), None)
            if r is None:
                cells.append(f"{'-':>24s}")
                continue
            cb = out["cublas"][f"{n}x{k}x1"]
            cells.append(
                f"{r['gbps']:6.0f} {r['frac_copy'] * 100:4.0f}% x{cb['t'] / r['t_default']:4.2f}"
            )
        print(f"{fmt:12s}" + "".join(f"{c:>24s}" for c in cells))
    cb_row = [out["cublas"].get(f"{n}x{k}x1") for n, k in shapes]
    print("cublas bf16 " + "".join(f"{c['gbps']:6.0f} {c['gbps'] * 1e9 / copy_bw * 100:4.0f}%{'':6s}"
                                   if c else "" for c in cb_row))  # fmt: skip
    # whole-model decode estimate from the per-shape GEMV times (linears only)
    for fmt in fmts:
        t = {(r["n"], r["k"]): r["t_default"] for r in rows if r["fmt"] == fmt}
        tb = {(r["n"], r["k"]): r["t_best"] for r in rows if r["fmt"] == fmt}
        if all(s in t for s in LLAMA_LAYER + [(128256, 4096)]):
            tok = 32 * sum(t[s] for s in LLAMA_LAYER) + t[(128256, 4096)]
            tokb = 32 * sum(tb[s] for s in LLAMA_LAYER) + tb[(128256, 4096)]
            out.setdefault("decode_estimate", {})[fmt] = {"s_per_token": tok, "best": tokb}
            print(f"{fmt:12s} 8B linears per token: {tok * 1e3:.2f} ms -> {1 / tok:.0f} tok/s "
                  f"(sweep best {1 / tokb:.0f} tok/s)")  # fmt: skip
    gemm = [r for r in out["results"] if r["m"] > tk.GEMV_MAX_M]
    if gemm:
        print("\n== GEMM: TFLOP/s, time vs cuBLAS bf16")
        for r in gemm:
            cb = out["cublas"][f"{r['n']}x{r['k']}x{r['m']}"]
            print(f"{r['fmt']:12s} {r['n']:6d}x{r['k']:<6d} m={r['m']:<5d} {r['tflops']:6.0f} "
                  f"TFLOP/s  {r['t_default'] * 1e6:8.1f} us  cuBLAS {cb['tflops']:5.0f} TFLOP/s "
                  f"{cb['t'] * 1e6:8.1f} us  ratio x{cb['t'] / r['t_default']:.2f}  "
                  f"best {r['t_best'] * 1e6:.1f} us {r['best_cfg'] if r['sweep'] else ''}")  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kernels.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
