"""Constrained decoding split as "forward, then masked sample": the host advances the
grammars and fills the masks while the device runs the forward pass.

On the CPU the engine's fixed-shape steps run uncaptured (`SlotDecoder(capture=False)`), so
the split steps' host logic (forward queued before the last tokens are read, masks filled
after they are handed out, finished and dummy rows left free) is checked against the
engine's eager steps token for token. On a GPU the captured graphs (generate's
`GraphDecoder`, the engine's `SlotStep`) are checked against the eager steps the same way,
at batch 1 and 3.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlxrun
from mlxrun.engine import Engine, Request
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams
from mlxrun.structured import Constraint, fill_masks, grammars_for

from .structured_cases import PERSON, prompt
from .test_engine import run_all

pytest.importorskip("llguidance")

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:
    torch, HAS_CUDA = None, False

C = Constraint.json_schema(PERSON)
TOKENS = 24


def _requests(m, n: int) -> list[Request]:
    """n requests: constrained greedy, constrained seeded, and a free greedy row."""
    ps = [m.tokenizer.prompt_ids(prompt(d)) for d in ("a person", "a cook", "a pilot")]
    kinds = [
        (SamplingParams(), C),
        (SamplingParams(temperature=1.0, seed=5), C),
        (SamplingParams(), None),
    ]
    return [Request(ps[i], kinds[i][0], TOKENS, constraint=kinds[i][1]) for i in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [[e.token for e in evs] for evs in outs]


@pytest.fixture(scope="module")
def smol_cpu():
    return mlxrun.load("smollm2", backend="cpu", progress=False, fastest=True)


@pytest.mark.slow
@pytest.mark.long  # ~27 s on 2 cores; on a GPU the captured steps' test covers the split
def test_split_fixed_steps_equal_eager_steps(smol_cpu):
    """The engine's fixed steps, split for constrained rows (run uncaptured on the CPU),
    give the eager steps' tokens: two constrained rows (greedy, seeded) beside a free one
    in the bucket of 4 (a dummy row), and one constrained row alone; the constrained
    answers that stop are valid JSON of the schema."""
    import json

    import jsonschema

    from mlxrun.backends.slot_graph import SlotDecoder

    m = smol_cpu
    for n in (3, 1):
        outs = {}
        for fixed in (False, True):
            eng = Engine(m.transformer, m.tokenizer, max_batch=4, context=256)
            try:
                if fixed:
                    eng.graphs = SlotDecoder(m.transformer, eng.cache, 4, capture=False)
                outs[fixed] = run_all(eng, _requests(m, n), timeout=600)
                if fixed:
                    assert any(k[1] is not None and k[1].masked for k in eng.graphs.steps)
            finally:
                eng.close()
        assert _tokens(outs[True]) == _tokens(outs[False])
        for evs in outs[True][:2]:
            if evs[-1].finish_reason == "stop":
                jsonschema.validate(json.loads("".join(e.text for e in evs)), PERSON)
        assert outs[True][0][-1].finish_reason == "stop"  # the greedy one completes


def test_fill_masks_skips_finished_rows_and_writes_into_out():
    """fill_masks into a given buffer: rows without a matcher, or whose matcher ended,
    are all ones (whatever the buffer held); a live row gets its grammar's mask, the same
    whether it is filled alone or beside others (the parallel fill)."""
    from mlxrun.loader import open_checkpoint

    tok = open_checkpoint("smollm2").tokenizer
    g = grammars_for(tok, tok.vocab_size)
    c = Constraint("regex", "ab")
    live, done = g.matcher(c), g.matcher(c)
    for t in tok.encode("ab"):
        done.advance(t)
    assert done.done
    out = np.zeros((4, g.words), np.int32)
    got = fill_masks([live, None, done, g.matcher(c)], g.words, out=out)
    assert got is out
    assert (out[1] == -1).all() and (out[2] == -1).all()
    alone = fill_masks([live], g.words)
    assert (out[0] == alone[0]).all() and (out[3] == alone[0]).all()
    assert 0 < np.unpackbits(alone.view(np.uint8)).sum() < g.vocab


# --- on a GPU: the captured split steps against the eager steps ------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("batch", [1, 3])
def test_captured_constrained_generate_equals_eager(batch):
    """generate_step with grammars, through the captured forward and sample graphs
    (GraphDecoder split) and eagerly: the same greedy tokens, token for token."""
    m = mlxrun.load("smollm2", backend="cuda", dtype="float32", progress=False)
    be = m.transformer.be
    ps = [m.tokenizer.prompt_ids(prompt(d)) for d in ("a person", "a cook", "a pilot")][:batch]
    g = grammars_for(m.tokenizer, m.config.vocab_size)
    outs = {}
    try:
        for captured in (True, False):
            be.cuda_graphs = captured
            matchers = [g.matcher(C) for _ in ps]
            steps = generate_step(m.transformer, ps, SamplingParams(), 48, matchers=matchers)
            outs[captured] = np.stack(list(steps)).tolist()
    finally:
        be.cuda_graphs = True
    assert outs[True] == outs[False]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n", [1, 3])
def test_captured_constrained_engine_equals_eager(n):
    """The engine's captured steps with constrained rows (split graphs, mask as an input
    buffer) against the same steps uncaptured and against the eager engine."""
    m = mlxrun.load("smollm2", backend="cuda", dtype="float32", progress=False)
    be = m.transformer.be
    outs = {}
    try:
        for mode in ("captured", "uncaptured", "eager"):
            be.cuda_graphs = mode == "captured"
            eng = Engine(m.transformer, m.tokenizer, max_batch=4, context=256)
            try:
                if mode == "eager":
                    eng.graphs = None
                outs[mode] = _tokens(run_all(eng, _requests(m, n), timeout=600))
                if mode == "captured":
                    split = [s for k, s in eng.graphs.steps.items() if k[1] and k[1].masked]
                    assert split and all(s.sample_graph is not None for s in split)
            finally:
                eng.close()
    finally:
        be.cuda_graphs = True
    assert outs["captured"] == outs["uncaptured"] == outs["eager"]
