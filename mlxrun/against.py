"""`mlxrun eval --against DIR`: score checkpoints made elsewhere (mlx-community's 4-bit
models, GGUF files, `mlxrun convert` output) against the dense reference, over the same
windows of text as the formats mlxrun quantizes itself."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import MlxrunError
from .evaluate import Candidate, expanded, matrix_bytes_per_weight, window_logits


def against_candidates(reference, paths: Sequence[str], backend: str, dtype: str | None):
    """One `Candidate` per checkpoint in `paths`, run with mlxrun on `backend` in `dtype`
    as stored (packed layers stay packed). `reference` is the open reference checkpoint:
    a candidate must share its vocabulary and hidden size, or the scores mean nothing.
    Every model is built now and held until scored."""
    from .backends import get_backend  # noqa: PLC0415
    from .build import build_model  # noqa: PLC0415
    from .loader import open_checkpoint  # noqa: PLC0415

    be = get_backend(backend, dtype)
    out = []
    for p in paths:
        ck = open_checkpoint(p)
        c, r = ck.config, reference.config
        if (c.vocab_size, c.hidden_size) != (r.vocab_size, r.hidden_size):
            raise MlxrunError(
                f"--against {p}: vocabulary {c.vocab_size} / hidden size {c.hidden_size} "
                f"differ from the reference's {r.vocab_size} / {r.hidden_size}; give a "
                "quantization of the same model"
            )
        model, _ = build_model(c, ck.tensors, be, None, progress=False)
        fast = expanded(model)
        bpw = matrix_bytes_per_weight(model)
        out.append(Candidate(p, lambda ids, m=fast: window_logits(m, ids), bpw))
    return out
