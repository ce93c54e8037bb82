"""The Python API takes what mlx-lm's takes: chat messages, token ids, `temp`; errors name
parameters; logits take a batch; a plan prints as the CLI's table."""

from __future__ import annotations

import inspect
import json
import shutil

import numpy as np
import pytest

import mlxrun
from mlxrun.memory import format_plan

from .conftest import rel_err

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}w40"


@pytest.fixture(scope="module")
def chat_model(tiny_dir, tmp_path_factory):
    """The tiny model with a chat template, on PyTorch CPU."""
    d, _ = tiny_dir("llama_gqa_tied")
    dst = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(d, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return mlxrun.load(str(dst), backend="cpu", progress=False)


def test_chat_messages_prompt(chat_model):
    m = chat_model
    msgs = [{"role": "user", "content": "w5 w6 w7"}]
    assert m.generate(msgs, max_tokens=6) == m.generate("w5 w6 w7", max_tokens=6, chat=True)
    ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    assert m.generate(msgs, max_tokens=6) == m.generate(ids, max_tokens=6)
    # A batch of conversations, each answered as alone.
    two = [msgs, [{"role": "user", "content": "w9"}]]
    assert m.generate(two, max_tokens=4) == [m.generate(c, max_tokens=4) for c in two]


def test_token_id_prompt_and_temp_alias(chat_model):
    m = chat_model
    ids = m.tokenizer.prompt_ids("w5 w6 w7", chat=False)
    want = m.generate("w5 w6 w7", max_tokens=6, chat=False)
    assert m.generate(ids, max_tokens=6) == want and want
    assert m.generate(np.asarray(ids), max_tokens=6) == want
    a = m.generate(ids, max_tokens=8, temp=1.5, seed=3)
    assert a == m.generate(ids, max_tokens=8, temperature=1.5, seed=3)
    with pytest.raises(mlxrun.MlxrunError, match="temperature or temp"):
        m.generate(ids, temp=1.0, temperature=1.0)


def test_peak_memory_is_gigabytes(chat_model):
    last = list(chat_model.stream("w5", max_tokens=2, chat=False))[-1]
    measured = chat_model.backend.peak_memory()
    assert isinstance(last.peak_memory, float)
    assert 0 < last.peak_memory <= measured / 1e9 + 1e-9 and last.peak_memory > measured / 2e9


def test_logits_take_a_batch(chat_model):
    m = chat_model
    a, b = [3, 9, 40, 41, 77], [5, 60, 7, 8, 90]
    both = m.logits([a, b])
    assert both.shape == (2, 5, 96)
    assert rel_err(both[0], m.logits(a)) < 1e-5 and rel_err(both[1], m.logits(b)) < 1e-5
    assert m.logits(a).shape == (5, 96)
    with pytest.raises(mlxrun.MlxrunError, match="equal-length"):
        m.logits([a, b[:3]])
    with pytest.raises(mlxrun.MlxrunError, match="not text"):
        m.logits("w5 w6")


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(temp=-1), "temperature must be >= 0"),
        (dict(top_p=2.0), "top_p must be in"),
        (dict(topp=0.5), "unknown sampling option topp"),
    ],
)
def test_api_errors_name_parameters_not_flags(chat_model, kw, needle):
    for call in (chat_model.generate, lambda *a, **k: list(chat_model.stream(*a, **k))):
        with pytest.raises(mlxrun.MlxrunError) as e:
            call("w5", **kw)
        assert needle in str(e.value) and "--" not in str(e.value)


def test_bad_prompt_type_is_one_clear_error(chat_model):
    with pytest.raises(mlxrun.MlxrunError, match="text, a list of token ids, or chat messages"):
        chat_model.generate(3.5)


def test_str_of_a_plan_is_the_table(tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    p = mlxrun.plan(str(d), backend="cpu", context=64)
    assert str(p) == format_plan(p) and "max batch" in str(p) and not str(p).startswith("Plan(")


def test_public_functions_have_type_hints():
    fns = [mlxrun.load, mlxrun.plan] + [
        f for n, f in vars(mlxrun.Model).items() if callable(f) and not n.startswith("_")
    ]
    for f in fns:
        sig = inspect.signature(f)
        missing = [n for n, p in sig.parameters.items() if n != "self" and p.annotation is p.empty]
        assert sig.return_annotation is not sig.empty and not missing, (f.__name__, missing)
