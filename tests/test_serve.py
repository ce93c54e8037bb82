"""`mlxrun serve`: a real server process with the bundled SmolLM2 on loopback, driven by the
official `openai` client (answers equal `mlxrun generate`'s greedy text) and by raw HTTP
for malformed input; the API key and the full queue on a tiny model in process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

import mlxrun

openai = pytest.importorskip("openai")

MODEL = "smollm2"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea and the wind over it at night.",
    "Hi",
]
N = 12  # tokens per answer: enough to differ, short enough for the CI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc, url: str, seconds: float = 300) -> None:
    """Until the server process `proc` answers /health at `url` (fails the test if it exits
    or does not answer within `seconds`)."""
    deadline = time.time() + seconds
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server():
    """`mlxrun serve` in a child process; yields its base URL; SIGTERM must end it cleanly."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlxrun", "serve", "-m", MODEL, "-b", "mlx", "--port",
           str(port), "--context", "512", "--max-batch", "3"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url)
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server did not exit within 60 s of SIGTERM")
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def reference():
    """Greedy answers of `mlxrun generate` (the same library call) for QUESTIONS."""
    m = mlxrun.load(MODEL, backend="mlx", progress=False)
    chat = {q: m.generate(q, max_tokens=N) for q in QUESTIONS}
    plain = m.generate("The capital of France is", max_tokens=N, chat=False)
    return chat, plain


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)


def ask(url, q, stream):
    c = client(url)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=N,
              temperature=0)  # fmt: skip
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = [], None, None
    for ch in c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            text.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    return "".join(text), finish, usage


@pytest.mark.slow
def test_concurrent_clients_get_generate_text(server, reference):
    """Four clients at once (three slots: one waits and joins later), prompts of 31-46
    tokens, streaming and not: each answer is exactly the greedy text of `generate`."""
    chat, plain = reference
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(ask, server, q, i % 2 == 1) for i, q in enumerate(QUESTIONS)]
        got = [f.result() for f in futs]
    for q, (text, finish, usage) in zip(QUESTIONS, got):
        assert text == chat[q]
        assert finish in ("stop", "length")
        assert usage.completion_tokens <= N and usage.prompt_tokens > 20
    r = client(server).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=N, temperature=0
    )
    assert r.choices[0].text == plain and r.usage.completion_tokens == N
    h = httpx.get(server + "/health").json()
    assert h["running"] == 0 and h["finished"] >= 5
    # SmolLM2's template puts the same default system prompt before every question
    assert h["prefix_hits"] >= 1


@pytest.mark.slow
def test_stop_logprobs_and_models(server, reference):
    chat, _ = reference
    q = QUESTIONS[0]
    full = chat[q]
    cut = full[len(full) // 2 :][:3]  # a piece of the answer: the text must end before it
    r = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=N, temperature=0,
        stop=[cut], logprobs=True, top_logprobs=2,
    )  # fmt: skip
    ch = r.choices[0]
    assert ch.message.content == full[: full.index(cut)] and ch.finish_reason == "stop"
    lps = ch.logprobs.content
    assert lps and all(len(t.top_logprobs) == 2 for t in lps)
    assert all(
        t.logprob <= 0 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in lps
    )
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


BAD = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, None),
    (
        json.dumps({"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}).encode(),
        400,
        None,
    ),
    (
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 3}]}).encode(),
        400,
        None,
    ),
    (
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
        ).encode(),
        400,
        None,
    ),  # fmt: skip
    (
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
        ).encode(),
        400,
        None,
    ),  # fmt: skip
    (
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}
        ).encode(),
        400,
        None,
    ),  # fmt: skip
    (
        json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}).encode(),
        404,
        "model_not_found",
    ),  # fmt: skip
    (
        json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "word " * 600}],
                "max_tokens": 4,
            }
        ).encode(),
        400,
        "context_length_exceeded",
    ),  # fmt: skip
    (
        json.dumps({"model": MODEL, "prompt": "/etc/passwd" * 500000}).encode(),
        413,
        "body_too_large",
    ),  # fmt: skip
]


@pytest.mark.slow
def test_malformed_requests_get_4xx_and_the_server_goes_on(server):
    for body, status, code in BAD:
        r = httpx.post(server + "/v1/chat/completions", content=body, timeout=60,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == status, (body[:80], r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
        if code:
            assert err["code"] == code
    assert httpx.get(server + "/health").json()["status"] == "ok"


@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_slot(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = []
        for ln in lines:
            if ln.startswith("data:"):
                got.append(ln)
                if len(got) == 2:
                    break
    assert json.loads(got[0][5:])["object"] == "text_completion"
    deadline = time.time() + 30
    while (h := httpx.get(server + "/health").json())["running"]:
        assert time.time() < deadline, h
        time.sleep(0.2)
    assert h["cancelled"] >= 1


@pytest.fixture
def tiny_app(tiny_dir):
    from fastapi.testclient import TestClient

    from mlxrun.engine import Engine
    from mlxrun.server import Server, serve_app

    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cpu", progress=False)

    def make(**kw):
        eng = Engine(m.transformer, m.tokenizer, max_batch=1, context=64,
                     max_queue=kw.pop("max_queue", 8))  # fmt: skip
        made.append(eng)
        return TestClient(serve_app(Server(eng, "tiny", **kw)))

    made = []
    yield make
    for e in made:
        e.close()


def test_api_key_and_full_queue(tiny_app):
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "temperature": 0}
    c = tiny_app(api_key="s3cret")
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    full = tiny_app(max_queue=0)
    r = full.post("/v1/completions", json=body)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


def test_a_request_gone_nan_gets_an_error_and_the_server_goes_on(tiny_dir):
    """Logits that turn NaN (a token's embedding row poisoned, the tied head clean) end that
    request: a 500 in OpenAI's error shape, or an error event closing the stream; a clean
    request before and after gets its answer."""
    from fastapi.testclient import TestClient

    from mlxrun.engine import Engine
    from mlxrun.generate import generate_step
    from mlxrun.sampling import SamplingParams
    from mlxrun.server import Server, serve_app

    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cpu", progress=False)
    t = m.transformer
    clean = [int(x[0]) for x in generate_step(t, [[5, 6, 8]], SamplingParams(), 2)]
    poison = next(x for x in range(9, 96) if x not in clean)
    w = np.array(t.be.to_numpy(t.embed))  # a copy: the tied head keeps the clean rows
    w[poison] = np.nan
    t.embed = t.be.array(w)
    eng = Engine(t, m.tokenizer, max_batch=2, context=32)
    try:
        c = TestClient(serve_app(Server(eng, "tiny")))
        ok = {"prompt": [5, 6, 8], "max_tokens": 2, "temperature": 0}
        bad = {**ok, "prompt": [5, 6, poison]}
        r = c.post("/v1/completions", json=ok)
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json=bad)
        err = r.json()["error"]
        assert r.status_code == 500 and err["code"] == "error" and "NaN" in err["message"]
        assert err["type"] == "server_error"
        lines = [ln for ln in c.post("/v1/completions", json={**bad, "stream": True})
                 .text.splitlines() if ln.startswith("data: ")]  # fmt: skip
        assert "NaN" in json.loads(lines[-2][6:])["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        r = c.post("/v1/completions", json=ok)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        h = c.get("/health").json()
        assert (h["failed"], h["running"]) == (2, 0)
    finally:
        eng.close()


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_cli_refuses_bad_options():
    r = subprocess.run([sys.executable, "-m", "mlxrun", "serve", "--max-batch", "many"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--max-batch must be a positive integer" in r.stderr


# --- structured outputs and tool calls through the same server -----------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
    "required": ["tz"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.slow
def test_response_formats_and_grammar_validate(server):
    """json_schema (strict, greedy and seeded) on chat, json_object, and a GBNF `grammar`
    on completions: every answer that stops parses and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    from .structured_cases import CASES, prompt

    c = client(server)
    runs = [(n, d, s, t) for n, d, s in CASES if n in ("person", "nested", "enum", "ref")
            for t in (0.0,)] + [(n, d, s, 1.0) for n, d, s in CASES if n == "array_bounds"]  # fmt: skip
    stopped = 0
    for name, desc, schema, temp in runs:
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
        r = c.chat.completions.create(model=MODEL, max_tokens=40, temperature=temp, seed=7,
                                      messages=[{"role": "user", "content": prompt(desc)}],
                                      response_format=fmt)  # fmt: skip
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length")
        if ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), schema)
            stopped += 1
    assert stopped >= 3
    r = c.chat.completions.create(model=MODEL, max_tokens=30, temperature=0,
                                  response_format={"type": "json_object"},
                                  messages=[{"role": "user", "content": "A cat as JSON."}])  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=4,
                             temperature=0, extra_body={"grammar": 'root ::= " yes" | " no"'})  # fmt: skip
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
         "JSON schema cannot be used"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
            "type": "integer", "minimum": 3, "maximum": 1}}}}, "Unsatisfiable"),
        ({"response_format": {"type": "yaml"}}, "not supported"),
        ({"grammar": "root ::= undefined-rule"}, "does not parse as GBNF"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name must be"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}, "type object"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not in 'tools'"),
    ],
)  # fmt: skip
def test_bad_structured_input_is_400_and_the_server_goes_on(server, extra, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(server + "/v1/chat/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def _stream_calls(c, **kw):
    """(tool calls reassembled from the deltas, finish_reason) of a streamed request."""
    calls, finish = {}, None
    for ch in c.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for d in ch.choices[0].delta.tool_calls or []:
            cur = calls.setdefault(d.index, {"name": "", "arguments": ""})
            cur["name"] += (d.function.name or "") if d.function else ""
            cur["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.slow
def test_tool_calls_round_trip(server):
    """A named tool_choice and `required` give tool_calls whose arguments validate against
    the tool's parameters (finish_reason "tool_calls"); the streamed deltas reassemble to
    the same call; the assistant's call and the tool's result are accepted and answered."""
    jsonschema = pytest.importorskip("jsonschema")
    c = client(server)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], temperature=0, max_tokens=40)
    r = c.chat.completions.create(**kw, tool_choice=named)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed, finish = _stream_calls(c, **kw, tool_choice=named)
    assert finish == "tool_calls"
    assert streamed == [{"name": "get_weather", "arguments": call.function.arguments}]

    r = c.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    (req,) = r.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[req.function.name]
    jsonschema.validate(json.loads(req.function.arguments), tool["function"]["parameters"])

    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    r = c.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=8,
                                  temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_a_slow_compile_is_refused_while_other_requests_complete(tiny_app, monkeypatch):
    """A schema whose compilation runs past the server's bound (`--compile-timeout`; here
    the compilation is held until the end of the test) is a 400 naming the bound, and a
    request on the same server completes while that compilation still runs."""
    import threading

    from mlxrun.engine import Engine

    gate = threading.Event()

    class Held:  # the tiny model's WordPiece tokenizer has no llguidance grammars anyway
        def compile(self, c):
            gate.wait(120)

    monkeypatch.setattr(Engine, "grammars", lambda self: Held())
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    # one event loop for both requests, as a server has (without `with`, the test client
    # closes a loop per request, and closing waits for the held compilation's thread)
    with tiny_app(compile_seconds=0.05) as c:
        try:
            r = c.post("/v1/completions", json={**body, "response_format": fmt})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "compile_timeout" and "0.05 s" in err["message"]
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert not gate.is_set()  # the first compilation was still running
        finally:
            gate.set()
