"""The OpenAI protocol of `mlxrun serve`, without the HTTP: a JSON body is checked field
by field and becomes an engine Request (`Server.request`); engine Events become the
response's logprobs, usage and finish_reason fields. Bad input raises BadRequest, which
the app (`mlxrun.server`) answers with OpenAI's error shape.

Separate from the app so that what a request may hold, and what it turns into, reads (and
imports) without FastAPI, routes or streaming."""

from __future__ import annotations

import asyncio
import math
import time

from .engine import Engine
from .engine_io import Event, Request
from .errors import MlxrunError
from .sampling import SamplingParams
from .structured import COMPILE_SECONDS, Constraint
from .tools import CHANNELS, MARKUP, check_choice, check_tools, parser_name, template_messages
from .tools_stream import ToolReply


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param=None):
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param


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
