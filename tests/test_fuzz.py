"""Property-based fuzzing of the parsers that read files from outside: the safetensors header
reader, the GGUF reader (through open_checkpoint), config.json parsing and the prompt-file
reader. Random and mutated inputs (bit flips, truncations, huge counts and lengths, wrong
types) must end in MlxrunError with a message, never another exception or a hang.

CI runs a fixed, derandomized budget (~12 s on 2 loaded cores); benchmarks/fuzz_parsers.py runs the same
targets for longer with fresh randomness and also bounds memory by the file's size.
"""

from __future__ import annotations

import json
import signal
import struct
import tempfile
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError

from .conftest import TINY

CI = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SECONDS = 20  # per input: far above any honest parse of these small files
MEMORY = {"limit": None}  # set by the long run: bytes a parse may allocate per file byte


class Hang(Exception):
    pass


@contextmanager
def _bounded(size: int):
    """Fail an input that runs for SECONDS, or (when MEMORY["limit"] is set) allocates more
    than limit x its size + 16 MiB through Python's allocators."""

    def alarm(*_):
        raise Hang(f"still parsing after {SECONDS} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS)
    track = MEMORY["limit"] is not None
    if track:
        tracemalloc.start()
    try:
        yield
        if track:
            peak = tracemalloc.get_traced_memory()[1]
            assert peak <= MEMORY["limit"] * size + (16 << 20), f"peak {peak} B for {size} B"
    finally:
        if track:
            tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def only_mlxrun_errors(fn, *args) -> bool:
    """Run fn(*args); True if it succeeded, False if it raised MlxrunError with a one-line
    message; any other exception fails the property."""
    try:
        fn(*args)
        return True
    except MlxrunError as e:
        msg = str(e)
        assert msg and "\n" not in msg, repr(msg)
        return False


# ------------------------------------------------------------------------------ seeds


def safetensors_seed() -> bytes:
    from mlxrun.weights import Tensor, bf16_bits, save_safetensors

    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": Tensor("F32", rng.normal(size=(4, 8)).astype(np.float32)),
        "b.scales": Tensor("BF16", bf16_bits(rng.normal(size=(3,)).astype(np.float32))),
        "c.weight": Tensor("U32", np.arange(6, dtype=np.uint32).reshape(2, 3)),
    }
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "s.safetensors"
        save_safetensors(p, tensors, {"format": "mlx"})
        return p.read_bytes()


def gguf_seed() -> bytes:
    from .test_gguf import write_synthetic

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.gguf"
        write_synthetic(p)
        return p.read_bytes()


_SEEDS: dict[str, bytes] = {}


def seed(kind: str) -> bytes:
    if kind not in _SEEDS:
        _SEEDS[kind] = {"safetensors": safetensors_seed, "gguf": gguf_seed}[kind]()
    return _SEEDS[kind]


def _header_end(kind: str, data: bytes) -> int:
    """Where the part worth mutating ends: the JSON header, or GGUF's metadata."""
    if kind == "safetensors":
        return 8 + struct.unpack("<Q", data[:8])[0]
    return min(len(data), 8192)


@st.composite
def mutated(draw, kind: str) -> bytes:
    """The seed file with bit flips, overwritten 1/2/4/8-byte integers (huge counts and
    lengths), inserted or deleted bytes, or a truncation."""
    data = bytearray(seed(kind))
    end = _header_end(kind, data)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "int", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, min(end, len(data)) - 1)))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "int":
            width = draw(st.sampled_from([1, 2, 4, 8]))
            big = draw(
                st.sampled_from([0, 1, 2**width * 8 - 1, 2 ** (width * 8 - 1), 2**31, 2**32 - 1])
            )
            big = min(big, 2 ** (width * 8) - 1)
            data[at : at + width] = big.to_bytes(width, "little")
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


# ---------------------------------------------------------------------------- targets


def parse_safetensors(data: bytes) -> bool:
    from mlxrun.weights import load_safetensors

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.safetensors"
        p.write_bytes(data)
        with _bounded(len(data)):
            return only_mlxrun_errors(load_safetensors, p)


def parse_gguf(data: bytes) -> bool:
    from mlxrun.loader import open_checkpoint

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.gguf"
        p.write_bytes(data)
        with _bounded(len(data)):
            return only_mlxrun_errors(open_checkpoint, str(p))


def parse_config(d) -> bool:
    return only_mlxrun_errors(ModelConfig.from_dict, d)


def parse_prompts(data: bytes, suffix: str) -> bool:
    from mlxrun.cli_io import read_prompts

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"p{suffix}"
        p.write_bytes(data)
        with _bounded(len(data)):
            return only_mlxrun_errors(read_prompts, str(p))


def safetensors_header(header) -> bytes:
    """A file whose JSON header is `header` (any JSON value) over 64 bytes of data."""
    hb = json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + bytes(64)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
tensor_entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "BF16", "U8", "Q4", 7, None, ["F32"]]),
        "shape": st.one_of(st.lists(st.integers(-3, 2**40), max_size=4), json_values),
        "data_offsets": st.one_of(st.lists(st.integers(-(2**65), 2**65), max_size=3), json_values),
    },
)
# config values: a valid tiny config with some fields replaced by arbitrary JSON values
config_fields = list(TINY["llama3_untied_scaled"]) + ["head_dim", "eos_token_id", "quantization"]
configs = st.dictionaries(st.sampled_from(config_fields), json_values, max_size=4).map(
    lambda change: {**TINY["llama3_untied_scaled"], **change}
)


# -------------------------------------------------------------------------- properties


@CI
@given(mutated("safetensors"))
def test_fuzz_safetensors_mutated(data):
    parse_safetensors(data)


@CI
@given(st.dictionaries(st.text(max_size=6), tensor_entries, max_size=3) | json_values)
def test_fuzz_safetensors_header_values(header):
    parse_safetensors(safetensors_header(header))


@CI
@given(st.binary(max_size=64))
def test_fuzz_safetensors_random_bytes(data):
    parse_safetensors(data)


@settings(CI, max_examples=40)
@given(mutated("gguf"))
def test_fuzz_gguf_mutated(data):
    parse_gguf(data)


@settings(CI, max_examples=20)
@given(st.binary(max_size=64).map(lambda b: b"GGUF" + b))
def test_fuzz_gguf_random_bytes(data):
    parse_gguf(data)


@CI
@given(configs)
def test_fuzz_config_fields(d):
    parse_config(d)


@CI
@given(json_values)
def test_fuzz_config_any_json(d):
    parse_config(d)


@settings(CI, max_examples=40)
@given(st.binary(max_size=200), st.sampled_from([".txt", ".jsonl"]))
def test_fuzz_prompt_files(data, suffix):
    parse_prompts(data, suffix)


def test_seeds_parse():
    """The unmutated seeds parse, so mutations start from files that reach deep code."""
    assert parse_safetensors(seed("safetensors")) and parse_gguf(seed("gguf"))
    assert parse_config(dict(TINY["llama3_untied_scaled"]))
    assert parse_prompts(b'{"prompt": "hi"}\n', ".jsonl")
