"""Tool (function) calls: OpenAI's `tools` and `tool_choice` checked, the constraint that
`required` or a named function puts on the answer, and a parser per model family for the
calls a model writes on its own (`auto`).

`required` and a named function do not depend on the family's format: the answer is
constrained to JSON (`call_constraint`) and read back by `constrained_calls`, so arguments
always parse and validate against the tool's parameter schema. With `auto` the family's
parser reads the text; anything it cannot read stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .errors import MlxrunError
from .structured import Constraint


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)
    id: str = ""

    def openai(self) -> dict:
        return {"id": self.id or _call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def check_tools(tools) -> list[dict]:
    """OpenAI `tools` -> the same list, checked: MlxrunError naming the bad entry."""
    if not isinstance(tools, list):
        raise MlxrunError('\'tools\' must be a list of {"type": "function", "function": ...}')
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(f, dict)
        ):
            raise MlxrunError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise MlxrunError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                f"got {name!r}"
            )
        if name in names:
            raise MlxrunError(f"tools[{i}]: a second tool named {name!r}; names must differ")
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise MlxrunError(
                f"tools[{i}].function.parameters must be a JSON schema of type object, "
                f"got {json.dumps(params)[:80]}"
            )
    return tools


def check_choice(choice, tools: list[dict]) -> str | dict:
    """`tool_choice` -> "auto" | "none" | "required" | the named tool's function dict."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise MlxrunError("tool_choice 'required' needs at least one tool in 'tools'")
        return choice
    name = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise MlxrunError(
            "tool_choice must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"]
    have = ", ".join(t["function"]["name"] for t in tools) or "none"
    raise MlxrunError(f"tool_choice names {name!r}, which is not in 'tools' (they are: {have})")


def _params(f: dict) -> dict:
    return f.get("parameters") or {"type": "object", "properties": {}}


def call_constraint(tools: list[dict], choice: str | dict, parallel: bool) -> Constraint:
    """The answer's JSON schema for `required` (a list of {"name", "arguments"}; one item
    unless `parallel`) or a named function (its arguments object alone)."""
    if isinstance(choice, dict):
        return Constraint.json_schema(_params(choice))
    one = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": _params(t["function"]),
            },  # fmt: skip
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    items = one[0] if len(one) == 1 else {"anyOf": one}
    schema = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return Constraint.json_schema(schema)


def constrained_calls(text: str, choice: str | dict) -> list[ToolCall] | None:
    """The calls in an answer made under `call_constraint` (None if it was cut short)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(choice, dict):
        return [ToolCall(choice["name"], json.dumps(value))]
    return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in value]


# --- parsers: text in a family's format -> (content, calls) -------------------------------


def _call(obj) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} -> a ToolCall, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), obj.get("id") or "")


def _json_values(text: str) -> list | None:
    """The JSON values written one after another in `text` (separated by whitespace, ';'
    or ','), or None if anything else is there."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(v)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
    one block per call; text outside the blocks is content."""
    blocks = list(re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S))
    calls = []
    for b in blocks:
        vals = _json_values(b[1].strip())
        c = _call(vals[0]) if vals and len(vals) == 1 else None
        if c is None:
            return text, []
        calls.append(c)
    content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S).strip()
    return content, calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.1/3.2 JSON calls: the answer is {"name": ..., "parameters": {...}} (one, or
    several separated by ';'), optionally after <|python_tag|>."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :]
    if not body.startswith("{"):
        return text, []
    vals = _json_values(body)
    calls = [_call(v) for v in vals or []]
    if not calls or None in calls:
        return text, []
    return "", calls


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    """Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3), or
    [TOOL_CALLS]name[ARGS]{...} per call (v11+); text before the tag is content."""
    i = text.find("[TOOL_CALLS]")
    if i < 0:
        return text, []
    content, body = text[:i].strip(), text[i:]
    calls: list[ToolCall | None] = []
    for part in body.split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        if "[ARGS]" in part:
            name, _, args = part.partition("[ARGS]")
            vals = _json_values(args.strip())
            calls.append(_call({"name": name.strip(), "arguments": vals[0]}) if vals else None)
            continue
        vals = _json_values(part)
        if not vals:
            return text, []
        for v in vals:
            calls += [_call(x) for x in v] if isinstance(v, list) else [_call(v)]
    if not calls or None in calls:
        return text, []
    return content, calls


# gpt-oss's "harmony" format: an answer is messages, each a header (channel, recipient)
# and a body, e.g. `<|channel|>analysis<|message|>...<|end|>` then
# `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}`
# `<|call|>` or `<|start|>assistant<|channel|>final<|message|>...<|return|>`. The prompt
# ends with `<|start|>assistant`, so the first header has no `<|start|>` of its own.
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HARMONY_MARKS = HARMONY_ENDS + ("<|start|>",)


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str  # "analysis", "commentary", "final"; "" if the header names none
    recipient: str  # "functions.NAME" for a call, else ""
    body: str
    complete: bool  # its end token came (or the answer ended)

    @property
    def call(self) -> ToolCall | None:
        """The call this message makes, or None (not a call, or arguments that are not a
        JSON object)."""
        if not self.recipient:
            return None
        try:
            args = json.loads(self.body)
        except json.JSONDecodeError:
            return None
        if not isinstance(args, dict):
            return None
        name = self.recipient.removeprefix("functions.")
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


def harmony_messages(text: str, ended: bool = True) -> list[HarmonyMessage]:
    """The messages of an answer in the harmony format. While it is still being written
    (`ended` False) the last message may be incomplete, and a header not yet closed by
    `<|message|>` is left out; so is one cut short at the end. Text with no markup at all
    is one final message."""
    if ended and "<|message|>" not in text and "<|channel|>" not in text:
        return [HarmonyMessage("final", "", text, True)] if text else []
    out = []
    segs = text.split("<|start|>")
    for k, seg in enumerate(segs):
        header, sep, body = seg.partition("<|message|>")
        if not sep:
            continue
        ends = [i for e in HARMONY_ENDS if (i := body.find(e)) >= 0]
        complete = bool(ends) or ended or k < len(segs) - 1  # (a next message: this one is over)
        body = body[: min(ends)] if ends else body
        ch = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", header)
        to = re.search(r"\bto=([^\s<]+)", header)
        out.append(HarmonyMessage(ch[1] if ch else "", to[1] if to else "", body, complete))
    return out


def _unsure_tail(body: str) -> int:
    """How many characters at the end of a growing body may be the start of an end token."""
    for k in range(min(len(body), max(map(len, _HARMONY_MARKS)) - 1), 0, -1):
        if any(m.startswith(body[-k:]) for m in _HARMONY_MARKS):
            return k
    return 0


def harmony_read(
    text: str, ended: bool = True, calls: bool = True
) -> tuple[str, str, list[ToolCall]]:
    """(content, reasoning, calls) of a harmony answer: content is the final channel's text
    (and commentary meant for the user, and the body of a malformed call); reasoning the
    analysis channel's; calls one per message to `functions.NAME` whose body is a JSON
    object (with `calls` False, their bodies are content). While the answer is being
    written (`ended` False), only what can no longer change: a message's text stops
    short of what may be the start of its end token, and nothing after a call that has
    not ended is read."""
    content, reasoning, out = [], [], []
    for m in harmony_messages(text, ended):
        body = m.body
        if not m.complete:
            body = body[: len(body) - _unsure_tail(body)]
        if m.recipient:
            if not m.complete:
                break  # a call or, if its JSON turns out malformed, content: not known yet
            c = m.call if calls else None
            if c is not None:
                out.append(c)
            else:
                content.append(body)
            continue
        (reasoning if m.channel == "analysis" else content).append(body)
        if not m.complete:
            break
    return "".join(content), "".join(reasoning), out


def parse_harmony(text: str) -> tuple[str, list[ToolCall]]:
    """gpt-oss: the final channel's text is content, each message to functions.NAME a call
    (the analysis channel is reasoning: `harmony_read`)."""
    content, _, calls = harmony_read(text)
    return content, calls


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "harmony": parse_harmony,
}
# formats written in special tokens: generated text keeps them for the parser to read, and
# generation ends on these tokens too (a call or the final answer ends the turn; <|end|>
# ends one message of it)
MARKUP = {"harmony": ("<|call|>", "<|return|>")}
# formats with channels: text -> (content, reasoning, calls), as `harmony_read`
CHANNELS = {"harmony": harmony_read}
# where a tool call starts in each format: streamed text is held from there on
MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{"),
           "mistral": ("[TOOL_CALLS]",), "harmony": ()}  # fmt: skip
_BY_TYPE = {"qwen2": "hermes", "qwen3": "hermes", "qwen2_moe": "hermes", "qwen3_moe": "hermes",
            "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral",
            "gpt_oss": "harmony"}  # fmt: skip


def parser_name(template: str | None, model_type: str, override: str | None = None) -> str:
    """The parser for a model: `override` (--tool-parser), else the format its chat
    template writes, else its family's, else Hermes'."""
    if override is not None:
        if override not in PARSERS:
            raise MlxrunError(
                f"--tool-parser {override!r} is not known; one of {', '.join(PARSERS)}"
            )
        return override
    t = template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return "harmony"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return _BY_TYPE.get(model_type, "hermes")


def parse(name: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an answer in parser `name`'s format; a malformed call is content."""
    content, calls = PARSERS[name](text)
    if name in MARKUP:  # the content is the answer's text without its markup
        return content, calls
    return (content, calls) if calls else (text, [])


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them: an assistant's tool_calls with their
    arguments as objects (templates write them with `tojson`), and content "" for null."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c.get("function", {}))
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": f})
            m["tool_calls"] = calls
        out.append(m)
    return out
