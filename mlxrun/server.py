"""`mlxrun serve`: the OpenAI HTTP protocol over the engine (an ASGI app on uvicorn).

This module only translates: JSON bodies -> engine Requests, engine Events -> OpenAI
responses or server-sent events. Bad input gets a 4xx with OpenAI's error shape
{"error": {"message", "type", "code"}}; nothing a client sends reaches the file system.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

from .engine import Engine
from .engine_io import Event, QueueFull, Request
from .errors import MlxrunError
from .phases import now
from .sampling import SamplingParams
from .structured import COMPILE_SECONDS, Constraint
from .tools import CHANNELS, MARKUP, check_choice, check_tools, parser_name, template_messages
from .tools_stream import ToolReply

try:
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError:  # reported by `serve_app` with the extra to install
    FastAPI = None

MAX_BODY = 4 << 20  # bytes; a longer body is refused before it is read


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param=None):
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param


def _error(status: int, message: str, code: str | None = None, param=None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
    kind = kind.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
    )


def _get(body: dict, name: str, types, default=None, check=None, why: str = ""):
    """body[name] if present and of `types` (bool is not a number), else `default`."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"'{name}' must be {why or types}, got {v!r}", param=name)
    if not isinstance(v, types) or (isinstance(v, float) and not math.isfinite(v)):
        raise BadRequest(f"'{name}' must be {why or types}, got {v!r}", param=name)
    if check is not None and not check(v):
        raise BadRequest(f"'{name}' must be {why}, got {v!r}", param=name)
    return v


def _content(v, where: str) -> str:
    """A message's content: a string or a list of {"type": "text", "text": ...} parts."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for p in v:
            if not (
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            ):
                raise BadRequest(
                    f"{where}: only text content parts are supported", param="messages"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts", param="messages")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "user",
            "assistant",
            "developer",
            "tool",
        ):
            raise BadRequest(
                f"messages[{i}] must have a role of system, user, assistant or tool",
                param="messages",
            )
        role = "system" if m["role"] == "developer" else m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None and not (
            isinstance(calls, list)
            and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
        ):
            raise BadRequest(f"messages[{i}].tool_calls must be a list of calls", param="messages")
        content = m.get("content")
        msg = {"role": role, "content": "" if content is None and calls else
               _content(content, f"messages[{i}]")}  # fmt: skip
        if calls:
            msg["tool_calls"] = calls
        for k in ("tool_call_id", "name"):
            if role == "tool" and isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    return out


def _constraint(body: dict) -> Constraint | None:
    """`response_format` (json_object, json_schema), `json_schema` or `grammar` (GBNF, as
    llama.cpp's server takes them) -> a Constraint, or None for free text."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") == "text"):
        if not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise BadRequest("'response_format' must be an object with a 'type'",
                             param="response_format")  # fmt: skip
        given.remove("response_format")
    if len(given) > 1:
        raise BadRequest(f"give one of {', '.join(given)}, not several", param=given[1])
    if not given:
        return None
    try:
        if given[0] == "grammar":
            g = body["grammar"]
            if not isinstance(g, str) or not g.strip():
                raise BadRequest("'grammar' must be a non-empty GBNF grammar", param="grammar")
            return Constraint("grammar", g)
        if given[0] == "json_schema":
            return Constraint.json_schema(body["json_schema"])
        kind = rf.get("type")
        if kind == "json_object":
            return Constraint("json_object")
        if kind != "json_schema":
            raise BadRequest(
                f"response_format type {kind!r} is not supported: text, json_object or "
                "json_schema", param="response_format",
            )  # fmt: skip
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict | bool):
            raise BadRequest(
                'response_format json_schema must be {"name": ..., "schema": {...}}',
                param="response_format",
            )
        return Constraint.json_schema(js.get("schema", {}))
    except MlxrunError as e:
        raise BadRequest(str(e), param=given[0]) from None


def _sampling(body: dict) -> tuple[SamplingParams, int | None, list[str], int | None]:
    """(SamplingParams, max_tokens or None, stop strings, logprobs count or None)."""
    num = (int, float)
    n = _get(body, "n", int, 1)
    if n != 1:
        raise BadRequest("only n=1 is supported", param="n")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    mt = _get({"max_tokens": mt}, "max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if stop is not None and len(stop) > 4:
        raise BadRequest("'stop' holds at most 4 strings", param="stop")
    try:
        params = SamplingParams(
            temperature=float(
                _get(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2, "in [0, 2]")
            ),
            top_p=float(_get(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "in (0, 1]")),
            top_k=_get(body, "top_k", int, 0, lambda v: v >= 0, "an integer >= 0"),
            min_p=float(_get(body, "min_p", num, 0.0, lambda v: 0 <= v < 1, "in [0, 1)")),
            repetition_penalty=float(
                _get(body, "repetition_penalty", num, 1.0, lambda v: v > 0, "> 0")
            ),
            seed=_get(body, "seed", int, None),
        )
    except MlxrunError as e:
        raise BadRequest(str(e).replace("--temp", "temperature")) from None
    return params, mt, stop or [], None


class Server:
    """The app's state: one engine, the model's name, the API key, the tool-call parser."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        api_key: str | None = None,
        tool_parser: str | None = None,
        compile_seconds: float = COMPILE_SECONDS,
    ):
        self.engine, self.name, self.api_key = engine, model_name, api_key
        self.compile_seconds = compile_seconds
        self.tok = engine.tokenizer
        self.created = int(time.time())
        mt = engine.model.config.model_type
        self.tool_parser = parser_name(self.tok.chat_template, mt, tool_parser)

    def tools(self, body: dict, constraint: Constraint | None):
        """(tools for the template or None, ToolReply or None, the answer's constraint).
        A format with channels (harmony) is read even without tools: its markup and its
        reasoning are not content."""
        tools = body.get("tools")
        # (an answer constrained by response_format or grammar is written without markup)
        channels = self.tool_parser in CHANNELS and constraint is None
        plain = ToolReply("none", self.tool_parser, [], False) if channels else None
        if tools is None and body.get("tool_choice") is None:
            return None, plain, constraint
        try:
            tools = check_tools(tools if tools is not None else [])
            choice = check_choice(body.get("tool_choice"), tools)
        except MlxrunError as e:
            raise BadRequest(str(e), param="tools") from None
        parallel = _get(body, "parallel_tool_calls", bool, True)
        if choice == "none" or not tools:
            return tools or None, plain, constraint
        reply = ToolReply(choice, self.tool_parser, tools, parallel)
        if reply.constraint is not None and constraint is not None:
            raise BadRequest("a required or named tool_choice cannot be combined with "
                             "response_format or grammar", param="tool_choice")  # fmt: skip
        return tools, reply, reply.constraint or constraint

    def request(self, body: dict, chat: bool) -> tuple[Request, bool, bool, ToolReply | None]:
        """A JSON body -> (engine Request, stream?, include_usage in the stream?, how to
        read tool calls from the answer or None). The request's constraint is compiled by
        the caller (`compile`), off the event loop."""
        model = body.get("model")
        if model is not None and (
            not isinstance(model, str) or model not in (self.name, "default")
        ):
            raise BadRequest(
                f"model {model!r} is not served here; GET /v1/models lists '{self.name}'",
                404,
                "model_not_found",
                "model",
            )
        params, max_tokens, stop, _ = _sampling(body)
        constraint, reply = _constraint(body), None
        if chat:
            msgs = _messages(body)
            tools, reply, constraint = self.tools(body, constraint)
            try:
                text = (
                    self.tok.apply_chat_template(template_messages(msgs), tools=tools)
                    if self.tok.chat_template
                    else None
                )
            except Exception as e:  # the template's own raise_exception (e.g. role order)
                raise BadRequest(f"the chat template refused these messages: {e}") from None
            if text is None:  # no template: the messages' text, one per line
                text = "\n".join(m["content"] for m in msgs)
                ids = self.tok.encode(text)
            else:
                ids = self.tok.encode(text, add_special_tokens=False)
            lp = _get(body, "logprobs", bool, False)
            top = _get(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "in [0, 20]")
            logprobs = top if lp else None
        else:
            if body.get("tools") is not None:
                raise BadRequest("'tools' are for /v1/chat/completions", param="tools")
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                if not prompt:
                    raise BadRequest("'prompt' is empty", param="prompt")
                ids = self.tok.encode(prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                vocab = self.engine.model.config.vocab_size
                if not all(0 <= t < vocab for t in prompt):
                    raise BadRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
                ids = list(prompt)
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")
            logprobs = _get(body, "logprobs", int, None, lambda v: 0 <= v <= 20, "in [0, 20]")
        stream = _get(body, "stream", bool, False)
        opts = _get(body, "stream_options", dict, {})
        usage = bool(opts.get("include_usage", False))
        if max_tokens is None:  # OpenAI's default: as long as the context allows
            max_tokens = max(1, self.engine.context - len(ids))
        req = Request(ids, params, max_tokens, stop, logprobs)
        if chat and self.tool_parser in MARKUP:  # the parser reads the special tokens
            req.markup = True
        try:
            self.engine.check(req)
        except MlxrunError as e:
            raise BadRequest(str(e), code="context_length_exceeded") from None
        req.constraint = constraint
        return req, stream, usage, reply

    async def compile(self, c: Constraint) -> None:
        """Compile `c` on a worker thread (cached by the engine's Grammars), refusing it
        past `compile_seconds`: the event loop and the engine go on meanwhile (the
        compilation runs on to its end on its thread; a later request for it may then find
        it cached)."""
        loop = asyncio.get_running_loop()
        # the tokenizer's Grammars too: building it the first time takes ~1 s
        job = loop.run_in_executor(None, lambda: self.engine.grammars().compile(c))
        try:
            await asyncio.wait_for(job, self.compile_seconds)
        except MlxrunError as e:
            raise BadRequest(str(e), param=_param_of(c), code="invalid_" + c.kind) from None
        except asyncio.TimeoutError:
            raise BadRequest(
                f"the {c.kind.replace('_', ' ')} took over {self.compile_seconds:g} s to "
                "compile (the server's --compile-timeout); simplify it",
                param=_param_of(c), code="compile_timeout",
            ) from None  # fmt: skip

    def _token_text(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False)

    def chat_logprobs(self, events: list[Event]) -> dict:
        content = []
        for ev in events:
            lp = ev.logprob
            if lp is None:
                continue
            tt = self._token_text(lp.token)
            content.append(
                {
                    "token": tt,
                    "logprob": lp.logprob,
                    "bytes": list(tt.encode()),
                    "top_logprobs": [
                        {
                            "token": (s := self._token_text(t)),
                            "logprob": v,
                            "bytes": list(s.encode()),
                        }
                        for t, v in lp.top
                    ],
                }
            )
        return {"content": content}

    def completion_logprobs(self, events: list[Event], offset: int = 0) -> dict:
        toks, lps, tops, offs = [], [], [], []
        for ev in events:
            lp = ev.logprob
            if lp is None:
                continue
            toks.append(self._token_text(lp.token))
            lps.append(lp.logprob)
            tops.append({self._token_text(t): v for t, v in lp.top})
            offs.append(offset)
            offset += len(ev.text)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _param_of(c: Constraint) -> str:
    return "grammar" if c.kind in ("grammar", "lark", "regex") else "response_format"


def _usage(ev: Event) -> dict:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
    }


def _finish(ev: Event) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


def serve_app(server: Server):
    """The ASGI app for `server`."""
    if FastAPI is None:
        raise MlxrunError("mlxrun serve needs FastAPI and uvicorn: pip install 'mlxrun[serve]'")
    app = FastAPI(title="mlxrun", docs_url=None, redoc_url=None, openapi_url=None)
    engine = server.engine

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next):
        if server.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {server.api_key}":
                return _error(401, "missing or wrong API key: send Authorization: Bearer <key>",
                              "invalid_api_key")  # fmt: skip
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
            return _error(413, f"the request body is over {MAX_BODY} bytes", "body_too_large")
        return await call_next(request)

    async def body_of(request: HttpRequest) -> dict:
        raw = b""
        async for part in request.stream():  # chunked bodies carry no content-length
            raw += part
            if len(raw) > MAX_BODY:
                raise BadRequest(
                    f"the request body is over {MAX_BODY} bytes", 413, "body_too_large"
                )
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object", code="invalid_json")
        return body

    @app.exception_handler(BadRequest)
    async def bad_request(request, e: BadRequest):
        return _error(e.status, e.message, e.code, e.param)

    @app.exception_handler(Exception)
    async def fault(request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

    @app.get("/health")
    async def health():
        return engine.health()

    @app.get("/v1/models")
    async def models():
        card = {
            "id": server.name,
            "object": "model",
            "created": server.created,
            "owned_by": "mlxrun",
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        return await run(await body_of(request), chat=True, http=request)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await run(await body_of(request), chat=False, http=request)

    async def run(body: dict, chat: bool, http: HttpRequest):
        received = now()
        req, stream, include_usage, reply = server.request(body, chat)
        req.phases.received = received
        if req.constraint is not None:
            await server.compile(req.constraint)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        req.on_event = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        try:
            engine.submit(req)
        except QueueFull as e:
            return _error(429, str(e), "queue_full")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": server.name}
        if not stream:
            return await collect(req, events, head, chat, http, reply)
        return StreamingResponse(
            sse(req, events, head, chat, include_usage, reply),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def collect(req, events, head, chat, http, reply):
        got: list[Event] = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return _error(499, "client disconnected")
                    continue
                got.append(ev)
                if ev.finish_reason is not None:
                    break
        finally:
            req.cancel()  # a no-op once finished; frees the slot if the client went away
        last = got[-1]
        if last.finish_reason in ("error", "cancelled"):
            return _error(503 if last.finish_reason == "cancelled" else 500,
                          last.error or "the server is shutting down", last.finish_reason)  # fmt: skip
        text = "".join(e.text for e in got)
        choice: dict = {"index": 0, "finish_reason": _finish(last)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if reply is not None:
                content, calls = reply.final(text, last.finish_reason)
                choice["message"]["content"] = content
                if calls:
                    choice["message"] = {"role": "assistant", "content": content or None,
                                         "tool_calls": [c.openai() for c in calls]}  # fmt: skip
                    choice["finish_reason"] = "tool_calls"
                if reasoning := reply.reasoning(text):  # as vLLM returns gpt-oss's analysis
                    choice["message"]["reasoning_content"] = reasoning
            choice["logprobs"] = server.chat_logprobs(got) if req.logprobs is not None else None
        else:
            choice["text"] = text
            choice["logprobs"] = (
                server.completion_logprobs(got) if req.logprobs is not None else None
            )
        return {**head, "choices": [choice], "usage": _usage(last)}

    async def sse(req, events, head, chat, include_usage, reply):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, evs: list[Event], finish: str | None, first=False,
                  reasoning: str = ""):  # fmt: skip
            c: dict = {"index": 0, "finish_reason": finish}
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if delta_text:
                    delta["content"] = delta_text
                c["delta"] = delta
                c["logprobs"] = server.chat_logprobs(evs) if req.logprobs is not None else None
            else:
                c["text"] = delta_text or ""
                c["logprobs"] = (
                    server.completion_logprobs(evs) if req.logprobs is not None else None
                )
            out = {**head, "object": obj, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return f"data: {json.dumps(out)}\n\n"

        def call_chunks(calls) -> list[str]:
            """OpenAI's tool-call deltas: per call its id and name, then its arguments."""
            out = []
            for i, c in enumerate(calls):
                head_ = {"index": i, "id": c.openai()["id"], "type": "function",
                         "function": {"name": c.name, "arguments": ""}}  # fmt: skip
                args = {"index": i, "function": {"arguments": c.arguments}}
                for d in (head_, args):
                    ch = {"index": 0, "finish_reason": None, "logprobs": None,
                          "delta": {"tool_calls": [d]}}  # fmt: skip
                    out.append(f"data: {json.dumps({**head, 'object': obj, 'choices': [ch]})}\n\n")
            return out

        tools = reply.streamer() if chat and reply is not None else None
        try:
            if chat:
                yield chunk(None, [], None, first=True)
            while True:
                ev = await events.get()
                if ev.finish_reason in ("error", "cancelled"):
                    err = {"error": {"message": ev.error or "the server is shutting down",
                                     "type": "server_error", "code": ev.finish_reason}}  # fmt: skip
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                if tools is not None:  # text that may be a call is held until it is known
                    text = tools.feed(ev.text)
                    finish = _finish(ev) if ev.finish_reason else None
                    if finish:
                        rest, calls = tools.finish(ev.finish_reason)
                        text += rest
                        if calls:
                            thought = tools.reasoning()
                            if text or thought:
                                yield chunk(text, [ev], None, reasoning=thought)
                                text = ""
                            for c in call_chunks(calls):
                                yield c
                            finish = "tool_calls"
                    thought = tools.reasoning()
                    if text or thought or finish or ev.logprob is not None:
                        yield chunk(text, [ev], finish, reasoning=thought)
                elif ev.text or ev.finish_reason or ev.logprob is not None:
                    yield chunk(ev.text, [ev], _finish(ev) if ev.finish_reason else None)
                if req.phases.first_sent is None:  # (a chunk is on its way once yielded)
                    req.phases.first_sent = now()
                if ev.finish_reason is not None:
                    if include_usage:
                        tail = {**head, "object": obj, "choices": [], "usage": _usage(ev)}
                        yield f"data: {json.dumps(tail)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # also when the client goes away mid-stream: the slot frees at the next step
            req.cancel()

    return app


def run_server(server: Server, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM: uvicorn stops accepting, lets running requests finish
    for a few seconds and cancels the rest; then the engine stops."""
    import uvicorn  # noqa: PLC0415

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its shutdown, which would end the process
            # with the signal's status; the shutdown was clean, so exit with 0
            self._captured_signals.clear()

    app = serve_app(server)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
        access_log=False,
    )  # fmt: skip
    try:
        Uvicorn(config).run()
    finally:
        server.engine.close()
