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

    def __init__(self, transformer, tokenizer, source: str, notes: list[str], load_time: float):
        self.transformer = transformer
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
        prompt: str,
        max_tokens: int = 256,
        *,
        system: str | None = None,
        chat: bool | None = None,
        stop: list[str] | None = None,
        **sampling,
    ) -> str:
        """The whole answer as a string (same options as `stream`)."""
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
) -> Model:
    """Load a model: a local directory, a .gguf file, a Hugging Face repo id, or an alias
    ('smollm2' bundled, 'llama'). backend: auto | mlx | cuda | mps | cpu."""
    from mlxrun.backends import get_backend  # noqa: PLC0415

    from .build import build_model  # noqa: PLC0415
    from .loader import open_checkpoint  # noqa: PLC0415

    t0 = time.perf_counter()
    be = get_backend(backend, dtype)
    spec = None
    if quant not in (None, "none"):
        from mlxrun.quant.formats import resolve  # noqa: PLC0415

        spec = resolve(quant, group_size=group_size, bits=bits)
    ckpt = open_checkpoint(model)
    transformer, notes = build_model(ckpt.config, ckpt.tensors, be, spec, progress=progress)
    be.synchronize()
    return Model(transformer, ckpt.tokenizer, ckpt.source, notes, time.perf_counter() - t0)
