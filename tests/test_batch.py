"""Batched generation: left padding and masks make each prompt's greedy output in a batch
identical to its output alone, for prompts of very different lengths."""

from __future__ import annotations

import numpy as np
import pytest

import mlxrun
from mlxrun.generate import generate_batch, generate_step
from mlxrun.sampling import SamplingParams

from .conftest import rel_err

LENGTHS = [1, 7, 30, 64, 99, 128, 170, 200]


def _check_batch_equals_alone(m, prompts, max_tokens):
    alone = [
        generate_batch(m.transformer, m.tokenizer, [p], max_tokens=max_tokens)[0] for p in prompts
    ]
    together = generate_batch(
        m.transformer, m.tokenizer, prompts, max_tokens=max_tokens, batch_size=8
    )
    for a, t in zip(alone, together):
        assert t.tokens == a.tokens and t.text == a.text and t.finish_reason == a.finish_reason


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_batched_greedy_equals_one_at_a_time(tiny_dir, backend):
    """8 prompts of 1 to 200 tokens in one batch, on a random model without EOS stops."""
    d, _ = tiny_dir("llama3_untied_scaled")
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    m.tokenizer.eos_token_ids = set()  # random weights: run every sequence to the end
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 96, n).tolist() for n in LENGTHS]
    _check_batch_equals_alone(m, prompts, max_tokens=16)


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_padded_rows_logits_equal_unpadded(tiny_dir, backend):
    """The last-position logits of a left-padded row equal the same prompt run alone."""
    d, _ = tiny_dir("llama3_untied_scaled")
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    t, be = m.transformer, m.backend
    rng = np.random.default_rng(0)
    short, long_ = rng.integers(3, 96, 5).tolist(), rng.integers(3, 96, 23).tolist()
    ids = np.zeros((2, 23), dtype=np.int64)
    ids[0, 18:], ids[1] = short, long_
    pads = np.array([18, 0])
    cache = t.make_cache(2, 24)
    got = be.to_numpy(t(be.ids(ids), cache, pads, last_only=True))
    # one more decode step through the padded cache
    nxt = be.to_numpy(t(be.ids(np.array([[7], [9]])), cache, pads, last_only=True))
    for b, p in enumerate([short, long_]):
        c1 = t.make_cache(1, 24)
        ref = be.to_numpy(t(be.ids(np.array([p])), c1, None, last_only=True))
        ref2 = be.to_numpy(t(be.ids(np.array([[[7, 9][b]]])), c1, None, last_only=True))
        assert rel_err(got[b], ref[0]) < 1e-5 and rel_err(nxt[b], ref2[0]) < 1e-5


def test_batch_results_keep_input_order_and_stop_per_sequence(tiny_dir):
    d, _ = tiny_dir("qwen2_bias")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    prompts = [[5, 6, 7], [9] * 20, [11, 12]]
    res = generate_batch(m.transformer, m.tokenizer, prompts, max_tokens=6, batch_size=2)
    for p, r in zip(prompts, res):
        solo = [int(x[0]) for x in generate_step(m.transformer, [p], SamplingParams(), 6)]
        eos = m.tokenizer.eos_token_ids
        want = solo[: next((i for i, x in enumerate(solo) if x in eos), len(solo))]
        assert r.tokens == want
        assert r.finish_reason == ("stop" if len(want) < 6 else "length")


def test_batch_size_zero_is_refused(tiny_dir):
    d, _ = tiny_dir("qwen2_bias")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    with pytest.raises(mlxrun.MlxrunError, match="--batch-size must be at least 1"):
        generate_batch(m.transformer, m.tokenizer, [[5]], batch_size=0)


def test_api_generate_list_equals_one_at_a_time(tiny_dir):
    """`m.generate([...])` runs the prompts as batches and returns each prompt's own answer,
    in input order."""
    d, _ = tiny_dir("llama3_untied_scaled")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    m.tokenizer.eos_token_ids = set()  # random weights: run every sequence to the end
    prompts = ["a much longer prompt than the others, to pad", "hi", "three word prompt"]
    got = m.generate(prompts, max_tokens=8, batch_size=2)
    assert got == [m.generate(p, max_tokens=8) for p in prompts]
    assert len(set(got)) > 1  # distinct prompts, distinct answers: the order is checked
