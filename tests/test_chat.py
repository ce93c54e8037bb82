"""`mlxrun chat` on the engine (tiny llama, torch-cpu): the second turn reuses the first
turn's cache, answers equal generate's, /system and /reset clear the conversation."""

from __future__ import annotations

import mlxrun
from mlxrun.chat import chat_loop
from mlxrun.engine import Engine
from mlxrun.sampling import SamplingParams


def test_chat_turns_reuse_the_cache(tiny_dir):
    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cpu", progress=False)
    eng = Engine(m.transformer, m.tokenizer, max_batch=1, context=128)
    lines = iter(["w5 w6 w7 w8", "w9 w10", "/reset", "/system w40 w41", "w11", "/quit"])
    out = []
    try:
        conv = chat_loop(eng, SamplingParams(), 6, read=lambda _: next(lines), write=out.append)
        h = eng.health()
    finally:
        eng.close()
    # no chat template: the conversation is its messages' text, one per line
    first = m.generate("w5 w6 w7 w8", max_tokens=6)
    second = m.generate("\n".join(["w5 w6 w7 w8", first, "w9 w10"]), max_tokens=6)
    third = m.generate("w40 w41\nw11", max_tokens=6)
    assert [c["content"] for c in conv] == ["w11", third]
    text = "".join(out)
    assert first in text and second in text and "conversation cleared" in text
    assert h["prefix_hits"] == 1  # turn 2 on turn 1's slot; the reset turns share nothing
    assert h["prefix_tokens_reused"] >= 4 + 5  # turn 1's prompt and all but one answer token
