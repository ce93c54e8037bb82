"""GGUF tokenizers from metadata: the vocabulary, merges and chat template a GGUF carries
become a tokenizers JSON that tokenizes like transformers' GGUF tokenizer (SmolLM2's BPE,
and a sentencepiece-style vocabulary with scores only), and streams token by token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlxrun.gguf import read_gguf

from .conftest import REAL, needs_real

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello  world",
    "   leading and trailing   ",
    "",
    "a",
    " ",
    "\n",
    "\n\n\n",
    "\t\ttabs\tand  spaces",
    "line one\nline two\r\nline three",
    "The year 2024 had 366 days; 3.14159 is pi, 1,000,000 is a million.",
    "1234567890",
    " 42",
    "x=0xFF; y = -12.5e-3",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '<html><body class="x">Hi</body></html>',
    "naïve café résumé über straße",
    "Ελληνικά και русский текст",
    "日本語のテキストと中文文本",
    "한국어 문장입니다",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "math ∑ ∫ √ ≈ ≠ ∞ → ←",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more",
    "I'm sure you'll see they've done it, didn't they?",
    "ALL CAPS AND lower case MiXeD",
    "don't   stop\n\n  me now",
    "tab\tsep\tvalues\n",
    "🙂",
    "multiple     spaces      here",
    "end with newline\n",
    "a" * 50,
    "URL: https://x.org/a?b=c",
    "a <unk> b <s> c </s> d",
    "x<tool>y",
    " <|im_start|> spaced",
]


def spm_vocab():
    """A small sentencepiece-style BPE vocabulary trained here: (tokens, scores, types, oracle).

    The oracle is a tokenizers BPE with the trained merges in their true order; the GGUF keeps
    only scores (-merge rank), as llama.cpp does for sentencepiece models.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [t for t in TEXTS if t] * 3 + [
        "the quick brown fox jumps over the lazy dog",
        "hello there, general kenobi",
        "tokenizers split words into pieces and pieces into bytes",
    ] * 5
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False)
    )
    trained = json.loads(trainer_tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    chars = sorted(t for t in trained["vocab"] if len(t) == 1)
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<tool>"]
    types = [2, 3, 3, 3, 4]
    scores = [0.0] * 5
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    for rank, (left, right) in enumerate(merges):
        if left + right not in tokens:
            tokens.append(left + right)
            types.append(1)
            scores.append(-float(rank))
    for j, c in enumerate(chars):
        tokens.append(c)
        types.append(1)
        scores.append(-float(len(merges) + j))
    oracle = Tokenizer(
        models.BPE(
            {t: i for i, t in enumerate(tokens)},
            merges,
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    oracle.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    oracle.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokens, scores, types, oracle


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(tmp_path_factory):
    """transformers' own tokenizer for a GGUF (the oracle), loaded from a local directory."""
    from transformers import AutoTokenizer

    def load(path: Path):
        d = tmp_path_factory.mktemp("hf")
        (d / path.name).symlink_to(path)
        return AutoTokenizer.from_pretrained(str(d), gguf_file=path.name, local_files_only=True)

    return load


@needs_real
def test_real_tokenizer_matches_transformers(real, hf_gguf_tokenizer, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ref = hf_gguf_tokenizer(REAL)
    ours = Tokenizer.from_str(real.tokenizer_json)
    for s in TEXTS:
        ids = ours.encode(s).ids
        assert ids == ref(s)["input_ids"], s
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), s
    assert ours.encode("<|im_start|>user").ids == [1, 4093]
    assert ours.encode("1234").ids == [33, 34, 35, 36]  # one token per digit
    assert real.tokenizer_config["bos_token"] == "<|im_start|>"
    assert real.tokenizer_config["eos_token"] == "<|im_end|>"
    assert real.tokenizer_config["add_bos_token"] is False

    # Our files as a directory: transformers loads them and renders the same chat prompt.
    (tmp_path / "tokenizer.json").write_text(real.tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(real.tokenizer_config))
    mine = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    msgs = [
        {"role": "user", "content": "What is 2+2? 🙂"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks!"},
    ]
    text = mine.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert mine(text)["input_ids"] == ref(text)["input_ids"]


def test_spm_tokenizer_matches_transformers_and_trained_bpe(synthetic, hf_gguf_tokenizer):
    """A sentencepiece-style ("llama") vocabulary with scores only: merges recovered from the
    scores tokenize like the trained BPE itself and like transformers' GGUF tokenizer."""
    from tokenizers import Tokenizer

    path, _ = synthetic
    m = read_gguf(path)
    ours = Tokenizer.from_str(m.tokenizer_json)
    ref = hf_gguf_tokenizer(path)
    *_, trained = spm_vocab()
    for s in TEXTS:
        ids = ours.encode(s).ids
        assert ids == ref(s)["input_ids"], s
        # the trained BPE has no added tokens: compare on text without them
        plain = re.sub(r"<\|im_start\|>|<\|im_end\|>|<unk>|</?s>|<tool>", "", s)
        assert (
            ours.encode(plain, add_special_tokens=False).tokens == trained.encode(plain).tokens
        ), plain
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), s
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        ), s
    assert ours.encode("hi").ids[0] == 1  # add_bos_token
    assert ours.encode("<|im_start|>x<tool>").tokens[1:4:2] == ["<|im_start|>", "<tool>"]
    crab = ours.encode("🦀", add_special_tokens=False)  # not in the training corpus
    assert crab.tokens == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]  # byte fallback
    assert ours.decode(crab.ids) == "🦀" == ref.decode(crab.ids)
    assert m.tokenizer_config["chat_template"].startswith("{% for m in messages %}")
    assert (m.tokenizer_config["bos_token"], m.tokenizer_config["unk_token"]) == ("<s>", "<unk>")


@pytest.mark.parametrize("which", ["synthetic", "real"])
def test_streaming_detokenizer_pieces_and_window(which, synthetic, request):
    """Token by token, the streamed pieces join to the whole decode (multi-byte characters,
    leading spaces, both tokenizer kinds), and each step decodes a few tokens only, however
    long the text has grown."""
    from mlxrun.tokenizer import Tokenizer

    if which == "real":
        m = request.getfixturevalue("real")
    else:
        m = read_gguf(synthetic[0])
    tk = Tokenizer.from_json(m.tokenizer_json, m.tokenizer_config, set())
    seen = []
    real_decode = tk.decode
    tk.decode = lambda ids, *a, **kw: (seen.append(len(ids)), real_decode(ids, *a, **kw))[1]
    text = " ".join(t.replace("\n", " ") for t in TEXTS) * 3  # ~2k tokens, no newline
    ids = tk.encode(text, add_special_tokens=False)
    detok = tk.detokenizer()
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == detok.text == real_decode(ids)
    assert len(ids) > 1000 and max(seen) <= 8, (len(ids), max(seen))
