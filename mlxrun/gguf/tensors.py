"""GGUF tensors -> Hugging Face-named tensors in the canonical format (DESIGN.md).

Block types with an exact affine form (`quant.gguf_blocks.AFFINE`: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 with fp16 scales; Q4_K, Q5_K with fp32 scales) become packed affine layers with groups
of 32. The other block types have no packed kernel in mlxrun yet: they are dequantized at
import to float32, exactly (`gguf_blocks.dequantize`), and `notes` says so with the bytes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MlxrunError
from ..quant import gguf_blocks as gb
from ..weights import Tensor
from .names import Arch, hf_name, unpermute_index

DENSE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = DENSE_TYPES + gb.TYPES
GROUP = 32  # weights per affine group of every exact GGUF map


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_types(path: Path, tensors) -> None:
    """MlxrunError at the first tensor of a type mlxrun cannot read, naming the supported."""
    for t in tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise MlxrunError(
                f"{path}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which mlxrun "
                f"does not read; it reads {', '.join(SUPPORTED_TYPES)}"
            )


def _pick(
    name: str,
    data: np.ndarray,
    perm: np.ndarray | None,
    shard,
    unit: int,
    vocab=None,
    lead: tuple[int, ...] = (),
    block: tuple[str, int] = ("", 1),
) -> tuple[np.ndarray, np.ndarray | None]:
    """A rank's rows (through the un-permutation `perm`, then consumed) or its columns of
    `data`, before anything is unpacked; `unit`: columns of `data` per block of values.
    `vocab` (a shard.VocabShard): the embedding's and head's rows are the rank's vocabulary
    rows, padded with zero bytes (every block type decodes them to zeros).
    Stacked experts (`lead` = (E,)) come as their E*out rows of blocks [E*out, row bytes]
    (or dense (E, out, in)): gate/up take rows [r*out/N, (r+1)*out/N) of every expert (a
    copy of the rank's rows), down its columns; their down bias is rank 0's (zeros on the
    others, so the sum over the ranks adds it once). `block`: (GGUF type, values a block),
    for the error when a rank's columns would cut a block."""
    from ..shard import is_down_bias, piece, split_axis, take, vocab_rows  # noqa: PLC0415

    if vocab is not None and name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_rows(name, data, vocab), perm
    if shard is not None and is_down_bias(name):
        return (data if shard[1] == 0 else np.zeros_like(data)), perm
    axis = None if shard is None else split_axis(name)
    if axis is None:
        return data, perm
    tp, rank = shard
    if axis == 1 and lead and data.ndim == 2 and unit > 1:  # blocks: (E*out, bytes)
        rows = take(data.reshape(*lead, -1, data.shape[-1]), 1, tp, rank, name)
        return rows.reshape(-1, data.shape[-1]), perm
    if axis not in (0, -1):  # a dense stack of experts (E, out, in), or its biases (E, out)
        return take(data, axis, tp, rank, name), perm
    if axis == 0:
        rows = np.arange(data.shape[0]) if perm is None else perm
        return data[rows[piece(len(rows), tp, rank, name)]], None
    blocks = data.shape[-1] // unit
    if blocks % tp:
        kind, per = block
        raise MlxrunError(
            f"{name}: its {blocks * per} inputs are stored in GGUF {kind} blocks of {per} "
            f"values, and {blocks * per} / {tp} ranks = {blocks * per / tp:g} inputs a rank "
            f"is not whole blocks; split it over a rank count that gives multiples of {per} "
            "inputs, or convert the model (mlxrun convert --quant ...) first"
        )
    p = piece(blocks, tp, rank, name)
    return data[..., p.start * unit : p.stop * unit], perm


def _block_bytes(t) -> int:
    import gguf  # noqa: PLC0415

    return gguf.GGML_QUANT_SIZES[t.tensor_type][1]


def _block(t) -> tuple[str, int]:
    """(GGUF type name, values a block) of tensor t."""
    import gguf  # noqa: PLC0415

    return t.tensor_type.name, gguf.GGML_QUANT_SIZES[t.tensor_type][0]


def convert(
    path: Path,
    raw: dict,
    cfg: dict,
    arch: Arch,
    shard: tuple[int, int] | None = None,
    keep: tuple[str, ...] = (),
    vocab=None,
) -> tuple[dict[str, Tensor], dict, list[str]]:
    """(HF tensors, {quantized module: bits or None when dense}, notes for the user).

    shard: (ranks, rank): only that rank's slice of each split tensor (mlxrun.shard), taken
    from the file's blocks before they are unpacked; `vocab` (a shard.VocabShard): the
    embedding's and head's rows when they are split by vocabulary.
    keep: block types a backend reads as stored (its `gguf_blocks`): a 2-D tensor of one
    comes back as its raw blocks, `Tensor("U8", rows, block=type)` [out, row bytes], rows
    un-permuted where llama's q/k are (unsharded only)."""
    out: dict[str, Tensor] = {}
    bits: dict[str, int | str | None] = {}
    relaid: Counter = Counter()  # K-quants kept packed with fp32 scales: (stored, held) bytes
    expanded: dict[str, list[int]] = {}  # type -> [tensors, stored bytes, float32 bytes]
    for name, t in raw.items():
        if name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        hf = hf_name(path, arch, name)
        kind = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF shapes are [in, out]
        if hf.endswith(".shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # llama.cpp keeps this (1, hidden) linear as a vector
        # stacked experts (E, out, in): unpacked as E*out rows, then given their E axis
        lead = shape[:-2] if len(shape) == 3 else ()
        perm = None
        if arch.permute_qk and name.endswith((".attn_q.weight", ".attn_k.weight")):
            n = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            perm = unpermute_index(shape[0], n)
        module = hf.rsplit(".", 1)[0]
        if kind in keep and shard is None and len(t.shape) == 2:
            data = np.asarray(t.data).reshape(shape[0], -1)
            out[hf] = Tensor("U8", data if perm is None else data[perm], block=kind)
            bits[module] = None
            relaid[kind, "kept"] += int(t.n_bytes)
            continue
        if kind == "MXFP4" and lead:  # experts (gpt-oss): MLX's mxfp4, the same bytes re-laid
            data = np.asarray(t.data).reshape(-1, t.data.shape[-1])
            data, _ = _pick(hf, data, None, shard, _block_bytes(t), None, lead, _block(t))
            w, scales = gb.mxfp4_to_mlx(data)
            out[hf] = Tensor("U32", w.reshape(*lead, -1, w.shape[-1]))
            out[f"{module}.scales"] = Tensor("U8", scales.reshape(*lead, -1, scales.shape[-1]))
            bits[module] = "mxfp4"
            continue
        if kind in gb.AFFINE:
            data = np.asarray(t.data).reshape(-1, t.data.shape[-1])
            data, perm = _pick(hf, data, perm, shard, _block_bytes(t), vocab, lead, _block(t))
            w, scales, biases = gb.to_affine(data, kind)
            if perm is not None:
                w, scales, biases = w[perm], scales[perm], biases[perm]
            if lead:
                w, scales, biases = (a.reshape(*lead, -1, a.shape[-1]) for a in (w, scales, biases))
            sdt = gb.AFFINE[kind][1]
            out[hf] = Tensor("U32", w)
            out[f"{module}.scales"] = Tensor(sdt, scales)
            out[f"{module}.biases"] = Tensor(sdt, biases)
            bits[module] = gb.AFFINE[kind][0]
            if sdt == "F32":
                relaid[kind, "file"] += int(t.n_bytes)
                relaid[kind, "held"] += w.nbytes + scales.nbytes + biases.nbytes
            continue
        picked = kind in gb.BLOCKS
        if picked:
            data = np.asarray(t.data).reshape(-1, t.data.shape[-1])
            data, perm = _pick(hf, data, perm, shard, _block_bytes(t), vocab, lead, _block(t))
            shape = (data.shape[0], shape[-1] * data.shape[1] // t.data.shape[-1])
            data = gb.dequantize(data, kind)
            e = expanded.setdefault(kind, [0, 0, 0])
            e[0], e[1], e[2] = e[0] + 1, e[1] + int(t.n_bytes), e[2] + data.nbytes
            kind = "F32"
        else:
            data = np.asarray(t.data)
            if kind == "BF16":
                data = data.view(np.uint16)  # the reader maps BF16 as raw bytes [rows, 2*cols]
            if arch.norm_shift and hf.endswith("norm.weight"):  # stored as 1 + w (Gemma)
                f32 = Tensor(kind, data).float32() if kind != "F32" else data
                data, kind = f32.astype(np.float32) - np.float32(arch.norm_shift), "F32"
        data = data.reshape(shape if not (picked and lead) else (*lead, -1, shape[-1]))
        if not picked:
            data, perm = _pick(hf, data, perm, shard, 1, vocab, lead)
        if perm is not None:
            data = data[perm]
        out[hf] = Tensor(kind, data)
        if data.ndim in (2, 3) and hf.endswith(".weight"):  # not gpt-oss's (E, out) biases
            bits[module] = None
    return out, bits, _notes(relaid, expanded)


def _notes(relaid: Counter, expanded: dict[str, list[int]]) -> list[str]:
    notes = []
    kept = sorted({k for k, w in relaid if w == "kept"})
    if kept:
        notes.append(
            f"GGUF {'/'.join(kept)} layers are read as stored by the K-quant kernels "
            f"({_mib(sum(relaid[k, 'kept'] for k in kept))} in the file)"
        )
    kinds = sorted({k for k, w in relaid if w != "kept"})
    if kinds:
        file, held = (sum(relaid[k, w] for k in kinds) for w in ("file", "held"))
        notes.append(
            f"GGUF {'/'.join(kinds)} layers are kept packed as affine groups of 32 with "
            f"float32 scales and biases, exact (MLX in a 16-bit dtype rounds "
            f"them to it): {_mib(file)} in the file, {_mib(held)} held"
        )
    if expanded:
        n = sum(e[0] for e in expanded.values())
        file = sum(e[1] for e in expanded.values())
        dense = sum(e[2] for e in expanded.values())
        types = ", ".join(f"{k} x{expanded[k][0]}" for k in gb.TYPES if k in expanded)
        notes.append(
            f"GGUF: {n} tensor(s) ({types}) have no packed kernel in mlxrun yet and are "
            f"dequantized at load: {_mib(file)} in the file, {_mib(dense)} as float32 "
            "before the model's dtype"
        )
    return notes


def quant_block(bits: dict[str, int | str | None]) -> dict | None:
    """config.json "quantization": the predominant format, per-module overrides for the rest
    (bits of an affine layer, or "mxfp4")."""
    counts = Counter(b for b in bits.values() if b is not None)
    if not counts:
        return None

    def spec(b) -> dict[str, Any]:
        if b == "mxfp4":
            return {"group_size": GROUP, "bits": 4, "mode": "mxfp4"}
        return {"group_size": GROUP, "bits": b, "mode": "affine"}

    main = counts.most_common(1)[0][0]
    q: dict[str, Any] = spec(main)
    for module, b in bits.items():
        if b is None:
            q[module] = False
        elif b != main:
            q[module] = spec(b)
    return q
