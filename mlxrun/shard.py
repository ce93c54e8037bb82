"""Tensor parallelism's one load step: which slice of each checkpoint tensor a rank holds.

Megatron's split, as gpt-fast's tp.py and mlx-lm's shard_linear do it:

- q/k/v and gate/up are split by output rows (whole attention heads and KV heads per
  rank; their q/k/v biases with them), so each rank attends with its own heads and keeps
  only its KV heads in its cache;
- o and down are split by input columns: each rank's product is a partial sum of the
  full output, which the model adds across ranks with the backend's `all_sum` (two a
  layer);
- a mixture-of-experts layer splits every expert as the dense MLP is split: each rank
  holds all experts' slice of gate/up rows (moe_intermediate / ranks) and the matching
  columns of down, so its expert outputs are partial sums too, added by the same one
  `all_sum` (`Backend.moe_sum`); the router (and its bias) is replicated, so every rank
  picks the same experts; the experts' down bias is held by rank 0 (zeros on the others)
  so the sum adds it once; a shared expert (Qwen2-MoE) is split as the dense MLP, its
  sigmoid gate (a hidden -> 1 linear) replicated, and its partial output joins the
  experts' in that one sum;
- the embedding and the head are split by vocabulary rows (`vocab_shard`): a rank looks
  up the ids in its rows and the ranks sum the lookups, and it computes its slice of the
  logits, which the ranks all-gather; a vocabulary that does not divide is padded with
  zero rows, whose logits are cut after the gather. A vocabulary no larger than the
  hidden size stays replicated (see `vocab_shard`). The norms are replicated.

A packed (quantized) matrix is split along the same axes: rows are independent, and a
column split takes whole groups (weight words, scales and biases alike), so a rank's
shard quantizes and dequantizes exactly as the same columns of the whole matrix do.

Slices are numpy views of the memory-mapped files: a rank reads only its shard's bytes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .errors import MlxrunError
from .weights import Tensor

# checkpoint name -> the axis split across ranks: 0 = output rows, -1 = input columns
# (attention sinks are one logit per query head: split with the heads)
# (Qwen2-MoE's shared expert, mlp.shared_expert.*, is split as the dense MLP; its sigmoid
# gate, mlp.shared_expert_gate (1, hidden), is replicated)
_ROWS = re.compile(
    r"\.((self_attn\.[qkv]_proj|mlp\.(shared_expert\.)?(gate|up)_proj)\.(weight|scales|biases|bias)"
    r"|self_attn\.sinks)$"
)
_COLS = re.compile(
    r"\.(self_attn\.o_proj|mlp\.(shared_expert\.)?down_proj)\.(weight|scales|biases)$"
)
# Experts (mlxrun/moe.py), in each stored layout: (pattern, split axis)
_EXPERTS = tuple(
    (re.compile(p), axis)
    for p, axis in (
        # transformers' per-expert tensors: gate/up (I, H) by rows, down (H, I) by columns
        (r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.(weight|scales|biases|bias)$", 0),
        (r"\.experts\.\d+\.(down_proj|w2)\.(weight|scales|biases)$", -1),
        # mlx-lm's stacks: gate/up (E, I, H[/..]) and their biases (E, I), down (E, H, I)
        (r"\.(switch_mlp|experts)\.(gate|up)_proj\.(weight|scales|biases|bias)$", 1),
        (r"\.(switch_mlp|experts)\.down_proj\.(weight|scales|biases)$", -1),
        # gpt-oss as transformers stores it: gate_up_proj (E, H, 2I) and its bias (E, 2I)
        # hold gate and up interleaved along the last axis, so a contiguous piece of it is
        # the same rows of both; down_proj (E, I, H) is stored input first
        (r"\.experts\.gate_up_proj(_bias)?$", -1),
        (r"\.experts\.down_proj$", 1),
        # OpenAI's MXFP4 release: *_blocks (E, out, in/32, 16), *_scales (E, out, in/32)
        (r"\.experts\.gate_up_proj_(blocks|scales)$", 1),
        (r"\.experts\.down_proj_blocks$", -2),
        (r"\.experts\.down_proj_scales$", -1),
    )
)
# the experts' down biases (E, H): added once to the sum, so rank 0 holds them, the others
# zeros (in every layout: stacked, per expert, gpt-oss's fused)
_DOWN_BIAS = re.compile(r"\.(switch_mlp|experts)\.(\d+\.)?(down_proj|w2)(\.bias|_bias)$")
# split by vocabulary rows when `vocab_shard` says so (a stored tied lm_head with them)
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.(weight|scales|biases)$")


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of the embedding and the head: [start, start + rows) of the
    vocabulary padded to rows x ranks; rows past `vocab` are zeros and their logits are
    cut after the gather (never sampled)."""

    vocab: int  # the whole vocabulary (the logits' width after the gather)
    rows: int  # rows every rank holds
    start: int  # this rank's first row


def vocab_shard(cfg: ModelConfig, tp: int, rank: int) -> VocabShard | None:
    """Rank `rank`'s vocabulary rows when `tp` ranks split the embedding and head, None
    when they are replicated.

    The rule: split when the vocabulary is larger than the hidden size. Splitting costs two
    collectives a forward pass (a sum of the (B, T, hidden) lookups and a gather of the
    logits); a table of vocab <= hidden rows is no larger than one hidden x hidden
    projection, too little memory to pay for them. Every Llama-family vocabulary
    (32k-256k, against hidden sizes of 0.5k-16k) is split."""
    if tp == 1 or cfg.vocab_size <= cfg.hidden_size:
        return None
    # Rows are independent in every format (a packed row holds whole groups), so the
    # padding is to a multiple of the ranks only.
    rows = -(-cfg.vocab_size // tp)
    return VocabShard(cfg.vocab_size, rows, rank * rows)


def vocab_rows(name: str, data: np.ndarray, v: VocabShard) -> np.ndarray:
    """Rank's rows [v.start, v.start + v.rows) of `data` (the embedding or head, or its
    packed parts: rows first): a view of the memory map, or, where the rows run past the
    vocabulary, a copy of the rank's rows with zero rows after them."""
    if data.shape[0] != v.vocab:
        raise MlxrunError(
            f"tensor {name!r} has {data.shape[0]} rows but config.json's vocab_size is "
            f"{v.vocab}: the config and weights disagree"
        )
    part = data[v.start : v.start + v.rows]
    short = v.rows - part.shape[0]
    if not short:
        return part
    return np.concatenate([part, np.zeros((short, *data.shape[1:]), dtype=data.dtype)])


def is_down_bias(name: str) -> bool:
    """Whether `name` is the experts' down bias, which rank 0 alone holds (zeros on the
    others: the sum over the ranks adds it once)."""
    return _DOWN_BIAS.search(name) is not None


def split_axis(name: str) -> int | None:
    """The axis of tensor `name` split across ranks (0 rows, -1 columns; a stack of experts
    by its own axis: 1, -1 or -2), None: replicated."""
    if _ROWS.search(name):
        return 0
    if _COLS.search(name):
        return -1
    for pattern, axis in _EXPERTS:
        if pattern.search(name):
            return axis
    return None


def _inputs_split(name: str) -> bool:
    """Whether `name` is the packed scales of a layer split by input (o, down, the experts'
    down): a rank's columns must be whole groups of it."""
    if name.endswith("down_proj_scales"):  # OpenAI's MXFP4 down: split by groups (axis -1)
        return split_axis(name) == -1
    return name.endswith(".scales") and split_axis(name) == -1


def stored_groups(cfg: ModelConfig, names) -> set[int]:
    """Group sizes of the stored packed layers that are split by input (o and down): a
    rank's columns must be whole groups of them."""
    from mlxrun.quant.formats import layer_spec  # noqa: PLC0415

    out = set()
    for name in names:
        if name.endswith("_scales") and _inputs_split(name):
            out.add(32)  # MXFP4's group, whatever config.json's quantization_config says
        elif _inputs_split(name):
            spec = layer_spec(cfg.quantization or {}, name[: -len(".scales")])
            if spec is not None:
                out.add(spec.group_size)
    return out


def problems(cfg: ModelConfig, tp: int, groups: set[int]) -> list[str]:
    """What stops `cfg` splitting over `tp` ranks, as phrases (empty: it splits)."""
    c = cfg
    dims = [("attention heads", c.num_attention_heads), ("KV heads", c.num_key_value_heads)]
    inputs = [("o_proj", c.num_attention_heads // tp * c.head_dim)]
    if _dense_mlp(c):
        dims.append(("MLP rows (intermediate size)", c.intermediate_size))
        inputs.append(("down_proj", c.intermediate_size // tp))
    if c.moe is not None:
        dims.append(("expert rows (moe intermediate size)", c.moe.intermediate_size))
        inputs.append(("the experts' down_proj", c.moe.intermediate_size // tp))
        if c.moe.shared_intermediate_size:
            S = c.moe.shared_intermediate_size
            dims.append(("shared expert rows (shared_expert_intermediate_size)", S))
            inputs.append(("the shared expert's down_proj", S // tp))
    counts = [f"{n} {what}" for what, n in dims if n % tp]
    if counts:
        return [f"{_and(counts)} do not divide by {tp}"]
    why = []
    for g in sorted(groups):
        for what, n in inputs:
            if n % g:
                why.append(f"{what}'s {n} inputs a rank are not whole groups of {g}")
    return why


def _dense_mlp(c: ModelConfig) -> bool:
    """Whether some layer runs the dense MLP (a MoE config's intermediate_size may name only
    its experts' size, or dense layers it does not have)."""
    return c.moe is None or not all(c.moe.is_moe(i) for i in range(c.num_hidden_layers))


def _and(xs: list[str]) -> str:
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def working_counts(cfg: ModelConfig, groups: set[int], upto: int | None = None) -> list[int]:
    """Every rank count from 1 to `upto` (default: the KV head count) that splits `cfg`."""
    upto = upto or cfg.num_key_value_heads
    return [n for n in range(1, upto + 1) if not problems(cfg, n, groups)]


def check(cfg: ModelConfig, tp: int, groups: set[int]) -> None:
    """Raise MlxrunError, naming the counts that work, when `tp` ranks cannot split `cfg`."""
    if tp < 1:
        raise MlxrunError(f"--tp must be at least 1, got {tp}")
    why = problems(cfg, tp, groups)
    if why:
        ok = ", ".join(
            str(n) for n in working_counts(cfg, groups, max(tp, cfg.num_key_value_heads))
        )
        raise MlxrunError(
            f"cannot split this model over {tp} ranks (each takes whole heads, KV heads and "
            f"quantization groups): {'; '.join(why)}; rank counts that work: {ok}"
            + (" (or pick a --group-size that divides them)" if "groups of" in why[-1] else "")
        )


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's model is built with: its heads, KV heads, MLP rows and every
    expert's rows (the shared expert's too)."""
    if tp == 1:
        return cfg
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // tp,
            shared_intermediate_size=moe.shared_intermediate_size // tp,
        )
    return cfg.replace(
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=cfg.num_key_value_heads // tp,
        intermediate_size=cfg.intermediate_size // tp,
        head_dim=cfg.head_dim,  # explicit: hidden / heads no longer gives it
        moe=moe,
    )


def piece(n: int, tp: int, rank: int, name: str) -> slice:
    """Rank `rank`'s equal part of a dimension of n (tensor `name`, for the error)."""
    if n % tp:
        raise MlxrunError(f"tensor {name!r}: dimension {n} does not split over {tp} ranks")
    step = n // tp
    return slice(rank * step, (rank + 1) * step)


def take(data: np.ndarray, axis: int, tp: int, rank: int, name: str) -> np.ndarray:
    """Rank `rank`'s equal part of `data` along `axis` (a view)."""
    ax = axis % data.ndim
    return data[(slice(None),) * ax + (piece(data.shape[ax], tp, rank, name),)]


def shard_tensors(
    tensors: dict[str, Tensor], tp: int, rank: int, vocab: VocabShard | None = None
) -> dict[str, Tensor]:
    """Rank `rank`'s slices of every tensor (views, nothing read; `vocab_rows` copies
    the last rank's padded rows, and ranks past 0 hold zeros for the experts' down bias);
    others shared as is. `vocab`: the embedding and head's split (`vocab_shard`), None to
    keep them whole."""
    if tp == 1:
        return tensors
    out = {}
    for name, t in tensors.items():
        axis = split_axis(name)
        if vocab is not None and _VOCAB.match(name):
            out[name] = Tensor(t.dtype, vocab_rows(name, t.data, vocab))
        elif is_down_bias(name):
            out[name] = t if rank == 0 else Tensor(t.dtype, np.zeros(t.shape, t.data.dtype))
        elif axis is None:
            out[name] = t
        else:
            out[name] = Tensor(t.dtype, take(t.data, axis, tp, rank, name))
    return out


def shard_shapes(shapes: dict, tp: int, cfg: ModelConfig) -> dict:
    """{name: (shape, dtype)} as one rank holds them (for memory plans); `cfg`: the whole
    model's config (whether its embedding and head split by vocabulary)."""
    vocab = vocab_shard(cfg, tp, 0)
    out = {}
    for name, (shape, dtype) in shapes.items():
        axis = split_axis(name)
        if vocab is not None and _VOCAB.match(name):
            shape = (vocab.rows, *shape[1:])
        elif axis is not None and tp > 1:
            shape = list(shape)
            shape[axis] //= tp
            shape = tuple(shape)
        out[name] = (shape, dtype)
    return out
