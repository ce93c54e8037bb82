"""`mlxrun serve`: the OpenAI HTTP protocol over the engine (an ASGI app on uvicorn).

`mlxrun serve` only translates: JSON bodies -> engine Requests, engine Events -> OpenAI
responses or server-sent events. Bad input gets a 4xx with OpenAI's error shape
{"error": {"message", "type", "code"}}; nothing a client sends reaches the file system.
Here: the routes, streaming and uvicorn; what a body may hold and the engine Request it
becomes are in `mlxrun.server_protocol` (Server and BadRequest are importable from here).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from .engine_io import Event, QueueFull
from .errors import MlxrunError
from .phases import now
from .server_protocol import BadRequest, Server, _finish, _usage

try:
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError:  # reported by `serve_app` with the extra to install
    FastAPI = None

MAX_BODY = 4 << 20  # bytes; a longer body is refused before it is read


def _error(status: int, message: str, code: str | None = None, param=None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
    kind = kind.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
    )


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
