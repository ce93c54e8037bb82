"""The real SmolLM2-135M-Instruct weights (the bundled GGUF, Q4_1 linears run packed)
against transformers' own GGUF loader, and the answer a user sees from the CLI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

from .conftest import hf_greedy, rel_err

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from mlxrun.loader import bundled_model_path

    g = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(
        g.parent, gguf_file=g.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module", params=["cpu", "mlx"])
def ours(request):
    return mlxrun.load("smollm2", backend=request.param, dtype="float32", progress=False)


def test_tokenizer_matches_transformers_gguf_tokenizer(ours):
    from transformers import AutoTokenizer

    from mlxrun.loader import bundled_model_path

    g = bundled_model_path()
    ht = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    msgs = [{"role": "user", "content": QUESTION}]
    text = ht.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours.tokenizer.apply_chat_template(msgs) == text
    assert ours.tokenizer.prompt_ids(QUESTION) == ht.encode(text, add_special_tokens=False)


def test_logits_and_greedy_tokens_match_transformers(ours, hf_model):
    ids = ours.tokenizer.prompt_ids(QUESTION)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(ours.logits(ids), ref) < 1e-4
    want = hf_greedy(hf_model, ids, 32)
    got = [
        int(t[0]) for t in generate_step(ours.transformer, [ids], SamplingParams(), max_tokens=32)
    ]
    assert got == want


def test_api_generate_answers_paris(ours):
    text = ours.generate(QUESTION, max_tokens=32)
    assert "Paris" in text
    pieces = list(ours.stream(QUESTION, max_tokens=32))
    assert "".join(p.text for p in pieces) == text
    assert pieces[-1].finish_reason == "stop" and pieces[-1].generation_tokens <= 32


def test_sampling_is_reproducible_with_a_seed(ours):
    a = ours.generate("Tell me a story.", max_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    b = ours.generate("Tell me a story.", max_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    assert a == b


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_cli_answers_paris(backend):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxrun",
            "generate",
            "--backend",
            backend,
            "--prompt",
            QUESTION,
            "--max-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Generation:" in r.stderr and "tokens-per-sec" in r.stderr
    assert f"on {backend}" in r.stderr or backend in r.stderr


def test_stop_string_ends_generation(ours):
    full = ours.generate(QUESTION, max_tokens=32)
    cut = full.index("Paris")
    r = list(ours.stream(QUESTION, max_tokens=32, stop=["Paris"]))
    assert "".join(p.text for p in r) == full[:cut]
    assert r[-1].finish_reason == "stop"


def test_length_finish(ours):
    r = list(ours.stream(QUESTION, max_tokens=3))
    assert r[-1].finish_reason == "length" and r[-1].generation_tokens == 3
    assert np.isfinite(r[-1].prompt_tps)
