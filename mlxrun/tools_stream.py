"""How the server reads tool calls from an answer, whole or streamed (`mlxrun.tools` has
the formats; this holds back streamed text that may turn out to be a call)."""

from __future__ import annotations

from .tools import CHANNELS, MARKERS, ToolCall, call_constraint, constrained_calls, parse


class ToolReply:
    """One request's tool settings: choice ("auto", "none", "required" or a function dict),
    the model's parser, and the constraint a required or named choice puts on the answer.
    A format with channels (gpt-oss's harmony) is read even without tools, as its markup
    and reasoning are never content."""

    def __init__(self, choice, parser: str, tools: list[dict], parallel: bool):
        self.choice, self.parser = choice, parser
        forced = choice == "required" or isinstance(choice, dict)
        self.constraint = call_constraint(tools, choice, parallel) if forced else None

    def final(self, text: str, finish: str | None) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished answer; an answer cut short is content."""
        if self.constraint is not None:
            calls = constrained_calls(text, self.choice) if finish == "stop" else None
            return (text, []) if not calls else ("", calls)
        if self.parser in CHANNELS:
            content, _, calls = CHANNELS[self.parser](text, calls=self.choice != "none")
            return content, calls
        return parse(self.parser, text)

    def reasoning(self, text: str) -> str:
        """The reasoning channel's text of a finished answer ("" if the format has none)."""
        if self.constraint is not None or self.parser not in CHANNELS:
            return ""
        return CHANNELS[self.parser](text)[1]

    def streamer(self) -> ToolStream | ChannelStream:
        if self.constraint is None and self.parser in CHANNELS:
            return ChannelStream(self)
        return ToolStream(self)


class ToolStream:
    """Streamed text in, the part that is surely content out: from where a call may begin
    (the format's marker, or a prefix of it at the end) the text is held until the end."""

    def __init__(self, reply: ToolReply):
        self.reply = reply
        self.text, self.sent = "", 0
        self.held = reply.constraint is not None  # a forced call: nothing is content

    def _hold_from(self) -> int:
        t = self.text
        if self.held:
            return self.sent
        start = len(t) - len(t.lstrip())
        at = len(t)
        for m in MARKERS[self.reply.parser]:
            if m == "{":  # a bare JSON call (Llama 3): only as the whole answer
                if t[start:].startswith("{") or start == len(t):
                    at = min(at, start)
                continue
            i = t.find(m)
            if i >= 0:
                at = min(at, i)
                continue
            for k in range(min(len(m) - 1, len(t)), 0, -1):  # a marker's start at the end
                if t.endswith(m[:k]):
                    at = min(at, len(t) - k)
                    break
        return at

    def feed(self, piece: str) -> str:
        """The content that can be sent now."""
        self.text += piece
        at = max(self.sent, self._hold_from())
        out, self.sent = self.text[self.sent : at], at
        return out

    def reasoning(self) -> str:
        """The reasoning that can be sent now: none in these formats."""
        return ""

    def finish(self, reason: str | None) -> tuple[str, list[ToolCall]]:
        """(the rest of the content, the calls) once the answer has ended."""
        content, calls = self.reply.final(self.text, reason)
        if not calls:
            return self.text[self.sent :], []
        done = self.text[: self.sent]
        return (content[len(done) :] if content.startswith(done) else ""), calls


def _rest(whole: str, sent: str) -> str:
    return whole[len(sent) :] if whole.startswith(sent) else ""


class ChannelStream:
    """Streamed text of a format with channels (harmony) in, content and reasoning out: a
    message's text goes out once its header says where it belongs, less a tail that may
    be the start of its end token; a call's text is held until the answer ends."""

    def __init__(self, reply: ToolReply):
        self.reply, self.read = reply, CHANNELS[reply.parser]
        self.text, self.content, self.thought = "", "", ""  # what was sent of each
        self._thinking = ""  # reasoning not yet taken by `reasoning()`

    def feed(self, piece: str) -> str:
        """The content that can be sent now (the reasoning: `reasoning()`)."""
        self.text += piece
        content, thought, _ = self.read(self.text, ended=False, calls=self.reply.choice != "none")
        out = _rest(content, self.content)
        self.content += out
        new = _rest(thought, self.thought)
        self.thought += new
        self._thinking += new
        return out

    def reasoning(self) -> str:
        """The reasoning that can be sent now."""
        out, self._thinking = self._thinking, ""
        return out

    def finish(self, reason: str | None) -> tuple[str, list[ToolCall]]:
        """(the rest of the content, the calls) once the answer has ended; the rest of the
        reasoning is then `reasoning()`."""
        content, calls = self.reply.final(self.text, reason)
        self._thinking += _rest(self.reply.reasoning(self.text), self.thought)
        return _rest(content, self.content), calls
