"""`mlxrun bench --compare transformers`: Hugging Face generate() on the same weights,
device and dtype, timed like mlxrun's rows (mlx-lm, the other peer, is bench_mlxlm.py)."""

from __future__ import annotations

import time

from .bench_models import SHAPE_PREFIX, SHAPES, _Source, kv_read_bytes, mean_context
from .bench_report import BenchRow, _version
from .bench_timing import _device_key, _release, _Run, _short_device, _timings


def _hf_model(src: _Source, be):
    """The same model in transformers on `be`'s torch device and dtype."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()  # generation-config chatter, not results
    transformers.logging.disable_progress_bar()  # GGUF conversion bars would flood stderr
    dt = getattr(torch, be.dtype)
    if src.shape:
        cfg = transformers.LlamaConfig(**SHAPES[src.model.removeprefix(SHAPE_PREFIX)])
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dt)  # random init straight in the compute dtype
        try:
            with torch.device(be.device):
                return transformers.LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    from .loader import resolve_source  # noqa: PLC0415

    path = resolve_source(src.model)
    auto = transformers.AutoModelForCausalLM
    if path.suffix == ".gguf":  # transformers dequantizes GGUF blocks to `dt`
        return auto.from_pretrained(path.parent, gguf_file=path.name, dtype=dt).to(be.device)
    return auto.from_pretrained(path, dtype=dt).to(be.device)


class _PeerLoadError(Exception):
    """transformers could not build the peer model; the run lists it as skipped."""


class _StreamTimer:
    """transformers streamer that records when each generated token arrives (the first
    put is the prompt). put() receives tokens moved to the host, a synchronisation, so the
    device is idle there: a CUDA event recorded then marks the token's end on the device."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list = []
        self.prompt_seen = False

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch  # noqa: PLC0415

        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.marks.append(self.now())

    def end(self) -> None:
        pass

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _hf_once(hf, x, gen: int) -> tuple[float, float]:
    import torch  # noqa: PLC0415

    timer = _StreamTimer(x.device.type == "cuda")
    t0 = timer.now()
    with torch.no_grad():
        hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=gen,
            min_new_tokens=gen,
            do_sample=False,
            streamer=timer,
            pad_token_id=0,
        )
    if timer.cuda:
        torch.cuda.synchronize()
    t = timer.marks
    return timer.seconds(t0, t[0]), (len(t) - 1) / timer.seconds(t[0], t[-1])


def _bench_hf(run: _Run, src: _Source, be) -> BenchRow:
    """transformers' generate() on the same weights, device and dtype, timed like ours."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415, F401 (imported before the clock: not load time)

    run.say(f"transformers on {be.device}: loading")
    t0 = time.perf_counter()
    try:
        hf = _hf_model(src, be).eval()
    except Exception as e:  # the peer's own failure must not discard the rows measured
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _PeerLoadError(f"transformers could not load it: {type(e).__name__}: {msg}") from e
    be.synchronize()
    load_s = time.perf_counter() - t0
    cfg = src.config
    x = torch.tensor(run.prompts(cfg.vocab_size), device=be.device)
    run.say(f"transformers on {be.device}: timing {run.reps} x {run.gen_tokens} tokens")
    _hf_once(hf, x, run.gen_tokens)
    be.reset_peak_memory()
    samples = [_hf_once(hf, x, run.gen_tokens) for _ in range(run.reps)]
    peak = be.peak_memory()
    emb, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    held = sum(int(p.nbytes) for p in hf.parameters())  # shared (tied) parameters once
    per_step = held
    if emb.data_ptr() != head.data_ptr():  # untied: only the gathered rows are read
        per_step += run.batch * int(emb.nbytes) // emb.shape[0] - int(emb.nbytes)
    ctx = mean_context(run.prompt_tokens, run.gen_tokens)
    kv = round(run.batch * kv_read_bytes(cfg, be.dtype, ctx))
    gguf = not src.shape and src.source.endswith(".gguf")
    del hf
    _release(be)
    return BenchRow(
        engine="transformers",
        backend="transformers",
        device=_short_device(be),
        quant="none",
        weights=be.dtype + (" (from GGUF)" if gguf else ""),
        load_s=load_s,
        peak_memory_bytes=int(peak),
        weight_bytes=held,
        weight_bytes_per_step=per_step,
        kv_bytes_per_step=int(kv),
        bytes_per_token=(per_step + kv) / run.batch,
        memory=_device_key(be),
        description=f"transformers {_version('transformers')} generate(), torch on {be.device}",
        notes=["transformers dequantizes GGUF weights to a dense copy"] if gguf else [],
        **_timings(run, samples),
    )
