"""Constrained decoding: a JSON schema, `json_object`, a regular expression or a grammar
(GBNF or Lark) compiled by llguidance into one matcher per sequence.

Each step a matcher writes its sequence's allowed tokens as a bitmask (B, ceil(V/32))
int32, bit i of word i // 32 set where token i may come next; the device sampler sets the
other logits to -inf before greedy or sampled choice (`SamplerPlan.masked`), and the chosen
token advances the matcher. Why llguidance and not xgrammar: docs/structured.md.

Compiled grammars are cached per tokenizer by the constraint's text, so a schema sent with
every request is checked once.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import MlxrunError

KINDS = ("json_schema", "json_object", "regex", "grammar", "lark")
# JSON as OpenAI's and most clients' parsers print it: no free whitespace, which a small
# model would otherwise fill with newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept per tokenizer
# the server refuses a schema or grammar that takes longer to compile (--compile-timeout)
COMPILE_SECONDS = 10.0


def _llguidance():
    try:
        import llguidance  # noqa: PLC0415
    except ImportError:
        raise MlxrunError(
            "structured outputs need llguidance: pip install 'mlxrun[structured]'"
        ) from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a sequence's output must match. kind: json_schema | json_object | regex |
    grammar (GBNF, as llama.cpp's server takes it) | lark; source: the schema as canonical
    JSON text, or the expression or grammar as given."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str | bool) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise MlxrunError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise MlxrunError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    def grammar_text(self) -> str:
        """The llguidance grammar (not yet checked against a tokenizer)."""
        lg = _llguidance()
        M = lg.LLMatcher
        if self.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if self.kind == "json_schema":
            schema = json.loads(self.source)
            return M.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        if self.kind == "regex":
            return M.grammar_from_regex(self.source)
        if self.kind == "lark":
            return M.grammar_from_lark(self.source)
        if self.kind == "grammar":
            from llguidance.gbnf_to_lark import gbnf_to_lark  # noqa: PLC0415

            try:
                return M.grammar_from_lark(gbnf_to_lark(self.source))
            except Exception as e:  # the converter raises bare Exceptions for missing rules
                raise MlxrunError(f"the grammar does not parse as GBNF: {e}") from None
        raise MlxrunError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")


def _describe(c: Constraint) -> str:
    return {"json_schema": "JSON schema", "json_object": "json_object", "regex": "regular "
            "expression", "grammar": "grammar", "lark": "Lark grammar"}[c.kind]  # fmt: skip


class Grammars:
    """llguidance's view of one tokenizer, at the model's vocabulary size, and its cache of
    checked grammars. Safe to use from several threads (the server compiles on its pool)."""

    def __init__(self, tokenizer, vocab: int):
        lg = _llguidance()
        self.vocab = max(vocab, tokenizer.vocab_size)
        self.words = (self.vocab + 31) // 32
        eos = sorted(tokenizer.eos_token_ids)
        if not eos:
            raise MlxrunError(
                "the tokenizer names no end-of-sequence token, so a constrained answer "
                "could never end; the checkpoint's config should give eos_token_id"
            )
        self.eos = eos
        try:
            self.lt = lg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=self.vocab, eos_token=eos)
        except ValueError as e:  # e.g. a WordPiece decoder, which llguidance does not read
            raise MlxrunError(
                f"structured outputs cannot use this model's tokenizer: {_first_line(str(e))}"
            ) from None
        self._cache: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()
        self.executor = lg.LLExecutor()

    def compile(self, c: Constraint) -> str:
        """The checked grammar for `c` (cached); MlxrunError naming what is wrong."""
        with self._lock:
            if c in self._cache:
                self._cache.move_to_end(c)
                return self._cache[c]
        try:
            text = c.grammar_text()
        except ValueError as e:
            raise MlxrunError(f"the {_describe(c)} is not valid: {e}") from None
        bad, msgs = _llguidance().LLMatcher.validate_grammar_with_warnings(text, self.lt)
        if bad:
            raise MlxrunError(f"the {_describe(c)} cannot be used: {_first_line(msgs[0])}")
        with self._lock:
            self._cache[c] = text
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return text

    def matcher(self, c: Constraint) -> Matcher:
        return Matcher(self, self.compile(c))


def _first_line(msg: str) -> str:
    return " ".join(msg.split())[:400]


_grammars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_grammars_lock = threading.Lock()


def grammars_for(tokenizer, vocab: int) -> Grammars:
    """The Grammars of `tokenizer` at `vocab` tokens, made once (building llguidance's
    token trie takes ~0.1-1 s for a large vocabulary)."""
    with _grammars_lock:
        per = _grammars.setdefault(tokenizer, {})
        if vocab not in per:
            per[vocab] = Grammars(tokenizer, vocab)
        return per[vocab]


class Matcher:
    """One sequence's position in its grammar: fill() its next-token bitmask, advance() by
    the chosen token. `done` once the grammar is complete (only end-of-sequence may come)."""

    def __init__(self, grammars: Grammars, grammar: str):
        self.g = grammars
        self.m = _llguidance().LLMatcher(grammars.lt, grammar, log_level=0)
        if self.m.is_error():
            raise MlxrunError(f"the grammar cannot be used: {_first_line(self.m.get_error())}")

    @property
    def done(self) -> bool:
        return self.m.is_stopped()

    @property
    def error(self) -> str | None:
        return _first_line(self.m.get_error()) if self.m.is_error() else None

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` ((words,) int32, C-contiguous)."""
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token: int) -> bool:
        """Consume `token`; False if the grammar does not allow it (the matcher then stays
        in its error state)."""
        return self.m.consume_token(int(token))


def fill_masks(
    matchers: list[Matcher | None], words: int, out: np.ndarray | None = None
) -> np.ndarray:
    """(B, words) int32 bitmask: each matcher's allowed tokens, all ones for rows without a
    matcher or whose matcher has ended (their caller ignores what they draw; no mask is
    computed for them), computed in parallel over the rows by llguidance's thread pool.
    Written into `out` ((B, words) int32, C-contiguous) when given."""
    if out is None:
        out = np.empty((len(matchers), words), dtype=np.int32)
    live = []
    for b, m in enumerate(matchers):
        if m is None or m.m.is_error() or m.m.is_stopped():
            out[b] = -1
        else:
            live.append((m.m, b))
    if len(live) == 1:
        m, b = live[0]
        m.unsafe_compute_mask_ptr(out[b].ctypes.data, out[b].nbytes)
    elif live:
        ex = next(m for m in matchers if m is not None).g.executor
        ex.unsafe_compute_mask_ptr(live, out.ctypes.data, words * 4, len(matchers))
    return out


def constraint_of(
    json_schema: dict | str | bool | None = None,
    grammar: str | None = None,
    regex: str | None = None,
) -> Constraint | None:
    """The one Constraint the API's options ask for (at most one of them), or None.
    json_schema: a schema (dict or JSON text); grammar: GBNF text, or Lark text (one that
    has a `start:` rule or a `%llguidance` line); regex: a regular expression."""
    given = [n for n, v in (("json_schema", json_schema), ("grammar", grammar),
                            ("regex", regex)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise MlxrunError(f"give one of {', '.join(given)}, not several")
    if json_schema is not None:
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint("regex", regex)
    if grammar is not None:
        if not grammar.strip():
            raise MlxrunError("the grammar is empty")
        _llguidance()
        from llguidance.gbnf_to_lark import is_lark_syntax  # noqa: PLC0415

        return Constraint("lark" if is_lark_syntax(grammar) else "grammar", grammar)
    return None
