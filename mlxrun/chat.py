"""`mlxrun chat`: a terminal conversation on the serving engine.

Each turn submits the whole conversation; the engine's prefix cache still holds the slot
of the previous turn, so only the new message (and the template's glue) is prefilled.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .engine import Engine
from .engine_io import Request
from .sampling import SamplingParams
from .structured import Constraint
from .tools import harmony_read

HELP = "Commands: /reset (forget the conversation), /system TEXT, /quit. Ctrl-C stops an answer."


def chat_loop(
    engine: Engine,
    params: SamplingParams,
    max_tokens: int,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = lambda s: (sys.stdout.write(s), sys.stdout.flush()),
    constraint: Constraint | None = None,
) -> list[dict]:
    """Read user lines until /quit or end of input; stream each answer (each following
    `constraint`'s schema or grammar, when given). Returns the conversation (for tests)."""
    tok = engine.tokenizer
    history: list[dict] = []
    write(HELP + "\n")
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            write("\n")
            return history
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, not an exit
            write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text == "/quit":
            return history
        if text == "/reset":
            history = []
            write("(conversation cleared)\n")
            continue
        if text.startswith("/system"):
            system = text[len("/system") :].strip() or None
            history = []
            write(f"(system message {'set' if system else 'removed'}; conversation cleared)\n")
            continue
        if text.startswith("/"):
            write(f"unknown command {text.split()[0]}. {HELP}\n")
            continue
        msgs = ([{"role": "system", "content": system}] if system else []) + history
        msgs.append({"role": "user", "content": text})
        if tok.chat_template:
            ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
        else:
            ids = tok.encode("\n".join(m["content"] for m in msgs))
        budget = engine.context - len(ids)
        if budget < 1:
            write("(the conversation fills the context; /reset to start over)\n")
            continue
        req = Request(ids, params, min(max_tokens, budget), constraint=constraint)
        answer = []
        shown = Shown(write) if tok.markup else None
        events = engine.stream(req)
        try:
            for ev in events:
                answer.append(ev.text)
                if shown is None:
                    write(ev.text)
                else:
                    shown.update("".join(answer), ended=False)
        except KeyboardInterrupt:
            write(" [stopped]")
        finally:
            events.close()  # cancels the request if it is still running
        reply = "".join(answer) if shown is None else shown.update("".join(answer), ended=True)
        write("\n")
        history += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": reply},
        ]


class Shown:
    """A harmony answer (gpt-oss) on the terminal: its reasoning marked as such, then the
    final answer; the markup itself is never shown, and only the final answer is kept as
    the assistant's turn (the template drops earlier turns' reasoning anyway)."""

    def __init__(self, write: Callable[[str], None]):
        self.write, self.content, self.thought = write, "", ""

    def update(self, text: str, ended: bool) -> str:
        content, thought, _ = harmony_read(text, ended=ended, calls=False)
        if len(thought) > len(self.thought):
            self.write(("(thinking) " if not self.thought else "") + thought[len(self.thought) :])
            self.thought = thought
        if len(content) > len(self.content):
            self.write(
                ("\n" if self.thought and not self.content else "") + content[len(self.content) :]
            )
            self.content = content
        return content
