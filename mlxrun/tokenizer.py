"""Tokenizer: the `tokenizers` library for tokenizer.json, chat templates with jinja2, and
streaming detokenization that never emits half of a multi-byte character."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .errors import MlxrunError


def _token_text(v) -> str | None:
    # tokenizer_config.json stores special tokens as strings or {"content": ...} dicts.
    return v.get("content") if isinstance(v, dict) else v


# Largest string or list a template may build with `*`, and largest integer exponent: jinja2's
# sandbox bounds range() (100,000) but would let "a" * 10**10 allocate 10 GB, and
# 10**10**10 run for ever.
MAX_REPEAT = 1 << 20
MAX_EXPONENT = 1024


def _sandbox(base):
    """`base` (a jinja2 sandboxed environment class) that also bounds `*` and `**`."""

    class Bounded(base):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        if len(seq) * n > MAX_REPEAT:
                            raise OverflowError(
                                f"a repeat of {len(seq)} x {n} is over the limit {MAX_REPEAT}"
                            )
            if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
                raise OverflowError(f"an exponent of {right} is over the limit {MAX_EXPONENT}")
            return super().call_binop(context, operator, left, right)

    return Bounded


class Tokenizer:
    """Encodes, decodes and renders chat prompts.

    tok: a `tokenizers.Tokenizer`; config: the tokenizer_config.json dict; eos_ids: every id
    that ends generation (from config.json, generation_config.json and the tokenizer).
    """

    def __init__(self, tok, config: dict, eos_ids: set[int]):
        self._tok = tok
        self.config = config
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values())))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = set(eos_ids)
        if self.eos_token is not None and tok.token_to_id(self.eos_token) is not None:
            eos.add(tok.token_to_id(self.eos_token))
        self.eos_token_ids = eos
        self.bos_token_id = None if self.bos_token is None else tok.token_to_id(self.bos_token)
        self.vocab_size = tok.get_vocab_size()
        # Generated text keeps special tokens where the model's replies carry their
        # structure in them (gpt-oss's harmony channels, `keep_markup`); else they are dropped.
        self.markup = False

    def keep_markup(self, ends: tuple[str, ...] = ()) -> None:
        """Keep special tokens in generated text from now on, and end generation on each
        token of `ends` this vocabulary has (gpt-oss's `<|call|>` is not its EOS in every
        checkpoint, yet a call ends the turn)."""
        self.markup = True
        self.eos_token_ids |= {i for t in ends if (i := self._tok.token_to_id(t)) is not None}

    @classmethod
    def from_dir(cls, path: Path, eos_ids: set[int]) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415

        tj = path / "tokenizer.json"
        if not tj.exists():
            raise MlxrunError(
                f"{path} has no tokenizer.json; mlxrun needs the fast-tokenizer "
                "file (re-save the tokenizer with transformers to create it)"
            )
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise MlxrunError(f"{tj}: cannot be read ({e}); re-download it") from None
        cfg = {}
        tc = path / "tokenizer_config.json"
        if tc.exists():
            cfg = json.loads(tc.read_text())
        jt = path / "chat_template.jinja"
        if jt.exists():
            cfg["chat_template"] = jt.read_text()
        return cls(tok, cfg, eos_ids)

    @classmethod
    def from_json(cls, tokenizer_json: str, config: dict, eos_ids: set[int]) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415

        return cls(HFTokenizer.from_str(tokenizer_json), config, eos_ids)

    def vocab(self) -> dict[str, int]:
        """Token text -> id, every token (special ones too)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """str -> token ids; `add_special_tokens` lets tokenizer.json's post-processor add
        BOS (the chat template writes its own, so chat prompts pass False)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool | None = None) -> str:
        """ids -> text; special tokens are dropped unless the model keeps its markup
        (`keep_markup`) or `skip_special_tokens` is False."""
        if skip_special_tokens is None:
            skip_special_tokens = not self.markup
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """Render messages [{"role", "content"}] with the model's jinja2 template; `tools`
        (OpenAI's [{"type": "function", "function": {...}}]) reach it as `tools`, as
        transformers passes them (a template that does not use them ignores them)."""
        if not self.chat_template:
            raise MlxrunError("this model has no chat template; use --no-chat")
        import jinja2.ext  # noqa: PLC0415
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

        def raise_exception(msg):
            raise MlxrunError(f"chat template: {msg}")

        # Sandboxed, as transformers does: a template is data from the checkpoint.
        env = _sandbox(ImmutableSandboxedEnvironment)(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({"tools": tools} if tools else {}),
            )
        except MlxrunError:
            raise
        except jinja2.exceptions.SecurityError as e:
            why = f"the sandbox refused it ({e})"
        except OverflowError as e:  # range(), repeat and power limits
            why = f"the sandbox refused it ({e or 'a result over its size limit'})"
        except RecursionError:
            why = "it recurses without end"
        except jinja2.exceptions.TemplateError as e:  # syntax, undefined names
            why = f"{type(e).__name__}: {e}"
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # a template's own expression failed on these messages
            why = f"{type(e).__name__}: {e}"
        raise MlxrunError(
            f"the checkpoint's chat template was refused: {' '.join(why.split())}; "
            "--no-chat skips it and sends the prompt as plain text"
        )

    def prompt_ids(
        self, prompt: str, system: str | None = None, chat: bool | None = None
    ) -> list[int]:
        """The ids for a user prompt: through the chat template when the model has one
        (or chat=True), else plain text with the tokenizer's BOS."""
        if not prompt:
            raise MlxrunError("the prompt is empty; pass some text with --prompt")
        if chat is None:
            chat = bool(self.chat_template)
        if not chat:
            text = prompt if system is None else f"{system}\n\n{prompt}"
            return self.encode(text)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def detokenizer(self, markup: bool | None = None) -> StreamingDetokenizer:
        """A streaming detokenizer; `markup` keeps special tokens (None: as `self.markup`)."""
        return StreamingDetokenizer(self, self.markup if markup is None else markup)


class StreamingDetokenizer:
    """Turns a growing token list into text pieces.

    Decoding token by token would split multi-byte characters (an emoji spans several byte
    tokens) and lose the spaces some tokenizers attach to the next token. So each new token
    is decoded together with the few tokens before it: the text of tokens[prefix:] minus the
    text of tokens[prefix:read] is the new piece (a space or a strip at the window's start
    affects both alike), and the window moves up once a piece is out. Work per token stays
    constant however long the sequence grows (re-decoding it all made a 32-stream server
    host-bound within a few hundred tokens).
    """

    def __init__(self, tokenizer: Tokenizer, markup: bool = False):
        self._tk = tokenizer
        self._skip = not markup  # drop special tokens from the text
        self._tokens: list[int] = []
        self._prefix = 0  # the window's start: context for the next piece, not re-emitted
        self._read = 0  # tokens before this index are in `text`
        self.text = ""

    def add(self, token: int) -> str:
        """Add a token; return the new text that is now final (maybe empty)."""
        self._tokens.append(token)
        done = self._tk.decode(self._tokens[self._prefix : self._read], self._skip)
        cur = self._tk.decode(self._tokens[self._prefix :], self._skip)
        if len(cur) <= len(done) or cur.endswith("\ufffd"):  # incomplete UTF-8: wait
            return ""
        piece = cur[len(done) :]
        self._prefix, self._read = self._read, len(self._tokens)
        self.text += piece
        return piece

    def flush(self) -> str:
        done = self._tk.decode(self._tokens[self._prefix : self._read], self._skip)
        piece = self._tk.decode(self._tokens[self._prefix :], self._skip)[len(done) :]
        self._prefix = self._read = len(self._tokens)
        self.text += piece
        return piece
