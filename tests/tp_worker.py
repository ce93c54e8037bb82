"""Run by tests/test_tp.py under torchrun or mlx.launch: each job loads a model split over
the launcher's ranks and rank 0 saves its logits and text for the test to compare with the
one-process run; every rank saves its text (sampled text must agree across ranks) and
how many vocabulary rows its embedding and head hold (and its experts' shape).

usage: tp_worker.py JOBS_JSON OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import mlxrun
from mlxrun.distributed import env_rank


def load_job(job: dict):
    """The job's model, in float32 (split over the ranks when a launcher started us)."""
    return mlxrun.load(
        job["model"],
        backend=job["backend"],
        dtype="float32",
        quant=job.get("quant"),
        group_size=job.get("group_size"),
        progress=False,
    )


def main() -> None:
    jobs, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    for i, job in enumerate(jobs):
        m = load_job(job)
        logits = m.logits(job["ids"])
        temp = job.get("temperature", 0.0)
        text = m.generate(job["prompt"], max_tokens=job["max_tokens"], chat=False, temperature=temp)
        if env_rank() == 0:
            np.save(out / f"{i}.npy", logits)
            (out / f"{i}.txt").write_text(text)
        (out / f"{i}.rank{env_rank()}.txt").write_text(text)
        # the vocabulary rows this rank holds (the split, or the whole table)
        rows = m.transformer.embed.shape[0], m.transformer.head.shape[0]
        (out / f"{i}.rank{env_rank()}.rows").write_text(json.dumps(rows))
        moe = [L.moe for L in m.transformer.layers if L.moe is not None]
        if moe:  # the experts' (E, rows, hidden) this rank holds
            (out / f"{i}.rank{env_rank()}.experts").write_text(json.dumps(moe[0].gate.shape))


if __name__ == "__main__":
    main()
