"""The Python API: `mlxrun.load(...)` returns a Model with generate / stream / logits."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from .errors import MlxrunError
from .generate import GenerationResponse, generate, stream
from .sampling import SamplingParams


class Model:
    """A loaded model on one backend.

    `tokenizer` encodes, decodes and applies the chat template; `backend` says where it runs;
    `notes` lists what loading decided that the user should know (unquantized layers).
    """

    def __init__(
        self,
        transformer,
        tokenizer,
        source: str,
        notes: list[str],
        load_time: float,
        shapes: dict,
        quant=None,
    ):
        self.transformer = transformer
        self._shapes = shapes  # {tensor: (shape, dtype)} as stored, for memory plans
        self.quant = quant
        self.tokenizer = tokenizer
        self.config = transformer.config
        self.backend = transformer.be
        self.source = source
        self.notes = notes
        self.load_time = load_time

    def __repr__(self) -> str:
        return f"<mlxrun.Model {self.source} on {self.backend.describe()}>"

    def _ids(self, prompt: str, system: str | None, chat: bool | None) -> list[int]:
        return self.tokenizer.prompt_ids(prompt, system=system, chat=chat)

    def stream(
        self,
        prompt: str,
        max_tokens: int = 256,
        *,
        system: str | None = None,
        chat: bool | None = None,
        stop: list[str] | None = None,
        **sampling,
    ) -> Iterator[GenerationResponse]:
        """Yield GenerationResponse pieces (text, token, running stats, finish_reason).

        sampling: temperature, top_p, top_k, min_p, repetition_penalty, seed.
        """
        ids = self._ids(prompt, system, chat)
        yield from stream(
            self.transformer,
            self.tokenizer,
            ids,
            SamplingParams(**sampling),
            max_tokens=max_tokens,
            stop=stop,
        )

    def generate(
        self,
        prompt: str | list[str],
        max_tokens: int = 256,
        *,
        system: str | None = None,
        chat: bool | None = None,
        stop: list[str] | None = None,
        batch_size: int | str = "auto",
        **sampling,
    ) -> str | list[str]:
        """The whole answer as a string (same options as `stream`). A list of prompts runs
        as batches (`generate_many`, batch_size "auto" from the memory plan) and returns the
        answers in input order."""
        if isinstance(prompt, (list, tuple)):
            results, _ = self.generate_many(
                list(prompt), max_tokens, system=system, chat=chat, stop=stop,
                batch_size=batch_size, **sampling,
            )  # fmt: skip
            return [r.text for r in results]
        ids = self._ids(prompt, system, chat)
        text, _ = generate(
            self.transformer,
            self.tokenizer,
            ids,
            params=SamplingParams(**sampling),
            max_tokens=max_tokens,
            stop=stop,
        )
        return text

    def plan(self, context: int, batch: int, prompt_tokens: int | None = None):
        """The memory plan (mlxrun.memory.Plan) for `batch` sequences of `context` tokens,
        `prompt_tokens` of them the longest prompt (default: all)."""
        from .planning import plan_shapes  # noqa: PLC0415

        be = self.backend
        return plan_shapes(
            self.config,
            self._shapes,
            self.quant,
            "mlx" if be.name == "mlx" else be.device,
            be.dtype,
            context,
            batch,
            prompt_tokens=prompt_tokens,
        )

    def generate_many(
        self,
        prompts: list[str],
        max_tokens: int = 256,
        *,
        system: str | None = None,
        chat: bool | None = None,
        stop: list[str] | None = None,
        batch_size: int | str = "auto",
        params: SamplingParams | None = None,
        **sampling,
    ):
        """Run many prompts as batches: ([BatchResult] in input order, stats dict).

        batch_size "auto" takes the largest batch the memory plan allows for the longest
        prompt plus max_tokens; a fixed size that cannot fit is refused before it runs.
        """
        from .generate import generate_batch  # noqa: PLC0415
        from .memory import check_fits  # noqa: PLC0415

        if not prompts:
            raise MlxrunError("no prompts given")
        ids = [self._ids(p, system, chat) for p in prompts]
        longest = max(len(i) for i in ids)
        context = longest + max_tokens
        if context > self.config.max_position_embeddings:
            raise MlxrunError(
                f"the longest prompt ({longest} tokens) + "
                f"--max-tokens ({max_tokens}) exceeds the model's context of "
                f"{self.config.max_position_embeddings} tokens"
            )
        want = len(prompts) if batch_size == "auto" else int(batch_size)
        if want < 1:
            raise MlxrunError(f"--batch-size must be at least 1, got {batch_size}")
        p = self.plan(context, want, prompt_tokens=longest or None)
        if batch_size == "auto":
            if p.max_batch < 1:
                check_fits(p)
            bs = min(want, p.max_batch)
        else:
            check_fits(p)
            bs = want
        t0 = time.perf_counter()
        results = generate_batch(
            self.transformer,
            self.tokenizer,
            ids,
            params or SamplingParams(**sampling),
            max_tokens=max_tokens,
            stop=stop,
            batch_size=bs,
        )
        stats = {
            "batch_size": bs,
            "tokens": sum(r.generated for r in results),
            "seconds": time.perf_counter() - t0,
        }
        return results, stats

    def logits(self, token_ids) -> np.ndarray:
        """Logits at every position: token ids [T] -> float32 array [T, vocab]."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, -1)
        if ids.size == 0:
            raise MlxrunError("logits() needs at least one token id")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise MlxrunError(f"token ids must be in [0, {self.config.vocab_size})")
        be = self.backend
        cache = self.transformer.make_cache(1, ids.shape[1])
        return be.to_numpy(self.transformer(be.ids(ids), cache))[0]


def load(
    model: str = "smollm2",
    backend: str = "auto",
    dtype: str | None = None,
    quant: str | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    progress: bool = True,
    check_memory: bool = True,
) -> Model:
    """Load a model: a local directory, a .gguf file, a Hugging Face repo id, or an alias
    ('smollm2' bundled, 'llama'). backend: auto | mlx | cuda | mps | cpu.

    With `check_memory`, a model that cannot fit (weights + KV for one 2048-token sequence)
    is refused before its weights are moved to the device."""
    from mlxrun.backends import get_backend  # noqa: PLC0415
    from mlxrun.quant.formats import resolve  # noqa: PLC0415

    from .build import build_model, target_spec  # noqa: PLC0415
    from .loader import open_checkpoint  # noqa: PLC0415
    from .memory import check_fits  # noqa: PLC0415
    from .planning import plan_shapes  # noqa: PLC0415

    t0 = time.perf_counter()
    be = get_backend(backend, dtype)
    where = "mlx" if be.name == "mlx" else be.device
    ckpt = open_checkpoint(model)
    shapes = {n: (t.shape, t.dtype) for n, t in ckpt.tensors.items()}
    ctx = min(ckpt.config.max_position_embeddings, 2048)

    def plan_for(s):  # one 2048-token sequence: what loading must leave room for
        return plan_shapes(ckpt.config, shapes, s, where, be.dtype, ctx, 1)

    key = None if quant is None else quant.strip().lower()
    auto_note = []
    if key == "auto":
        from mlxrun.quant.profiles import resolve_auto  # noqa: PLC0415

        def fits(fmt: str) -> bool:
            return plan_for(None if fmt == "none" else resolve(fmt, group_size, bits)).fits

        key, why = resolve_auto(be.name, be.device, fits=fits)
        # "none" from auto keeps the checkpoint as it is stored (packed stays packed).
        auto_note.append(f"--quant auto: {key} ({why})")
        if key == "none":
            key = None
    spec = None if key in (None, "none") else resolve(key, group_size=group_size, bits=bits)
    if check_memory:  # refuse before anything large is allocated
        check_fits(plan_for(spec))
    transformer, notes = build_model(
        ckpt.config,
        ckpt.tensors,
        be,
        spec,
        progress=progress,
        dense=key == "none",
        group_asked=group_size is not None,
    )
    notes = auto_note + notes
    if spec is not None:  # a quantized source keeps its group size when none was asked
        spec = target_spec(spec, ckpt.config.quantization, group_size is not None)
    be.synchronize()
    return Model(
        transformer, ckpt.tokenizer, ckpt.source, notes, time.perf_counter() - t0, shapes, spec
    )
