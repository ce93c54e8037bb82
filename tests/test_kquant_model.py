"""GGUF files of K-quant blocks through the loader and the model: kept packed as stored,
run packed on the CUDA code path (the Triton kernels, under TRITON_INTERPRET=1 here), the
bench's Q4_K_M-shaped model, the planner's bytes. The kernels alone: test_triton_kquant.py.
"""

import numpy as np

from ._kquant import DEV, HAS_CUDA, LONG_ON_CPU, gguf, kq, tk, torch


def _write_kquant_llama(path, rng) -> None:
    """A one-layer llama GGUF laid out as Q4_K_M lays out a model: Q4_K embedding and
    matrices, Q6_K v/down/head, one Q5_K matrix, and a Q5_0 one (llama.cpp's fallback for
    rows that are not whole super-blocks)."""
    from tests.test_gguf_archs import blocks, byte_vocab

    tokens, merges, types = byte_vocab()
    h, ff, heads, kv, hd = 256, 512, 4, 2, 64
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [("block_count", 1), ("context_length", 256), ("embedding_length", h),
                   ("feed_forward_length", ff), ("head_count", heads), ("head_count_kv", kv),
                   ("rope_freq_base", 1e4), ("layer_norm_rms_eps", 1e-6)]:  # fmt: skip
        getattr(w, f"add_{add}")(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    Q = gguf.GGMLQuantizationType
    v = len(tokens)
    mats = dict(
        attn_q=((heads * hd, h), "Q4_K"),
        attn_k=((kv * hd, h), "Q5_K"),
        attn_v=((kv * hd, h), "Q6_K"),
        attn_output=((h, heads * hd), "Q5_0"),
        ffn_gate=((ff, h), "Q4_K"),
        ffn_up=((ff, h), "Q4_K"),
        ffn_down=((h, ff), "Q6_K"),
    )
    w.add_tensor("token_embd.weight", blocks("Q4_K", v, h, rng, 0.5), raw_dtype=Q.Q4_K)
    for name, (shape, kind) in mats.items():
        w.add_tensor(f"blk.0.{name}.weight", blocks(kind, *shape, rng), raw_dtype=Q[kind])
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", (1 + 0.2 * rng.standard_normal(h)).astype("f4"))
    w.add_tensor("output_norm.weight", (1 + 0.2 * rng.standard_normal(h)).astype("f4"))
    w.add_tensor("output.weight", blocks("Q6_K", v, h, rng), raw_dtype=Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _both_paths(path):
    """The model of a GGUF on the dequantizing path and on the CUDA code path (Triton
    kernels on, K-quants kept as blocks; the interpreter here)."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.loader import open_checkpoint

    models = []
    for kernels in (False, True):
        # the reference dequantizes on the CPU: on a GPU, CUDA refuses the stored int5 layers
        # its kernels do not take (the kernels' path widens them)
        be = TorchBackend(DEV if kernels else "cpu", "float32")
        be.triton_kernels = kernels
        be.gguf_blocks = tuple(kq.KINDS) if kernels else ()
        be.cuda_graphs = False
        ckpt = open_checkpoint(str(path), keep=be.gguf_blocks)
        models.append(build_model(ckpt.config, ckpt.tensors, be, progress=False)[0])
    return models


def test_gguf_kquants_load_as_stored(tmp_path):
    """A Q4_K_M-laid-out GGUF on the CUDA code path: every K-quant matrix, embedding and
    head included, is held as the kernels' layout of its blocks (no affine or dense copy),
    equal to the dequantizing path's weights (those match transformers' GGUF loader,
    test_gguf_archs), and the embedding's rows come out as its rows."""
    path = tmp_path / "q4km.gguf"
    _write_kquant_llama(path, np.random.default_rng(0))
    ref, m = _both_paths(path)
    L, R = m.layers[0], ref.layers[0]
    names = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    pairs = [(m.embed, ref.embed), (m.head, ref.head)]
    pairs += [(getattr(L, n), getattr(R, n)) for n in names]
    for w, r in pairs:
        assert isinstance(w.kernel, kq.KQLinear) and w.weight is None
        dense = r if isinstance(r, torch.Tensor) else ref.be.dequantize(r)
        assert torch.equal(kq.dequantize_kquant(w.kernel).cpu(), dense.float().cpu())
    kinds = [L.q_proj, L.k_proj, L.v_proj, L.down_proj, m.head, m.embed]
    assert [w.kernel.kind for w in kinds] == ["Q4_K", "Q5_K", "Q6_K", "Q6_K", "Q6_K", "Q4_K"]
    ids = m.be.ids(np.array([[3, 258, 7]]))
    assert torch.equal(m.be.embedding(ids, m.embed), ref.be.embedding(ids, ref.embed))
    # Q5_0 (affine 5-bit) runs on the 8-bit kernels, widened exactly
    o = L.o_proj.kernel
    assert (o.mode, o.bits, o.group_size) == ("affine", 8, 32)
    assert torch.equal(tk.dequantize_torch(o), ref.be.dequantize(R.o_proj))


@LONG_ON_CPU
def test_gguf_kquants_run_packed_on_the_cuda_code_path(tmp_path):
    """The same file's logits (prefill of 8: the GEMM) and greedy tokens (decode: the
    GEMV) on the CUDA code path equal the dequantizing path's (~1 min on 2 cores under
    the interpreter: pytest -m long)."""
    from mlxrun.generate import generate_step
    from mlxrun.sampling import SamplingParams
    from tests.conftest import rel_err

    path = tmp_path / "q4km.gguf"
    _write_kquant_llama(path, np.random.default_rng(0))
    models = _both_paths(path)
    ids = np.random.default_rng(1).integers(0, 259, size=(1, 8))
    logits = [mm.be.to_numpy(mm(mm.be.ids(ids), mm.make_cache(1, 12))) for mm in models]
    assert rel_err(logits[1], logits[0]) < (2e-3 if HAS_CUDA else 1e-5)
    greedy = [
        [int(t[0]) for t in generate_step(mm, [ids[0].tolist()], SamplingParams(), 3)]
        for mm in models
    ]
    assert greedy[1] == greedy[0]


def test_bench_q4_k_m_shape_model():
    """`bench --quant q4_k_m` on a shape: model: random blocks of the types llama.cpp's
    Q4_K_M gives each matrix (Q6_K head, attn_v / ffn_down where use_more_bits holds: 2 of
    4 layers here), held in the kernels' layout at their bits a weight; other backends and
    checkpoints are skipped with the reason."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.bench import KQuantMix, _mix_skip, _Source, build_random, weight_bytes
    from mlxrun.config import ModelConfig

    cfg = ModelConfig.from_dict(
        dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             tie_word_embeddings=False)
    )  # fmt: skip
    be = TorchBackend(DEV, "float32")
    be.triton_kernels, be.gguf_blocks, be.cuda_graphs = True, tuple(kq.KINDS), False
    m = build_random(cfg, be, KQuantMix("q4_k_m"))
    kinds = [[w.kernel.kind for w in (L.q_proj, L.v_proj, L.down_proj)] for L in m.layers]
    # use_more_bits(i, 4): i < 4 // 8, i >= 7 * 4 // 8 or (i - 4 // 8) % 3 == 2
    assert kinds == [["Q4_K", "Q4_K", "Q4_K"]] * 2 + [["Q4_K", "Q6_K", "Q6_K"]] * 2
    assert (m.embed.kernel.kind, m.head.kernel.kind) == ("Q4_K", "Q6_K")
    w = kq.dequantize_kquant(m.layers[0].q_proj.kernel)
    assert torch.isfinite(w).all() and 0.005 < w.std() < 0.1  # weights of a usable size
    held, read = weight_bytes(m)
    bits = {"Q4_K": 4.625, "Q6_K": 6.5625}
    n_q6 = 2 * 128 * 256 + 2 * 256 * 512 + 512 * 256  # v (128 rows), down, head
    n_all = 4 * (256 * 256 * 2 + 128 * 256 * 2 + 3 * 256 * 512) + 2 * 512 * 256
    want = (bits["Q6_K"] * n_q6 + bits["Q4_K"] * (n_all - n_q6)) / 8 + (2 * 4 + 1) * 256 * 4
    assert held == want
    cpu = TorchBackend("cpu", "float32")
    shape = _Source("shape:x", True, cfg, "", None)
    assert "cuda" in _mix_skip(shape, cpu, KQuantMix("q4_k_m"))
    assert "shape:" in _mix_skip(_Source("a.gguf", False, cfg, "", None), be, KQuantMix("q6_k"))


def test_planner_counts_kept_blocks_as_held(tmp_path):
    """The memory planner counts a K-quant matrix kept as stored at the kernels' bytes
    (4.625 / 5.625 / 6.5625 bits a weight), not as the affine or dense copy the other
    backends hold."""
    from mlxrun.api import _planned
    from mlxrun.loader import open_checkpoint
    from mlxrun.planning import plan_shapes

    path = tmp_path / "q4km.gguf"
    _write_kquant_llama(path, np.random.default_rng(0))
    plain, kept = (open_checkpoint(str(path), keep=k) for k in ((), tuple(kq.KINDS)))
    blocks = {n: t for n, t in kept.tensors.items() if t.block is not None}
    assert len(blocks) == 8  # embedding, head, six of the seven matrices (o is Q5_0)

    def weights(ckpt):
        shapes = {n: _planned(t) for n, t in ckpt.tensors.items()}
        return plan_shapes(ckpt.config, shapes, None, "cpu", "float32", 64, 1).footprint

    held = sum(int(_planned(t)[0][0] * _planned(t)[0][1] * bits / 8) for t, bits in (
        (t, {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}[t.block]) for t in blocks.values()
    ))  # fmt: skip
    other = 0  # what the dequantizing path holds for the same matrices
    for name in blocks:
        module = name.rsplit(".", 1)[0]
        parts = [plain.tensors[f"{module}.{p}"] for p in ("weight", "scales", "biases")
                 if f"{module}.{p}" in plain.tensors]  # fmt: skip
        other += sum(p.nbytes for p in parts)  # F32 dense (Q6_K) or U32 + F32 scales/biases
    got, base = weights(kept), weights(plain)
    assert got.weight_bytes == base.weight_bytes - other + held
    assert got.n_params == base.n_params
