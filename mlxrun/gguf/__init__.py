"""Import a GGUF file (llama.cpp) as a Hugging Face-layout checkpoint.

`read_gguf` memory-maps the file and returns the config.json, the tensors under HF names, and
a tokenizer.json rebuilt from the GGUF metadata; `mlxrun.convert` writes them as a directory
that the safetensors loader (and mlx-lm) reads.

- `meta`: opening the file, metadata keys -> config.json (per-architecture prefixes)
- `names`: the architectures read (llama incl. Mistral, qwen2, qwen3, gemma3, and the
  mixture-of-experts qwen3moe, qwen2moe, gpt-oss and Mixtral's llama) and their tensor
  names
- `tensors`: block types -> canonical packed layers where exact, else dense (with a note)
- `tokenizer`: tokenizer.json, tokenizer_config (chat template) and generation_config
Block numerics live in `mlxrun.quant.gguf_blocks`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MlxrunError
from ..weights import Tensor
from .meta import Meta, check_keys, config, open_reader
from .names import arch_of
from .tensors import SUPPORTED_TYPES, check_types, convert, quant_block
from .tokenizer import tokenizer

__all__ = ["SUPPORTED_TYPES", "GGUFModel", "read_gguf"]


@dataclass
class GGUFModel:
    """What a GGUF file holds, in Hugging Face terms (see `read_gguf`)."""

    config: dict
    tensors: dict[str, Tensor]
    tokenizer_json: str
    tokenizer_config: dict
    generation_config: dict
    notes: list[str] = field(default_factory=list)  # what the import changed, for the user


def read_gguf(
    path: str | os.PathLike, shard: tuple[int, int] | None = None, keep: tuple[str, ...] = ()
) -> GGUFModel:
    """Read a GGUF: HF config, tensors (memory-mapped where dense), tokenizer.

    Quantized linears `p` come back as `p.weight` uint32 [out, in*bits/32], `p.scales` and
    `p.biases` [out, in/32] (F16, or F32 for Q4_K/Q5_K); dense tensors keep their GGUF dtype
    (F32, F16, BF16) and are views of the file, except llama q/k projections whose rows are
    un-permuted (a copy) and block types without a packed form (dequantized to F32).

    shard: (ranks, rank): only that rank's slice of each split tensor (mlxrun.shard) is
    read and unpacked; the config stays the whole model's.
    keep: block types the caller's backend reads as stored (Backend.gguf_blocks): their
    matrices stay raw blocks (`Tensor.block`), see `tensors.convert`.
    """
    path = Path(path)
    reader = open_reader(path)
    meta = Meta(reader, path)
    name = meta.get("general.architecture")
    experts = meta.get(f"{name}.expert_count", 0)
    arch = arch_of(path, name, experts)
    if experts and arch.norm_topk is None:
        raise MlxrunError(
            f"{path}: mixture-of-experts {name} GGUFs are not supported (mlxrun reads "
            "qwen3moe, qwen2moe, gpt-oss and llama (Mixtral) ones); use a dense model"
        )
    check_keys(path, meta, name, arch.reads)
    raw = {t.name: t for t in reader.tensors}
    check_types(path, reader.tensors)
    cfg = config(path, meta, raw, name, arch)
    vocab = None
    if shard is not None:  # a rank's columns are whole blocks of 32 (or 256) values
        from ..config import ModelConfig  # noqa: PLC0415
        from ..shard import check, vocab_shard  # noqa: PLC0415

        check(ModelConfig.from_dict(cfg), shard[0], {32})
        vocab = vocab_shard(ModelConfig.from_dict(cfg), *shard)
    tensors, bits, notes = convert(path, raw, cfg, arch, shard, keep, vocab)
    quant = quant_block(bits)
    if quant:
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant
    tok_json, tok_config, gen = tokenizer(path, meta, cfg)
    return GGUFModel(cfg, tensors, tok_json, tok_config, gen, notes)
