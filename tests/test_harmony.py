"""gpt-oss's harmony format: the parser on text in the published format
(https://cookbook.openai.com/articles/openai-harmony), streamed deltas against the whole
answer, the special tokens kept in generated text for this family only, the chat template's
round trip, and a tiny random gpt_oss checkpoint served through the `openai` client: a
`required` tool choice (constrained) and answers whose tokens are scripted (the engine's
sampler replaced), so the server's wiring is checked without a trained model."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

import mlxrun
from mlxrun.tools import harmony_messages, harmony_read, parse, parser_name, template_messages
from mlxrun.tools_stream import ToolReply

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{0,11}$"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["tz"], "additionalProperties": False}}}  # fmt: skip

# Answers as gpt-oss writes them after the prompt's `<|start|>assistant` (the generation
# ends on <|call|> or <|return|>, which the detokenizer does not add to the text).
THINK = "<|channel|>analysis<|message|>User asks about Paris. Need the weather tool.<|end|>"
CALL_AFTER = (  # `to=` after the channel, with <|constrain|>json
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris","unit":"celsius"}'
)
CALL_BEFORE = (  # `to=` before the channel, as the chat template writes calls
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 degrees and sunny in Paris."
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})

CASES = {
    # name: (answer, content, reasoning, calls)
    "reasoning_and_final": (THINK + FINAL, "It is 18 degrees and sunny in Paris.",
                            "User asks about Paris. Need the weather tool.", []),
    "call_constrain_json": (THINK + CALL_AFTER, "",
                            "User asks about Paris. Need the weather tool.", [PARIS]),
    "call_to_before_channel": (CALL_BEFORE[len("<|start|>assistant"):], "", "",
                               [("get_time", {"tz": "CET"})]),
    "two_calls": (THINK + CALL_AFTER + "<|call|>" + CALL_BEFORE, "",
                  "User asks about Paris. Need the weather tool.",
                  [PARIS, ("get_time", {"tz": "CET"})]),
    "preamble_then_call": ("<|channel|>commentary<|message|>Checking the weather.<|end|>"
                           + CALL_AFTER, "Checking the weather.", "", [PARIS]),
    "malformed_call_is_content": (
        THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather '
        '<|constrain|>json<|message|>{"city": "Paris", "unit": ', '{"city": "Paris", "unit": ',
        "User asks about Paris. Need the weather tool.", []),
    "no_markup": ("Just text.", "Just text.", "", []),
    "cut_in_a_header": (THINK + "<|start|>assistant<|channel|>fin", "",
                        "User asks about Paris. Need the weather tool.", []),
}  # fmt: skip


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", list(CASES))
def test_harmony_parser_reads_the_published_format(name):
    text, content, reasoning, calls = CASES[name]
    got_content, got_reasoning, got = harmony_read(text)
    assert (got_content, got_reasoning, _calls(got)) == (content, reasoning, calls)
    assert parse("harmony", text)[0] == content  # the server's reading, markup never content
    reply = ToolReply("auto", "harmony", [WEATHER, CLOCK], True)
    assert reply.final(text, "stop")[0] == content and reply.reasoning(text) == reasoning
    # tool_choice "none": a call the model makes anyway is content, not lost
    none = ToolReply("none", "harmony", [], True).final(text, "stop")
    assert none[1] == [] and none[0].startswith(content)
    assert all(m.body in none[0] for m in harmony_messages(text) if m.recipient)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("step", [1, 3, "tokens"])
def test_streamed_deltas_equal_the_whole_answer(name, step):
    """Fed a character, three, or a special token / word at a time: no markup in the content
    or reasoning deltas, and deltas plus the rest equal the non-streamed reading."""
    text = CASES[name][0]
    if step == "tokens":
        import re

        pieces = re.findall(r"<\|[a-z]+\|>|\w+|\W", text)
    else:
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
    assert "".join(pieces) == text
    reply = ToolReply("auto", "harmony", [WEATHER, CLOCK], True)
    s = reply.streamer()
    sent, thought = "", ""
    for p in pieces:
        sent += s.feed(p)
        thought += s.reasoning()
        assert "<|" not in sent and "<|" not in thought
    rest, calls = s.finish("stop")
    thought += s.reasoning()
    content, want = reply.final(text, "stop")
    assert (sent + rest, thought) == (content, reply.reasoning(text))
    assert _calls(calls) == _calls(want)


def test_harmony_is_chosen_for_gpt_oss_and_its_template():
    assert parser_name(None, "gpt_oss") == "harmony"
    assert parser_name("<|start|>assistant<|channel|>final<|message|>", "llama") == "harmony"
    assert parser_name(None, "llama", "harmony") == "harmony"
    assert parser_name(None, "llama") == "llama3_json"


# A chat template with the published gpt-oss template's structure (system and developer
# messages, tools as a `functions` namespace, calls `to=functions.NAME` on the commentary
# channel, tool results from `functions.NAME to=assistant`), shortened.
GPT_OSS_TEMPLATE = """{%- set last_tool_call = namespace(name=none) -%}
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for tool in tools %}{%- set f = tool.function %}
// {{ f.description }}
type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "system" %}<|start|>developer<|message|># Instructions

{{ message.content }}<|end|>
{%- elif message.role == "user" %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == "assistant" and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}
{%- if message.content %}<|start|>assistant<|channel|>analysis<|message|>{{ message.content }}<|end|>{% endif %}
<|start|>assistant to=functions.{{ tool_call.name }}<|channel|>commentary json<|message|>
{{- tool_call.arguments | tojson }}<|call|>
{%- set last_tool_call.name = tool_call.name %}
{%- elif message.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>
{{- message.content }}<|end|>
{%- set last_tool_call.name = none %}
{%- elif message.role == "tool" %}
{%- if last_tool_call.name is none %}{{ raise_exception("a tool message without a call before it") }}{% endif %}
<|start|>functions.{{ last_tool_call.name }} to=assistant<|channel|>commentary<|message|>
{{- message.content | tojson }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
            "<|start|>", "<|end|>", "<|message|>", "<|call|>"]  # fmt: skip


def harmony_tokenizer_json() -> str:
    """A byte-level BPE over the 256 bytes (no merges: a character a token, llguidance
    reads it) with gpt-oss's special tokens after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok.to_str()


VOCAB = 256 + len(SPECIALS)
RETURN, CALL = 256 + SPECIALS.index("<|return|>"), 256 + SPECIALS.index("<|call|>")


H, LAYERS, HEADS, KV, HD, E, INTER = 32, 2, 4, 2, 8, 4, 32
CONFIG = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=H,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
              head_dim=HD, vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-5,
              tie_word_embeddings=False, num_local_experts=E, num_experts_per_tok=2,
              intermediate_size=INTER, sliding_window=8, attention_bias=True,
              layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
              rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                               "original_max_position_embeddings": 4096},
              bos_token_id=256 + SPECIALS.index("<|startoftext|>"),
              eos_token_id=RETURN)  # fmt: skip


def _gpt_oss_tensors(rng) -> dict:
    """Random tensors under the names and shapes transformers' GptOssForCausalLM saves
    (its logits are checked against transformers in test_moe.py; here only the serving
    matters, and building the class with transformers takes seconds)."""
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,),
              "lm_head.weight": (VOCAB, H)}  # fmt: skip
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        shapes |= {a + "sinks": (HEADS,), a + "q_proj.weight": (HEADS * HD, H),
                   a + "q_proj.bias": (HEADS * HD,), a + "k_proj.weight": (KV * HD, H),
                   a + "k_proj.bias": (KV * HD,), a + "v_proj.weight": (KV * HD, H),
                   a + "v_proj.bias": (KV * HD,), a + "o_proj.weight": (H, HEADS * HD),
                   a + "o_proj.bias": (H,), m + "router.weight": (E, H), m + "router.bias": (E,),
                   m + "experts.gate_up_proj": (E, H, 2 * INTER),
                   m + "experts.gate_up_proj_bias": (E, 2 * INTER),
                   m + "experts.down_proj": (E, INTER, H), m + "experts.down_proj_bias": (E, H),
                   f"model.layers.{i}.input_layernorm.weight": (H,),
                   f"model.layers.{i}.post_attention_layernorm.weight": (H,)}  # fmt: skip
    return {n: (1.0 if "norm" in n else 0.0) + 0.3 * rng.standard_normal(sh).astype(np.float32)
            for n, sh in shapes.items()}  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny random gpt_oss checkpoint with the harmony tokenizer and template; its config
    names only <|return|> as EOS (as some GGUF files do), so <|call|> must be added."""
    from mlxrun.weights import Tensor, save_safetensors

    d = tmp_path_factory.mktemp("gpt_oss")
    ts = _gpt_oss_tensors(np.random.default_rng(0))
    save_safetensors(d / "model.safetensors", {n: Tensor.from_numpy(a) for n, a in ts.items()})
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "tokenizer.json").write_text(harmony_tokenizer_json())
    tc = {"eos_token": "<|return|>", "chat_template": GPT_OSS_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    # MLX where it is installed: torch-cpu's expert path is ~30x slower per step here
    backend = "mlx" if importlib.util.find_spec("mlx") else "cpu"
    return mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)


def test_markup_is_kept_for_gpt_oss_only(gpt_oss):
    """gpt-oss's generated text keeps its special tokens (streamed and whole) and <|call|>
    ends generation; another model's text drops them as before."""
    tok = gpt_oss.tokenizer
    assert tok.markup and {RETURN, CALL} <= tok.eos_token_ids
    ids = tok.encode(THINK + FINAL, add_special_tokens=False)
    d = tok.detokenizer()
    assert "".join(d.add(t) for t in ids) + d.flush() == THINK + FINAL == tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True).startswith("analysisUser asks")
    plain = tok.detokenizer(markup=False)
    assert "".join(plain.add(t) for t in ids).startswith("analysisUser asks")

    # the same vocabulary and template for a llama-family model: not kept there
    from mlxrun.api import _reply_format
    from mlxrun.tokenizer import Tokenizer

    other = Tokenizer.from_json(harmony_tokenizer_json(), {"eos_token": "<|return|>"}, set())
    _reply_format(other, "llama")
    assert not other.markup and other.eos_token_ids == {RETURN}
    assert other.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    det = other.detokenizer()
    assert "".join(det.add(t) for t in ids) + det.flush() == other.decode(ids)


def test_the_python_api_returns_the_markup(gpt_oss):
    """`stream`, `generate` and batched `generate_many` on gpt-oss give the generated tokens'
    text with their special tokens (the random weights write <|endoftext|> and <|start|>
    within 40 greedy tokens of this prompt)."""
    rs = list(gpt_oss.stream([5, 6, 7, 8], max_tokens=40, chat=False))
    toks = [r.token for r in rs if r.token not in gpt_oss.tokenizer.eos_token_ids]
    assert any(t >= 256 for t in toks), "the random model wrote no special token: reseed"
    text = gpt_oss.tokenizer.decode(toks, skip_special_tokens=False)
    assert "".join(r.text for r in rs) == text and "<|" in text
    assert gpt_oss.generate([5, 6, 7, 8], max_tokens=40, chat=False) == text
    (r,), _ = gpt_oss.generate_many([[5, 6, 7, 8]], max_tokens=40, chat=False)
    assert r.text == text


def test_calls_and_tool_results_round_trip_through_the_template(gpt_oss):
    """An assistant's tool_calls and the tool's result go through the gpt-oss template;
    the call it writes reads back (harmony parser) as the same call."""
    tok = gpt_oss.tokenizer
    args = {"city": "Paris", "unit": "celsius"}
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
         "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    text = tok.apply_chat_template(template_messages(msgs), tools=[WEATHER, CLOCK])
    assert "type get_weather = (_: {" in text and "type get_time" in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 ' in text
    assert text.endswith("<|end|><|start|>assistant")
    start = text.index("<|start|>assistant to=")
    written = text[start + len("<|start|>assistant") : text.index("<|call|>")]
    content, calls = parse("harmony", written)
    assert content == "" and _calls(calls) == [("get_weather", args)]
    # the ids the server sends: the specials are single tokens
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[-10] == 256 + SPECIALS.index("<|start|>") and tok.decode(ids[-9:]) == "assistant"


# --- served: the openai client on the tiny gpt_oss model ---------------------------------


@pytest.fixture
def served(gpt_oss, monkeypatch):
    """(openai client on an in-process server of the tiny model, script setter): while a
    script is set, the engine's sampler returns its tokens in turn instead of drawing."""
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    import mlxrun.engine as engine_mod
    from mlxrun.engine import Engine
    from mlxrun.server import Server, serve_app

    script: list[int] = []
    draw = engine_mod.sample_rows

    def scripted(be, logits, seqs):
        if not script:
            return draw(be, logits, seqs)
        return np.array([script[s.n] for s in seqs], np.int64), [None] * len(seqs)

    monkeypatch.setattr(engine_mod, "sample_rows", scripted)
    eng = Engine(gpt_oss.transformer, gpt_oss.tokenizer, max_batch=1, context=1536,
                 fixed_steps=False)  # fmt: skip
    http = TestClient(serve_app(Server(eng, "tiny")))
    c = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                      max_retries=0)  # fmt: skip

    def say(text: str, end: int) -> None:
        script[:] = gpt_oss.tokenizer.encode(text, add_special_tokens=False) + [end]

    yield c, say
    eng.close()


def _extra(obj, key):
    return (obj.model_extra or {}).get(key)


def _streamed(c, **kw):
    """(content, reasoning, calls, finish_reason) reassembled from a streamed request."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in c.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        finish = ch.choices[0].finish_reason or finish
        content += d.content or ""
        reasoning += _extra(d, "reasoning_content") or ""
        for t in d.tool_calls or []:
            cur = calls.setdefault(t.index, {"name": "", "arguments": ""})
            cur["name"] += (t.function.name or "") if t.function else ""
            cur["arguments"] += (t.function.arguments or "") if t.function else ""
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_served_harmony_answers_split_into_content_reasoning_and_calls(served):
    """Scripted answers through the real engine (special tokens kept by its detokenizer)
    and server: a call ended by <|call|> comes back as tool_calls with the analysis as
    reasoning_content; a final answer ended by <|return|> as content alone, with or without
    tools; streamed deltas reassemble to the same."""
    c, say = served
    msgs = [{"role": "user", "content": "Time?"}]
    kw = dict(model="tiny", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=100)
    think = "<|channel|>analysis<|message|>Ask.<|end|>"  # (a character a token: short)

    say(think + CALL_BEFORE, CALL)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"tz": "CET"}
    assert _extra(ch.message, "reasoning_content") == "Ask."
    content, reasoning, calls, finish = _streamed(c, **kw)
    assert (content, reasoning, finish) == ("", "Ask.", "tool_calls")
    assert calls == [{"name": "get_time", "arguments": call.function.arguments}]

    final = "<|start|>assistant<|channel|>final<|message|>At 9."
    say(think + final, RETURN)
    for body in (kw, {**kw, "tools": None}):
        ch = c.chat.completions.create(**body).choices[0]
        assert (ch.finish_reason, ch.message.content, ch.message.tool_calls) == (
            "stop", "At 9.", None)  # fmt: skip
        assert _extra(ch.message, "reasoning_content") == "Ask."
    assert _streamed(c, **kw) == ("At 9.", "Ask.", [], "stop")
    # a raw completion keeps the markup for the client to read
    r = c.completions.create(model="tiny", prompt="<|start|>user<|message|>Hi<|end|>",
                             max_tokens=100)  # fmt: skip
    assert r.choices[0].text == think + final


def test_served_required_and_named_tool_choice_are_constrained(served):
    """With the prompt ending in <|start|>assistant, `required` and a named tool choice
    still decode JSON made from the tools' schemas (random weights, greedy and sampled):
    tool_calls whose arguments validate, streamed the same."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    c, _ = served
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="tiny", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=100)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, extra in (("required", {"temperature": 1.0, "seed": 3,
                                        "parallel_tool_calls": False}),
                          (named, {"temperature": 0})):  # fmt: skip
        r = c.chat.completions.create(**kw, tool_choice=choice, **extra)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if choice is named:
            assert call.function.name == "get_time"
        _, _, calls, finish = _streamed(c, **kw, tool_choice=choice, **extra)
        assert finish == "tool_calls"
        assert calls == [{"name": call.function.name, "arguments": call.function.arguments}]
    # a response_format answer is written without markup: all of it is content
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
        "additionalProperties": False}}}  # fmt: skip
    body = dict(model="tiny", messages=msgs, max_tokens=20, temperature=0, response_format=fmt)
    ch = c.chat.completions.create(**body).choices[0]
    assert ch.finish_reason == "stop" and json.loads(ch.message.content)["a"] in (1, 2)
    assert _streamed(c, **body) == (ch.message.content, "", [], "stop")


def test_chat_shows_reasoning_and_keeps_only_the_answer(gpt_oss, monkeypatch):
    """`mlxrun chat` on gpt-oss: no markup on the terminal, the reasoning marked, and the
    assistant turn kept as the final answer alone (the next prompt is built from it)."""
    import mlxrun.engine as engine_mod
    from mlxrun.chat import chat_loop
    from mlxrun.engine import Engine
    from mlxrun.sampling import SamplingParams

    tk = gpt_oss.tokenizer
    answer = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi there"
    script = tk.encode(answer, add_special_tokens=False) + [RETURN]
    monkeypatch.setattr(engine_mod, "sample_rows", lambda be, logits, seqs: (
        np.array([script[s.n] for s in seqs], np.int64), [None] * len(seqs)))  # fmt: skip
    eng = Engine(gpt_oss.transformer, tk, max_batch=1, context=1536, fixed_steps=False)
    out: list[str] = []
    lines = iter(["Hello", "/quit"])
    try:
        conv = chat_loop(eng, SamplingParams(), 64, read=lambda _: next(lines), write=out.append)
    finally:
        eng.close()
    shown = "".join(out)
    assert (
        "<|" not in shown and "(thinking) Think." in shown and shown.rstrip().endswith("Hi there")
    )
    assert conv[-1] == {"role": "assistant", "content": "Hi there"}
