"""`mlxrun eval`: how much quantization changes a model, measured on text.

The reference is the same model unquantized on the same backend and dtype. For a source
that is already quantized (the bundled SmolLM2 GGUF: Q4_1 linears, Q8_0 embedding) the
reference is its dequantized dense weights, and the formats under test are quantized from
those, so every row of the table compares against one and the same dense model.

Per position of a text split into non-overlapping windows, with P the reference's and Q the
quantized model's next-token distribution:
    kl   = mean KL(P || Q) in nats
    top1 = fraction of positions where argmax Q == argmax P
    perplexity = exp(mean -log Q(next token))
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np

from .config import ModelConfig
from .dense import dense_checkpoint, quantize_tensors
from .errors import MlxrunError, read_user_text
from .loader import Checkpoint, open_checkpoint
from .weights import Tensor

MIN_TOKENS = 64  # fewer scored positions than this give noise, not a measurement
_KL_ROWS = 64  # positions per float64 softmax chunk: 64 x vocab x 8 bytes stays small


@dataclass(frozen=True)
class EvalResult:
    """One row of the table. kl in nats; top1 in [0, 1]; bytes_per_weight over the linear
    and embedding matrices as the backend holds them (packed values + scales + biases, or
    dense elements for layers left unquantized); n_tokens: scored positions."""

    quant: str
    perplexity: float
    kl: float
    top1: float
    bytes_per_weight: float
    n_tokens: int


@dataclass(frozen=True)
class EvalRun:
    """What `evaluate_many` measured: one result per choice then per extra candidate, in
    the order given; notes (layers left unquantized, one per matrix); reference: one line
    on what the unquantized model is; backend: where it ran."""

    results: list[EvalResult]
    notes: list[str]
    reference: str
    backend: str


@dataclass(frozen=True)
class QuantChoice:
    """A format to evaluate: `name` as for --quant (None or 'none': the reference itself)."""

    name: str | None
    group_size: int | None = None
    bits: int | None = None
    clip_search: bool = False

    def spec(self):
        """The QuantSpec, or None for the unquantized reference (raises MlxrunError)."""
        if self.name in (None, "none"):
            return None
        if self.name.strip().lower() == "auto":
            raise MlxrunError(
                "eval measures one named format: use int4, int8, fp8, fp4 or nvfp4, not auto"
            )
        from mlxrun.quant.formats import resolve  # noqa: PLC0415

        return resolve(self.name, group_size=self.group_size, bits=self.bits)

    @property
    def label(self) -> str:
        """'none', 'int4 g64', 'fp4 g32', 'int4 g64 clip-search'."""
        spec = self.spec()
        if spec is None:
            return "none"
        label = f"{self.name.strip().lower()} g{spec.group_size}"
        return label + (" clip-search" if self.clip_search else "")


def parse_choices(
    quant: str, group_size: int | None = None, bits: int | None = None
) -> list[QuantChoice]:
    """`--quant` as a comma list of NAME[:gG][:clip] -> QuantChoices, checked.

    "none,int8,int4:g32,int4:g64:clip,fp4": G overrides `group_size` for that item; clip
    turns on the per-group clip search (int formats). Raises MlxrunError on a bad item.
    """
    choices = []
    for item in quant.split(","):
        name, *opts = [x.strip() for x in item.strip().split(":")]
        if not name:
            raise MlxrunError(
                f"--quant {quant!r} has an empty entry; give a comma list such as "
                "none,int8,int4:g32,fp4"
            )
        g, clip = group_size, False
        for o in opts:
            if o.lower() == "clip":
                clip = True
            elif o[:1].lower() == "g" and o[1:].isdigit():
                g = int(o[1:])
            else:
                raise MlxrunError(
                    f"--quant entry {item.strip()!r}: {o!r} is neither gN (a group size) "
                    "nor clip; write e.g. int4:g32 or int4:g64:clip"
                )
        c = QuantChoice(name, g, bits, clip)
        c.spec()  # unknown names, group sizes and widths fail here, before any loading
        if clip and c.spec() is not None and c.spec().mode != "affine":
            raise MlxrunError(f"clip search applies to int4/int8 only, not {name}")
        choices.append(c)
    return choices


def reference_note(ckpt: Checkpoint) -> str:
    """One line saying what the unquantized reference is for this checkpoint."""
    q = ckpt.config.quantization
    if not q:
        return "reference: the checkpoint's own unquantized weights"

    def one(d: dict) -> str:
        return f"{d.get('mode', 'affine')} {d.get('bits')}-bit g{d.get('group_size')}"

    parts = [one(q)] if "bits" in q else []
    parts += [f"{k} {one(v)}" for k, v in q.items() if isinstance(v, dict)]
    return (
        f"reference: the checkpoint is stored quantized ({'; '.join(parts)}), so the "
        "unquantized reference is its dense copy (packed weights dequantized to float32); "
        "every format is quantized from that copy"
    )


@dataclass(frozen=True)
class Candidate:
    """A model to score against the reference that mlxrun did not build (e.g. mlx-lm's
    own quantization): `logits(ids [T]) -> float32 [T, vocab]` for one window."""

    label: str
    logits: Callable[[np.ndarray], np.ndarray]
    bytes_per_weight: float


# ---------------------------------------------------------------- measuring


def matrix_bytes_per_weight(transformer) -> float:
    """Bytes the backend holds per element of the linear and embedding matrices (a tied
    head counted once): packed weight + scales + biases, plus any kernel-specific repack
    (CUDA keeps only the repack, except for the embedding), or the dense array."""
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    mats = [transformer.embed]
    for L in transformer.layers:
        mats += [L.q_proj, L.k_proj, L.v_proj, L.o_proj]
        mlp = (L.gate_proj, L.up_proj, L.down_proj)
        mats += list(mlp) if L.moe is None else [L.moe.gate, L.moe.up, L.moe.down]
    if transformer.head is not transformer.embed:
        mats.append(transformer.head)
    total = elems = 0
    for m in mats:
        if not isinstance(m, QuantizedWeight):
            total += int(m.nbytes)
            elems += int(np.prod(m.shape))
            continue
        held = [x for x in (m.weight, m.scales, m.biases) if x is not None]
        total += sum(int(x.nbytes) for x in held)
        total += int(getattr(m.kernel, "nbytes", 0))
        if m.weight is not None:
            elems += int(np.prod(m.shape))
        else:  # only the kernel's repack is held: QLinear knows its logical [n, k]
            elems += int(m.kernel.n) * int(m.kernel.k)
    return total / elems


def eval_text(text: str | None = None) -> str:
    """The text to score: a file path, or None for the bundled mlxrun/data/eval.txt."""
    if text is None:
        return resources.files("mlxrun").joinpath("data/eval.txt").read_text(encoding="utf-8")
    body = read_user_text(text, "--text", "a UTF-8 text file")
    if not body.strip():
        raise MlxrunError(f"--text {text}: the file is empty; give a few paragraphs of text")
    return body


def windows(ids: list[int], window: int, max_tokens: int) -> list[np.ndarray]:
    """Token ids cut to `max_tokens`, split into non-overlapping windows of `window` (the
    last one shorter; a 1-token tail is dropped since it predicts nothing)."""
    ids = ids[:max_tokens]
    chunks = [np.asarray(ids[i : i + window], np.int64) for i in range(0, len(ids), window)]
    return [c for c in chunks if len(c) >= 2]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class _Stats:
    """Running sums over scored positions."""

    def __init__(self):
        self.nll = self.kl = 0.0
        self.agree = self.n = 0

    def add(self, ref_logp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        """ref_logp float64 [T, V] (log P), logits [T, V] of the candidate, targets [T]."""
        logq = _log_softmax(logits)
        p = np.exp(ref_logp)
        self.kl += float((p * (ref_logp - logq)).sum())
        self.nll -= float(logq[np.arange(len(targets)), targets].sum())
        self.agree += int((ref_logp.argmax(-1) == logits.argmax(-1)).sum())
        self.n += len(targets)

    def result(self, label: str, bpw: float) -> EvalResult:
        n = max(self.n, 1)
        return EvalResult(
            label, float(np.exp(self.nll / n)), self.kl / n, self.agree / n, bpw, self.n
        )


def window_logits(transformer, ids: np.ndarray, kv_quant: str | None = None) -> np.ndarray:
    """One window through the model from an empty cache in format `kv_quant` (None: the
    compute dtype): ids [T] -> float32 logits [T, V]. Every query of the pass reads its keys
    and values back from the cache, so a quantized cache costs here what it costs a decode
    that fed the window one token at a time."""
    be = transformer.be
    transformer.kv_quant = kv_quant
    cache = transformer.make_cache(1, len(ids))
    return be.to_numpy(transformer(be.ids(ids.reshape(1, -1)), cache))[0]


def expanded(transformer):
    """The same model with every packed matrix dequantized once, for backends whose
    `linear` has no fused kernel and dequantizes on every call (PyTorch on CPU): the
    logits are bit-identical and the windows run at dense speed. Others: unchanged."""
    from mlxrun.backends.base import QuantizedWeight  # noqa: PLC0415

    from .model import Transformer  # noqa: PLC0415

    be = transformer.be
    if not (be.name == "torch" and be.device == "cpu"):
        return transformer

    def dense(m):
        return be.dequantize(m) if isinstance(m, QuantizedWeight) else m

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layers = [
        dataclasses.replace(L, **{n: dense(getattr(L, n)) for n in names})
        for L in transformer.layers
    ]
    embed = dense(transformer.embed)
    tied = transformer.head is transformer.embed
    head = embed if tied else dense(transformer.head)
    return Transformer(transformer.config, be, embed, layers, transformer.norm, head)


def _build(cfg: ModelConfig, tensors: dict[str, Tensor], be, choice: QuantChoice):
    """(transformer, notes) for one choice, quantizing the dense `tensors`."""
    from mlxrun.quant.formats import to_config  # noqa: PLC0415

    from .build import build_model  # noqa: PLC0415

    spec = choice.spec()
    if spec is None or not choice.clip_search:
        # the backend's own quantize-on-load path (mx.quantize / the numpy reference)
        return build_model(cfg, tensors, be, spec, progress=False)
    if spec.mode != "affine":
        raise MlxrunError(f"clip search applies to int4/int8 only, not {choice.name}")
    packed, notes = quantize_tensors(tensors, spec, dtype=be.dtype, clip_search=True)
    model, more = build_model(
        cfg.replace(quantization=to_config(spec)), packed, be, None, progress=False
    )
    return model, notes + more


def evaluate_many(
    model: str,
    choices: Sequence[QuantChoice],
    *,
    backend: str = "cpu",
    dtype: str | None = "float32",
    text: str | None = None,
    max_tokens: int = 4096,
    window: int = 512,
    extra: Sequence[Candidate] = (),
    progress: bool = False,
    kv_quants: Sequence[str | None] = (None,),
) -> EvalRun:
    """Score every choice (and `extra` candidate) against one unquantized reference over
    the same windows; the reference's logits are computed once per window. All models are
    held at once (the dense reference plus one quantized copy each). progress: a line per
    window on stderr. kv_quants: each choice runs once per KV-cache format listed (None:
    the compute dtype; 'int8', 'fp8': mlxrun.kvquant), rows in choice-major order; the
    reference keeps an unquantized cache.
    """
    from mlxrun.backends import get_backend  # noqa: PLC0415

    from .kvquant import check_head_dim  # noqa: PLC0415

    if window < 2:
        raise MlxrunError(f"--window must be at least 2 tokens, got {window}")
    if max_tokens < MIN_TOKENS:
        raise MlxrunError(f"--max-tokens must be at least {MIN_TOKENS}, got {max_tokens}")
    for c in choices:
        c.spec()  # a bad name, group size or width fails before anything is loaded
    body = eval_text(text)
    be = get_backend(backend, dtype)
    src = open_checkpoint(model)
    reference = reference_note(src)
    ckpt = dense_checkpoint(src)
    del src
    for kv in kv_quants:
        check_head_dim(kv, ckpt.config.head_dim, be.name)
    wins = windows(ckpt.tokenizer.encode(body, add_special_tokens=False), window, max_tokens)
    scored = sum(len(w) - 1 for w in wins)
    if scored < MIN_TOKENS:
        raise MlxrunError(
            f"the evaluation text gives only {scored} scored tokens and at least "
            f"{MIN_TOKENS} are needed: give a longer --text (a few paragraphs)"
        )
    ref, _ = _build(ckpt.config, ckpt.tensors, be, QuantChoice(None))
    models, notes = [], []
    for c in choices:
        if c.spec() is None:
            models.append(ref)
            continue
        m, n = _build(ckpt.config, ckpt.tensors, be, c)
        models.append(m)
        notes += [f"{c.label}: {x}" for x in n]
    rows = [(c, m, kv) for c, m in zip(choices, models) for kv in kv_quants]
    bpws = [matrix_bytes_per_weight(m) for _, m, _ in rows] + [c.bytes_per_weight for c in extra]
    is_ref = [m is ref and kv is None for _, m, kv in rows] + [False] * len(extra)
    dense = {id(m): expanded(m) for m in models}
    ref = dense[id(ref)] if id(ref) in dense else ref
    runs = [(dense[id(m)], kv) for _, m, kv in rows]
    fns = [lambda ids, m=m, kv=kv: window_logits(m, ids, kv) for m, kv in runs]
    fns += [c.logits for c in extra]
    stats = [_Stats() for _ in fns]
    for k, w in enumerate(wins):
        if progress:
            print(f"window {k + 1}/{len(wins)}", file=sys.stderr, flush=True)
        ref_logits = window_logits(ref, w)[:-1]  # position t predicts token t+1: [T-1, V]
        targets = w[1:]
        for fn, st, same in zip(fns, stats, is_ref, strict=True):
            logits = ref_logits if same else np.asarray(fn(w), dtype=np.float32)[:-1]
            # float64 softmaxes in row chunks: KL of near-equal models is a small difference
            for i in range(0, len(targets), _KL_ROWS):
                sl = slice(i, i + _KL_ROWS)
                st.add(_log_softmax(ref_logits[sl]), logits[sl], targets[sl])
    labels = [c.label + ("" if kv is None else f" kv-{kv}") for c, _, kv in rows]
    labels += [c.label for c in extra]
    results = [s.result(lb, b) for s, lb, b in zip(stats, labels, bpws, strict=True)]
    return EvalRun(results, notes, reference, be.describe())


def evaluate(
    model: str,
    quant: str | None,
    *,
    backend: str = "cpu",
    dtype: str | None = "float32",
    text: str | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    clip_search: bool = False,
    max_tokens: int = 4096,
    window: int = 512,
) -> EvalResult:
    """Quantize `model` with `quant` (int4, int8, fp8, fp4, nvfp4, or None/'none') and
    compare it with the unquantized model on `text` (a file; None: the bundled English
    sample, ~3900 SmolLM2 tokens), `window` tokens at a time, at most `max_tokens`.
    backend: auto | mlx | cuda | mps | cpu; dtype None: the backend's default."""
    run = evaluate_many(
        model,
        [QuantChoice(quant, group_size, bits, clip_search)],
        backend=backend,
        dtype=dtype,
        text=text,
        max_tokens=max_tokens,
        window=window,
    )
    return run.results[0]


def summarize_notes(notes: Sequence[str]) -> list[str]:
    """Per-matrix notes ("int4 g128: <path> stays unquantized: ...") counted per label."""
    counts: dict[str, int] = {}
    other = []
    for n in notes:
        label, _, rest = n.partition(": ")
        if "stays unquantized" in rest:
            counts[label] = counts.get(label, 0) + 1
        else:
            other.append(n)
    return other + [
        f"{label}: {k} matrices stay dense (their input size is not a multiple of the group)"
        for label, k in counts.items()
    ]


def format_table(results: Sequence[EvalResult]) -> str:
    """A plain-text (Markdown) table, one row per result."""
    head = "| quant | bytes/weight | perplexity | KL (nats) | top-1 agree | tokens |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r.quant} | {r.bytes_per_weight:.4f} | {r.perplexity:.3f} | {r.kl:.5f} | "
            f"{100 * r.top1:.2f}% | {r.n_tokens} |"
        )
    return "\n".join(lines)
