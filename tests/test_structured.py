"""Constrained decoding and tool calls.

The device samplers' mask against the host reference (greedy and sampled, masked and free
rows in one batch); grammar errors; the tool-call parsers on their families' published
formats; tools through a Hermes-style chat template; and JSON schemas decoded by the
bundled SmolLM2 through the API on MLX and torch-cpu, every answer that ends with "stop"
validated by `jsonschema` (a representative subset by default, all schemas x greedy and
three seeds x both backends under -m long).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chi2

import mlxrun
from mlxrun.errors import MlxrunError
from mlxrun.sampling import HostSampler, SamplingParams, allowed_np, mask_words, pack, plan_for
from mlxrun.tools import (
    call_constraint,
    check_choice,
    check_tools,
    constrained_calls,
    parse,
    parser_name,
    template_messages,
)
from mlxrun.tools_stream import ToolReply

from .structured_cases import CASES, PERSON, prompt
from .test_sampling import DEVICES, INTERPRETED, _draw

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

V = 48


def _masks(B: int, seed: int) -> np.ndarray:
    """(B, words) int32 bitmasks allowing a random third of the tokens of each row."""
    rng = np.random.default_rng(seed)
    allowed = rng.random((B, V)) < 0.33
    allowed[:, rng.integers(V)] = True
    bits = np.zeros((B, mask_words(V) * 32), np.uint32)
    bits[:, :V] = allowed
    words = (bits.reshape(B, -1, 32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    return words.astype(np.uint32).view(np.int32)


def _masked_draw(device, params, logits, mask):
    plan = plan_for(params, V, None, masked=True)
    state = pack(params, [[1, 2, 3]] * len(params), plan, mask=mask)
    x = np.tile(logits, (len(params), 1))
    if device == "mlx":
        import mlx.core as mx

        from mlxrun.backends.mlx_sampling import MLXSampler

        return np.array(MLXSampler(plan, state)(mx.array(x)))
    from mlxrun.backends.torch_sampling import TorchSampler

    dev = "cpu" if device == "triton-interpreter" else device.split("-")[1]
    s = TorchSampler(plan, state, dev, triton=device in ("torch-cuda", "triton-interpreter"))
    return s(torch.from_numpy(x).to(dev)).cpu().numpy()


MASK_DEVICES = DEVICES + (["triton-interpreter"] if INTERPRETED else [])


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("device", MASK_DEVICES)
@pytest.mark.parametrize(
    "kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.2, top_p=0.8)]
)
def test_masked_sampling_draws_the_reference_over_the_allowed_tokens(device, kw):
    """4,000 seeded rows sharing one mask: only allowed tokens, at the frequencies of the
    reference's kept set over the masked logits (chi-square, p > 1e-4)."""
    if device == "triton-interpreter" and "top_k" not in kw:
        pytest.skip("the interpreter is slow: one setting covers the kernels' masked input")
    n = 64 if device == "triton-interpreter" else 4000
    logits = (2 * np.random.default_rng(1).normal(size=V)).astype(np.float32)
    mask = np.repeat(_masks(1, 4), n, axis=0)
    ok = allowed_np(mask[:1], V)[0]
    params = [SamplingParams(seed=i, **kw) for i in range(n)]
    tok = _masked_draw(device, params, logits, mask)
    assert ok[tok].all(), f"drew disallowed tokens {sorted(set(tok[~ok[tok]].tolist()))}"
    if device == "triton-interpreter":  # slow: the kernels' tokens against the torch ops'
        ops = _masked_draw("torch-cpu", params, logits, mask)
        assert (tok != ops).sum() <= 2, (tok, ops)
        return
    row = np.where(ok, logits.astype(np.float64), -np.inf)
    order, probs = HostSampler(SamplingParams(**kw)).kept(row / kw["temperature"])
    want = np.zeros(V)
    want[order] = probs
    counts = np.bincount(tok, minlength=V)
    keep = want > 0
    assert counts[~keep].sum() == 0
    if keep.sum() > 1:
        stat = ((counts[keep] - n * want[keep]) ** 2 / (n * want[keep])).sum()
        assert chi2.sf(stat, keep.sum() - 1) > 1e-4, stat


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("device", MASK_DEVICES)
def test_masked_and_free_rows_share_a_batch(device):
    """Greedy and penalised rows take the argmax over their allowed tokens; rows whose mask
    allows everything draw what the unmasked sampler draws with the same seed."""
    logits = (2 * np.random.default_rng(2).normal(size=V)).astype(np.float32)
    rows = [SamplingParams(), SamplingParams(repetition_penalty=1.3),
            SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, seed=6)]  # fmt: skip
    mask = _masks(4, 9)
    mask[2:] = -1  # free rows
    tok = _masked_draw(device, rows, logits, mask)
    ok = allowed_np(mask, V)
    assert tok[0] == np.flatnonzero(ok[0])[np.argmax(logits[ok[0]])]
    pen = logits.copy()
    pen[[1, 2, 3]] = np.where(pen[[1, 2, 3]] > 0, pen[[1, 2, 3]] / 1.3, pen[[1, 2, 3]] * 1.3)
    assert tok[1] == np.flatnonzero(ok[1])[np.argmax(pen[ok[1]])]
    free, _ = _draw("torch-cpu" if device == "triton-interpreter" else device, rows[2:], logits)
    assert tok[2:].tolist() == free.tolist()


def test_unconstrained_plans_carry_no_mask():
    """Without a constrained row the sampler has no mask buffer and traces no mask op."""
    rows = [SamplingParams(temperature=1.0, seed=1)]
    plan = plan_for(rows, V)
    assert not plan.masked and "mask" not in pack(rows, [[]], plan)
    from mlxrun.backends.torch_sampling import TorchSampler

    assert not hasattr(TorchSampler(plan, pack(rows, [[]], plan), "cpu"), "_word")


# --- parsers on their families' published formats ----------------------------------------

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA3_TAG = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}'
MISTRAL = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        ("hermes", HERMES, "Let me check.",
         [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET"})]),
        ("llama3_json", LLAMA3, "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ("llama3_json", LLAMA3_TAG, "", [("get_time", {"tz": "CET"})]),
        ("mistral", MISTRAL, "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ("mistral", MISTRAL_V11, "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ],
)  # fmt: skip
def test_parsers_read_their_family_format(parser, text, content, calls):
    got_content, got = parse(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),  # cut
        ("hermes", "no call here"),
        ("llama3_json", '{"name": "f", "parameters": [1]}'),
        ("llama3_json", "The answer is {1}."),
        ("mistral", "[TOOL_CALLS] [{'name': 'f'}]"),
    ],
)
def test_malformed_calls_stay_content(parser, text):
    assert parse(parser, text) == (text, [])


def test_parser_is_chosen_from_the_template_then_the_family():
    assert parser_name("{{ '<tool_call>' }}", "llama") == "hermes"
    assert parser_name("[TOOL_CALLS]", "llama") == "mistral"
    assert parser_name("<|python_tag|>", "qwen2") == "llama3_json"
    assert parser_name(None, "qwen3") == "hermes" and parser_name(None, "llama") == "llama3_json"
    assert parser_name("<tool_call>", "qwen2", "mistral") == "mistral"
    with pytest.raises(MlxrunError, match="not known"):
        parser_name(None, "llama", "nope")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]}}},
]  # fmt: skip


@pytest.mark.parametrize(
    "tools,choice,match",
    [
        ([{"type": "function", "function": {"parameters": {}}}], None, "name must be"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
         None, "type object"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "type object"),
        ([{"type": "nope"}], None, "must be"),
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "not in 'tools'"),
        (TOOLS, "sometimes", "tool_choice must be"),
        ([], "required", "at least one tool"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_problem(tools, choice, match):
    with pytest.raises(MlxrunError, match=match):
        check_choice(choice, check_tools(tools))


def test_forced_choices_constrain_to_calls_that_validate():
    """required: a list of {"name", "arguments"} (one item unless parallel); a named
    function: its arguments alone. What the constraint admits reads back as calls."""
    req = json.loads(call_constraint(TOOLS, "required", parallel=False).source)
    assert req["maxItems"] == 1 and len(req["items"]["anyOf"]) == 2
    text = '[{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    jsonschema.validate(json.loads(text), req)
    (c,) = constrained_calls(text, "required")
    assert (c.name, json.loads(c.arguments)) == ("get_time", {"tz": "UTC"})
    named = check_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    assert (
        json.loads(call_constraint(TOOLS, named, True).source) == TOOLS[0]["function"]["parameters"]
    )
    (c,) = constrained_calls('{"city": "Oslo", "unit": "celsius"}', named)
    assert c.name == "get_weather" and json.loads(c.arguments)["city"] == "Oslo"


@pytest.mark.parametrize("parser,text", [("hermes", HERMES), ("llama3_json", LLAMA3),
                                         ("mistral", MISTRAL), ("hermes", "Just text, <b>.")])  # fmt: skip
def test_streamed_pieces_reassemble_to_the_whole_answer(parser, text):
    """Fed a token-sized piece at a time, the stream sends no text of a call, and its
    content plus calls equal the non-streamed reading."""
    reply = ToolReply("auto", parser, TOOLS, True)
    s = reply.streamer()
    sent = "".join(s.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, calls = s.finish("stop")
    content, want = reply.final(text, "stop")
    assert (sent + rest).strip() == content.strip()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]
    for c in want:
        assert c.arguments not in sent


# A Qwen2.5-style (Hermes) template, as its tokenizer_config.json has it, shortened.
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_tools_and_tool_messages_reach_a_hermes_template():
    from mlxrun.tokenizer import Tokenizer

    from .conftest import word_tokenizer_json

    tok = Tokenizer.from_json(word_tokenizer_json(16), {"chat_template": QWEN_TEMPLATE}, {2})
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    text = tok.apply_chat_template(template_messages(msgs), tools=TOOLS)
    assert '"name": "get_weather", "description": "Weather in a city"' in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert parser_name(tok.chat_template, "llama") == "hermes"
    no_tools = tok.apply_chat_template(template_messages(msgs[:1]))
    assert "<tools>" not in no_tools


# --- grammars on the bundled SmolLM2 ----------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    """name -> the bundled SmolLM2 on that backend, loaded once."""
    loaded = {}

    def get(backend):
        if backend not in loaded:
            loaded[backend] = mlxrun.load("smollm2", backend=backend, progress=False,
                                          fastest=True)  # fmt: skip
        return loaded[backend]

    return get


BACKENDS = ["mlx", "cpu"] if "mlx" in DEVICES else ["cpu"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(json_schema={"type": "frob"}), "JSON schema cannot be used"),
        (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable"),
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(regex="(a"), "regular expression cannot be used"),
        (dict(grammar="root ::= foo"), "does not parse as GBNF"),
        (dict(grammar='root ::= "a'), "grammar"),
        (dict(json_schema={}, regex="a"), "not several"),
    ],
)
def test_bad_constraints_are_one_clear_error(smol, kw, match):
    with pytest.raises(MlxrunError, match=match):
        smol(BACKENDS[0]).generate("Hi", max_tokens=2, **kw)


def _check(name, schema, text, finish):
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)  # raises with the path that fails
    else:
        assert finish == "length", (name, finish)


def _answer(m, schema, max_tokens=40, **kw):
    last, text = None, ""
    for r in m.stream(prompt(schema[1]), max_tokens=max_tokens, json_schema=schema[2], **kw):
        text += r.text
        last = r
    return text, last.finish_reason


QUICK = ["person", "nested", "enum", "anyof", "ref"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=pytest.mark.long) if b == "mlx" else b for b in BACKENDS]
)  # MLX on CPU takes ~50 s here: the server tests run it by default
def test_api_answers_validate(smol, backend):
    """A representative subset of the schemas, greedy (and one sampled), through
    Model.stream: every answer that stops parses and validates; most do stop."""
    m = smol(backend)
    names = QUICK if backend == "mlx" else QUICK[:2]
    stopped = 0
    for case in [c for c in CASES if c[0] in names]:
        text, finish = _answer(m, case, max_tokens=32)
        _check(case[0], case[2], text, finish)
        stopped += finish == "stop"
    assert stopped >= len(names) // 2
    text, finish = _answer(m, CASES[0], temperature=1.0, seed=3)
    _check("person sampled", PERSON, text, finish)


@pytest.mark.slow
@pytest.mark.long
def test_batch_grammar_and_regex(smol):
    """generate_many with a schema (each row its own matcher), a GBNF grammar, a regex, and
    max_tokens inside a structure ending with "length"."""
    m = smol(BACKENDS[0])
    results, _ = m.generate_many([prompt("a person"), prompt("someone else")], max_tokens=40,
                                 json_schema=PERSON, batch_size=2)  # fmt: skip
    for r in results:
        _check("batch", PERSON, r.text, r.finish_reason)
    out = m.generate("Is the sky blue?", max_tokens=8, grammar='root ::= "yes" | "no"')
    assert out in ("yes", "no")
    out = m.generate("A year:", max_tokens=8, regex="[12][0-9]{3}")
    assert len(out) == 4 and out.isdigit()
    text, finish = _answer(m, CASES[10], max_tokens=4)  # array_objects: cannot close in 4
    assert finish == "length" and text.startswith("[")


@pytest.mark.long
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_schema_greedy_and_seeded(smol, backend):
    """All schemas, greedy and at temperature 1.0 with three seeds, batched through the
    engine (each request its own matcher, free rows beside them): every answer that stops
    validates."""
    from mlxrun.engine import Engine, Request
    from mlxrun.structured import Constraint

    m = smol(backend)
    eng = Engine(m.transformer, m.tokenizer, max_batch=8, context=512, max_queue=256)
    try:
        reqs = []
        for name, desc, schema in CASES:
            ids = m.tokenizer.prompt_ids(prompt(desc))
            for temp, seed in [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]:
                params = SamplingParams(temperature=temp, seed=seed)
                reqs.append((name, schema, Request(ids, params, 64,
                                                   constraint=Constraint.json_schema(schema))))  # fmt: skip
        free = Request(m.tokenizer.prompt_ids("Hi"), SamplingParams(), 16)
        outs = [list(ev) for ev in _run_all(eng, [r for _, _, r in reqs] + [free])]
        for (name, schema, _), evs in zip(reqs, outs):
            _check(name, schema, "".join(e.text for e in evs), evs[-1].finish_reason)
        assert outs[-1][-1].finish_reason in ("stop", "length")
    finally:
        eng.close()


def _run_all(eng, reqs):
    import queue

    qs = []
    for r in reqs:
        q = queue.Queue()
        r.on_event = q.put
        eng.submit(r)
        qs.append(q)
    for q in qs:
        evs = []
        while not evs or evs[-1].finish_reason is None:
            evs.append(q.get(timeout=600))
        yield evs


# --- the CLI ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--json-schema", "missing.json"], "--json-schema missing.json: no such file"),
        (["--json-schema", "{not json"], "not valid JSON"),
        (["--grammar", "missing.gbnf"], "--grammar missing.gbnf: no such file"),
        (["--json-schema", "{}", "--grammar", "g.gbnf"], "not both"),
    ],
)
def test_cli_refuses_bad_constraints_before_loading(capsys, args, needle):
    from .test_cli_errors import assert_one_line_error, run_cli

    code, err = run_cli(capsys, "generate", "-m", "/nonexistent", "-p", "Hi", *args)
    assert_one_line_error(code, err, needle)


@pytest.mark.slow
@pytest.mark.long
def test_cli_json_schema_and_grammar(tmp_path):
    """--json-schema as a file and inline, --grammar as a GBNF file: the printed answer
    follows each."""
    from click.testing import CliRunner

    from mlxrun.cli import cli
    from mlxrun.cli_structured import constraint_from

    schema = {"enum": ["yes", "no"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.gbnf").write_text('root ::= "Paris" | "Lyon"\n')
    base = ["generate", "-m", "smollm2", "-b", BACKENDS[0], "--max-tokens", "6", "--quiet"]
    r = CliRunner().invoke(cli, base + ["-p", "Is the sky blue?", "--json-schema",
                                        str(tmp_path / "s.json")])  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout.strip()) in ("yes", "no")
    assert constraint_from(json.dumps(schema), None) == constraint_from(
        str(tmp_path / "s.json"), None
    )
    r = CliRunner().invoke(cli, base + ["-p", "The capital of France?", "--grammar",
                                        str(tmp_path / "g.gbnf")])  # fmt: skip
    assert r.exit_code == 0 and r.stdout.strip() in ("Paris", "Lyon"), r.output
