"""Timing for `mlxrun bench`: the device's copy bandwidth, and warmed-up, repeated
generations timed with device events on CUDA and host clocks at synchronising yields
elsewhere, reduced to medians and ranges."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .bench_models import kv_ratio, kv_read_bytes, mean_context, weight_bytes
from .generate import generate_step
from .model import Transformer
from .sampling import SamplingParams

# Bytes per copy-bandwidth trial: well past every cache; smaller on CPUs, whose copies are slow.
COPY_BYTES = {"cpu": 256 << 20, "gpu": 1 << 30}
COPY_TRIALS = 7  # timed, after 2 untimed


def _device_key(be) -> str:
    """Which physical memory a backend streams from; rows on one share one bandwidth."""
    if be.device == "cpu":
        return "cpu"
    if be.device in ("mps",) or (be.name == "mlx" and sys.platform == "darwin"):
        return "apple-gpu"
    return "cuda"  # torch cuda, or mlx-cuda


def measure_bandwidth(be) -> list[float]:
    """Copy bandwidth (bytes read + written per second) of `be`'s device, one per trial.

    torch: dst.copy_(src), timed with CUDA events on CUDA; MLX: y = |x| (reads and writes
    every byte once), timed around mx.eval. Buffers are COPY_BYTES and freed after.
    """
    n = COPY_BYTES["cpu" if be.device == "cpu" else "gpu"]
    out = []
    if be.name == "mlx":
        import mlx.core as mx  # noqa: PLC0415

        x = mx.ones((n // 4,), mx.float32)
        mx.eval(x)
        for i in range(COPY_TRIALS + 2):
            mx.synchronize()
            t0 = time.perf_counter()
            y = mx.abs(x)
            mx.eval(y)
            mx.synchronize()
            dt = time.perf_counter() - t0
            del y
            if i >= 2:
                out.append(2 * n / dt)
        del x
        mx.clear_cache()
        return out
    import torch  # noqa: PLC0415

    src = torch.ones(n // 4, dtype=torch.float32, device=be.device)
    dst = torch.empty_like(src)
    for i in range(COPY_TRIALS + 2):
        if be.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            be.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            be.synchronize()
            dt = time.perf_counter() - t0
        if i >= 2:
            out.append(2 * n / dt)
    del src, dst
    if be.device == "cuda":
        torch.cuda.empty_cache()
    return out


def _run_once(
    model: Transformer, prompts: list[list[int]], gen: int, params: SamplingParams
) -> tuple[float, float]:
    """One generation: (TTFT s, decode steps per s over tokens 2..gen).

    On CUDA the times are device events: generate_step calls be.start() once each token is
    queued (the prefill's, then every step's), and the backend records an event there. The
    host is by then queueing the next step, so host clocks would measure launch, not work.
    Elsewhere each yield follows a device-to-host read of the new token (a synchronisation),
    so host clock times at the yields bound the device's work exactly.
    """
    be = model.be
    be.synchronize()
    if be.name == "torch" and be.device == "cuda":
        import torch  # noqa: PLC0415

        begin = torch.cuda.Event(enable_timing=True)
        be.timeline = marks = [begin]
        begin.record()
        try:
            for _ in generate_step(model, prompts, params, gen):
                pass
        finally:
            be.timeline = None
        torch.cuda.synchronize()
        # marks: begin, first token, then one per decode step (gen - 1 of them)
        ttft = begin.elapsed_time(marks[1]) / 1e3
        return ttft, (len(marks) - 2) / (marks[1].elapsed_time(marks[-1]) / 1e3)
    t0 = time.perf_counter()
    times = []
    for _ in generate_step(model, prompts, params, gen):
        times.append(time.perf_counter())
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0])


def _release(be) -> None:
    """Hand the previous row's memory back so the next row's peak is its own."""
    if be.name == "torch" and be.device == "cuda":
        be.release()  # its graph session holds the previous row's model
    gc.collect()
    if be.name == "mlx":
        import mlx.core as mx  # noqa: PLC0415

        mx.clear_cache()
    elif be.device == "cuda":
        import torch  # noqa: PLC0415

        torch.cuda.empty_cache()


def _short_device(be) -> str:
    if be.name == "torch" and be.device == "cuda":
        import torch  # noqa: PLC0415

        return f"cuda ({torch.cuda.get_device_name()}), {be.dtype}"
    return f"{be.device}, {be.dtype}"


@dataclass
class _Run:
    prompt_tokens: int
    gen_tokens: int
    batch: int
    reps: int
    progress: bool
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_quants: list = field(default_factory=lambda: [None])  # KV-cache formats, a row each

    def say(self, msg: str) -> None:
        if self.progress:
            print(f"bench: {msg}", file=sys.stderr, flush=True)

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = np.random.default_rng(0)
        return rng.integers(0, vocab, size=(self.batch, self.prompt_tokens)).tolist()


def _bench_model(
    run: _Run, model: Transformer, params: SamplingParams, peer=None
) -> tuple[dict, dict | None]:
    """Warm up, then time `reps` generations: the BenchRow fields measured on the model.

    `peer(prompt, gen) -> (TTFT s, decode steps/s)` is another engine on the same arrays
    (mlx-lm); its reps alternate with ours, so drifting load on the machine hits both alike.
    Returns (ours, the peer's or None).
    """
    be, cfg = model.be, model.config
    prompts = run.prompts(cfg.vocab_size)
    # Warm-up with the timed shapes: a shorter one leaves cache sizes, allocator blocks and
    # kernel choices of the first timed rep cold (seen on CUDA: TTFT 1.1 s, then 0.18 s).
    _run_once(model, prompts, run.gen_tokens, params)
    if peer is not None:
        peer(prompts[0], run.gen_tokens)
    samples, peer_samples, peak, peer_peak = [], [], 0, 0
    for _ in range(run.reps):
        be.reset_peak_memory()
        samples.append(_run_once(model, prompts, run.gen_tokens, params))
        peak = max(peak, be.peak_memory())
        if peer is not None:
            be.reset_peak_memory()
            peer_samples.append(peer(prompts[0], run.gen_tokens))
            peer_peak = max(peer_peak, be.peak_memory())
    held, per_step = weight_bytes(model, run.batch)
    ctx = mean_context(run.prompt_tokens, run.gen_tokens)
    kv = round(run.batch * kv_read_bytes(cfg, be.dtype, ctx) * kv_ratio(model))
    common = dict(
        weight_bytes=int(held),
        weight_bytes_per_step=int(per_step),
        kv_bytes_per_step=int(kv),
        bytes_per_token=(per_step + kv) / run.batch,
        memory=_device_key(be),
    )
    ours = (
        _timings(run, samples)
        | common
        | dict(peak_memory_bytes=int(peak), description=be.describe())
    )
    if peer is None:
        return ours, None
    return ours, _timings(run, peer_samples) | common | dict(peak_memory_bytes=int(peer_peak))


def _timings(run: _Run, samples: list[tuple[float, float]]) -> dict:
    """(TTFT s, decode steps/s) per rep -> medians, ranges, prefill speed."""
    ttft = [t for t, _ in samples]
    tps = [run.batch * steps for _, steps in samples]
    ttft_med, tps_med = statistics.median(ttft), statistics.median(tps)
    return dict(
        ttft_ms=1e3 * ttft_med,
        prefill_tps=run.batch * run.prompt_tokens / ttft_med,
        decode_tps=tps_med,
        decode_tps_min=min(tps),
        decode_tps_max=max(tps),
        decode_tps_reps=tps,
        ttft_ms_reps=[1e3 * t for t in ttft],
    )
