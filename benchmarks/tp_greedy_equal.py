"""Greedy tokens of a model split over a launcher's ranks against the same model in one
process: a random Llama-shaped checkpoint (written once with transformers into DIR), 64
tokens in bfloat16 on CUDA (or float32 on the CPU).

    python benchmarks/tp_greedy_equal.py --make DIR            # the checkpoint
    python benchmarks/tp_greedy_equal.py --make --moe DIR      # or a Qwen3-MoE one
    python benchmarks/tp_greedy_equal.py DIR                   # one process
    torchrun --nproc-per-node 2 benchmarks/tp_greedy_equal.py DIR
    # a real model (SmolLM2 splits over 3 ranks), its answer to a chat message:
    torchrun --nproc-per-node 3 benchmarks/tp_greedy_equal.py SmolLM2.gguf --prompt "..."

A random model's top logits are close together (bf16 rounds them into ties), so its
greedy tokens part at the first difference in the last bits of a sum; a trained model's are far apart, which is what the comparison is for.

Rank 0 prints one JSON line with the token ids; the two lines must be equal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlxrun
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams


def make(path: Path, moe: bool = False) -> None:
    import torch  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    shape = dict(
        hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
        vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_theta=500000.0,
    )  # fmt: skip
    if moe:  # 16 experts of 512 rows, 4 a token: every expert split over 2 or 4 ranks
        cfg = Qwen3MoeConfig(**shape, head_dim=64, intermediate_size=2816, num_experts=16,
                             num_experts_per_tok=4, moe_intermediate_size=512,
                             norm_topk_prob=True)  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, intermediate_size=2816))
    cfg = model.config
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (path / "tokenizer.json").write_text(tok.to_str())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--make", action="store_true")
    ap.add_argument(
        "--moe", action="store_true", help="with --make: a Qwen3-MoE checkpoint instead of Llama"
    )
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument(
        "--prompt", default=None, help="a user message through the chat template (real models)"
    )
    a = ap.parse_args()
    if a.make:
        make(a.dir, a.moe)
        return
    dtype = a.dtype or ("bfloat16" if a.backend == "cuda" else "float32")
    m = mlxrun.load(str(a.dir), backend=a.backend, dtype=dtype, progress=False)
    if a.prompt is None:
        prompt = [[1, 17, 400, 2048, 9, 77, 3000, 5]]
    else:
        text = m.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
        prompt = [m.tokenizer.encode(text, add_special_tokens=False)]
    toks = [int(t[0]) for t in generate_step(m.transformer, prompt, SamplingParams(), a.tokens)]
    group = m.transformer.be.group
    if group is None or group.rank == 0:
        row = {"tp": 1 if group is None else group.size, "tokens": toks}
        if a.prompt is not None:
            row["text"] = m.tokenizer.decode(toks)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
