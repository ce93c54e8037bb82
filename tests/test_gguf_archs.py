"""GGUF architectures (llama, qwen2, qwen3) holding every supported block type, against
transformers' own GGUF loader (which dequantizes to fp32): logits and greedy tokens on both
CPU backends, the tokenizer and the chat template read from the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.convert import convert
from mlxrun.generate import generate_step
from mlxrun.gguf import read_gguf
from mlxrun.quant import gguf_blocks as gb
from mlxrun.sampling import SamplingParams
from mlxrun.weights import load_safetensors

from .conftest import hf_greedy, rel_err
from .test_gguf_blocks import random_rows

Q = gguf.GGMLQuantizationType
D = dict(hidden=256, heads=4, kv=2, head_dim=64, ff=512, layers=2)
# layer 0 laid out as llama.cpp's Q4_K_M lays out a layer; layer 1 takes every other type
LAYER_TYPES = [
    dict(
        attn_q="Q4_K",
        attn_k="Q5_K",
        attn_v="Q6_K",
        attn_output="Q5_0",
        ffn_gate="Q4_K",
        ffn_up="Q8_0",
        ffn_down="Q6_K",
    ),
    dict(
        attn_q="Q2_K",
        attn_k="Q3_K",
        attn_v="IQ4_XS",
        attn_output="IQ4_NL",
        ffn_gate="Q5_1",
        ffn_up="Q4_1",
        ffn_down="Q4_0",
    ),
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["the cat sat", "Hello, world! 123", "<|im_start|>user\nhi<|im_end|>"]


def byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: 256 byte symbols, three merges, three specials."""
    from mlxrun.gguf.tokenizer import _byte_chars

    tokens = [_byte_chars()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe"]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    return tokens, merges, types


def _add_tokenizer(w, pre: str, tokens, ttypes, merges) -> None:
    """The byte-level BPE vocabulary, its ids and the chat template, as llama.cpp writes them."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)


def blocks(kind: str, rows: int, n: int, rng, std: float = 0.08) -> np.ndarray:
    """Random `kind` blocks for a [rows, n] matrix, scaled so the weights have about `std`."""
    raw = random_rows(kind, rows, n // gb.BLOCKS[kind][1], int(rng.integers(1 << 30)), False)
    if kind == "MXFP4":
        return raw
    w = gb.dequantize(raw, kind)
    k = std / max(float(w.std()), 1e-12)
    nb = gb.BLOCKS[kind][0]
    r = raw.reshape(rows, -1, nb)
    from .test_gguf_blocks import F16_FIELDS

    for off in F16_FIELDS[kind]:
        d = r[..., off : off + 2].copy().view(np.float16).astype(np.float32) * k
        r[..., off : off + 2] = d.astype(np.float16).view(np.uint8)
    return r.reshape(rows, -1)


def write_model(path, arch: str, tied: bool) -> None:
    rng = np.random.default_rng(len(arch))
    # Qwen3's heads are wider than hidden/heads (transformers' GGUF loader assumes 128)
    hd = 128 if arch == "qwen3" else D["head_dim"]
    tokens, merges, types = byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(D["layers"])
    w.add_context_length(512)
    w.add_embedding_length(D["hidden"])
    w.add_feed_forward_length(D["ff"])
    w.add_head_count(D["heads"])
    w.add_head_count_kv(D["kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    _add_tokenizer(w, "qwen2" if arch != "llama" else "llama-bpe", tokens, types, merges)
    h, v = D["hidden"], len(tokens)
    w.add_tensor("token_embd.weight", blocks("Q8_0", v, h, rng, 0.5), raw_dtype=Q.Q8_0)
    shapes = dict(
        attn_q=(D["heads"] * hd, h),
        attn_k=(D["kv"] * hd, h),
        attn_v=(D["kv"] * hd, h),
        attn_output=(h, D["heads"] * hd),
        ffn_gate=(D["ff"], h),
        ffn_up=(D["ff"], h),
        ffn_down=(h, D["ff"]),
    )
    for i, lt in enumerate(LAYER_TYPES):
        for name, kind in lt.items():
            raw = blocks(kind, *shapes[name], rng)
            w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=Q[kind])
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                bias = (0.2 * rng.standard_normal(shapes[name][0])).astype(np.float32)
                w.add_tensor(f"blk.{i}.{name}.bias", bias)
        norms = ["attn_norm", "ffn_norm"] + (["attn_q_norm", "attn_k_norm"] * (arch == "qwen3"))
        for name in norms:
            n = hd if name.endswith("q_norm") or name.endswith("k_norm") else h
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.2 * rng.standard_normal(n)).astype("f4"))
    w.add_tensor("output_norm.weight", (1 + 0.2 * rng.standard_normal(h)).astype(np.float32))
    if not tied:
        w.add_tensor("output.weight", blocks("MXFP4", v, h, rng), raw_dtype=Q.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[("qwen2", True), ("qwen3", False), ("llama", False)])
def model_file(request, tmp_path_factory):
    """(path, transformers model loaded by its own GGUF loader in fp32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, tied = request.param
    d = tmp_path_factory.mktemp(f"gguf-{arch}")
    path = d / f"{arch}.gguf"
    write_model(path, arch, tied)
    hf = AutoModelForCausalLM.from_pretrained(
        str(d), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=path.name, local_files_only=True)
    return path, hf, tok


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_logits_and_greedy_match_transformers_gguf(model_file, backend):
    path, hf, _ = model_file
    ids = np.random.default_rng(2).integers(0, 259, size=20)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m = mlxrun.load(str(path), backend=backend, dtype="float32", progress=False)
    got = m.logits(ids)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 1e-4
    toks = [
        int(t[0])
        for t in generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=8)
    ]
    want = hf_greedy(hf, ids, 8)
    assert toks == want


def test_tokenizer_template_notes_and_convert(model_file, tmp_path):
    path, hf, tok = model_file
    g = read_gguf(path)
    assert g.tokenizer_config["chat_template"] == TEMPLATE
    m = mlxrun.load(str(path), backend="cpu", dtype="float32", progress=False)
    for text in TEXTS:
        assert m.tokenizer.encode(text) == tok.encode(text, add_special_tokens=True), text
    cfg = g.config
    assert cfg["model_type"] == path.stem
    assert cfg["head_dim"] == (128 if path.stem == "qwen3" else 64)
    assert cfg["tie_word_embeddings"] is (path.stem == "qwen2")
    q = cfg["quantization"]
    assert q["model.layers.0.self_attn.k_proj"]["bits"] == 5  # Q5_K
    assert q["model.layers.0.self_attn.v_proj"] is False  # Q6_K, expanded
    assert g.tensors["model.layers.0.self_attn.q_proj.scales"].dtype == "F32"  # Q4_K
    assert g.tensors["model.layers.0.self_attn.o_proj.scales"].dtype == "F16"  # Q5_0
    expanded = "Q2_K x1, Q3_K x1, Q6_K x2, IQ4_NL x1, IQ4_XS x1"
    if path.stem != "qwen2":
        expanded = expanded.replace("IQ4_XS x1", "IQ4_XS x1, MXFP4 x1")
    assert any(expanded in n for n in m.notes), m.notes
    assert any("Q4_K/Q5_K layers are kept packed" in n for n in m.notes), m.notes

    # convert writes the same tensors (K-quant fp32 scales included) and the same notes
    notes = convert(str(path), str(tmp_path / "out"), progress=False)
    assert notes[: len(g.notes)] == g.notes
    back, _ = load_safetensors(tmp_path / "out" / "model.safetensors")
    assert set(back) == set(g.tensors)
    for k, t in g.tensors.items():
        assert back[k].dtype == t.dtype, k
        np.testing.assert_array_equal(back[k].data, t.data, err_msg=k)
