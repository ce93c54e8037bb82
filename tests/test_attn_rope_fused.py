"""Decode attention doing rope_qkv's work itself (cuda_attention.decode_attention with a
RopeStep): the output and the caches bit for bit those of rope_qkv then decode_attention,
for keys over several splits, GQA groups, batches, a slot cache's rows with a ring that
wraps, a cache view from a later key (StaticCache's eager decode), int8/fp8 caches, sinks.

Shared set-up: tests/_kernels.py (the interpreter without a GPU).
"""

import dataclasses

import numpy as np
import pytest

from ._kernels import DEV, torch


def _caches(g, quant, R, NKV, S, D, dtype):
    from mlxrun.backends.torch_kv import QuantKV

    if quant is None:
        return [torch.randn(R, NKV, S, D, generator=g).to(dtype).to(DEV) for _ in range(2)]
    out = []
    for _ in range(2):
        if quant == "int8":
            codes = torch.randint(-127, 128, (R, NKV, S, D), generator=g, dtype=torch.int8)
        else:  # E4M3 bytes, NaN codes left out
            codes = torch.randint(0, 126, (R, NKV, S, D), generator=g, dtype=torch.uint8)
        scales = torch.rand(R, NKV, S, generator=g) * 0.02
        out.append(QuantKV(codes.to(DEV), scales.to(DEV), quant))
    return out


def _clone(c):
    from mlxrun.backends.torch_kv import QuantKV

    if isinstance(c, QuantKV):
        return QuantKV(c.codes.clone(), c.scales.clone(), c.kind)
    return c.clone()


def _view(c, key0):
    """The cache from key key0 on (as StaticCache.slots hands rope_qkv in eager decode)."""
    from mlxrun.backends.torch_kv import QuantKV

    if isinstance(c, QuantKV):
        return QuantKV(c.codes[:, :, key0:], c.scales[:, :, key0:], c.kind)
    return c[:, :, key0:]


def _same(a, b):
    from mlxrun.backends.torch_kv import QuantKV

    if isinstance(a, QuantKV):
        return torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CASES = [
    # dtype, B, NH, NKV, S, slots (one a batch row, or one for all), rows, key0, quant, sinks
    (torch.float32, 1, 4, 2, 80, [37], None, 0, None, False),
    (torch.bfloat16, 2, 8, 2, 80, [0], None, 37, None, False),  # a view from key 37
    (torch.bfloat16, 3, 4, 1, 64, [70, 5, 63], [2, 0, 3], 0, None, True),  # 70 wraps: ring
    (torch.bfloat16, 2, 4, 2, 96, [40, 95], [1, 0], 0, "int8", False),
    (torch.bfloat16, 1, 6, 2, 96, [50], None, 0, "fp8", True),  # groups of 3 (GP 16)
    # positions past the original context (30000 + slot) under a table scaled by 1/8
    (torch.bfloat16, 2, 4, 4, 48, [47], None, 0, None, False),
]


# the launch's variants of the fused path: the default (the first key block loaded before the
# PDL wait and the new key patched in, for a plain cache; a quantized one reads it back; the
# combine's stats and partials loaded together), and neither
VARIANTS = {"": {}, "old": dict(early_kv=False, combine_once=False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("dtype", "B", "NH", "NKV", "S", "slots", "rows", "key0", "quant",
                          "sinks"), CASES)  # fmt: skip
def test_fused_rope_attention_equals_rope_then_attention(dtype, B, NH, NKV, S, slots, rows,
                                                         key0, quant, sinks, variant,
                                                         monkeypatch):  # fmt: skip
    from mlxrun.backends import cuda_attention
    from mlxrun.backends.torch_kv import RopeStep

    D = 32
    g = torch.Generator().manual_seed(B * 100 + S)
    R = 4 if rows is not None else B
    # q, k, v as the model passes them: (B, H, 1, D) views of one joint product
    qkv = torch.randn(B, 1, (NH + 2 * NKV) * D, generator=g).to(dtype).to(DEV)
    q = qkv[..., : NH * D].reshape(B, 1, NH, D).swapaxes(1, 2)
    k = qkv[..., NH * D : (NH + NKV) * D].reshape(B, 1, NKV, D).swapaxes(1, 2)
    v = qkv[..., (NH + NKV) * D :].reshape(B, 1, NKV, D).swapaxes(1, 2)
    slot = torch.tensor(slots, device=DEV)
    rows_t = None if rows is None else torch.tensor(rows, device=DEV)
    written = [(key0 + s % (S - key0)) for s in (slots if rows is not None else slots * B)]
    far = NKV == NH  # the long-context case
    pos = torch.tensor([[p + (30000 if far else 1000)] for p in written], device=DEV)
    inv = (0.125 if far else 1.0) / 10000 ** (np.arange(0, D, 2) / D)
    inv = torch.from_numpy(inv).float().to(DEV)
    keys = torch.arange(S, device=DEV)[None]
    mask = (keys <= torch.tensor(written, device=DEV)[:, None])[:, None, None]
    sink = torch.randn(NH, generator=g).to(DEV) if sinks else None
    kc, vc = _caches(g, quant, R, NKV, S, D, dtype)
    # 16-key blocks and many programs: the keys take several splits
    # (and the rope's cos/sin after the PDL wait, as MLXRUN_ROPE_EARLY=0, in the int8 case)
    launch = cuda_attention.AttnLaunch(block=16, block_quant=16, per_sm=8, per_sm_quant=8,
                                       rope_early=quant != "int8")  # fmt: skip
    plain = launch  # the reference: rope_qkv, then the attention without the variant
    # early_kv runs where the whole grid is resident: here every grid is (the interpreter's
    # 4 "SMs" would leave it off; the splits are the keys' blocks either way at these sizes)
    monkeypatch.setattr(cuda_attention, "_num_sms", lambda dev: 4096)
    launch = dataclasses.replace(launch, **VARIANTS[variant])

    ka, va = _clone(kc), _clone(vc)
    qa = cuda_attention.rope_qkv(q, k, v, pos, inv, _view(ka, key0), _view(va, key0), slot,
                                 rows=rows_t)  # fmt: skip
    want = cuda_attention.decode_attention(qa, ka, va, 0.2, mask, sink, rows=rows_t,
                                           launch=plain)  # fmt: skip
    kb, vb = _clone(kc), _clone(vc)
    step = RopeStep(q, k, v, pos, inv, _view(kb, key0), _view(vb, key0), slot, rows_t)
    got = cuda_attention.decode_attention(q, kb, vb, 0.2, mask, sink, rows=rows_t,
                                          launch=launch, rope=step)  # fmt: skip
    assert _same(kb, ka), "the k cache differs"  # the new k stored, nothing else touched
    assert _same(vb, va), "the v cache differs"
    if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
        # again on caches that hold the new row already: equal then says the first call read
        # the row before its own store was visible, else q's rotation differs
        again = cuda_attention.decode_attention(q, kb, vb, 0.2, mask, sink, rows=rows_t,
                                                launch=launch, rope=step)  # fmt: skip
        diff = (got.float() - want.float()).abs().max().item()
        raise AssertionError(
            f"output differs by up to {diff:.3g}; again on the stored caches: "
            f"{'equal' if torch.equal(again, want) else 'differs'}"
        )
    assert not _same(kb, kc)  # (and something was stored)


def test_model_decode_steps_fused_equal_the_separate_launch(tmp_path, monkeypatch):
    """The model's decode steps on the CUDA code path (TorchBackend with the Triton kernels;
    interpreted without a GPU): with MLXRUN_ROPE_FUSED's default, rope_and_cache hands every
    layer's decode_attention a RopeStep, and the logits of a prompt and two decode steps
    equal those of the separate rope_qkv launch bit for bit."""
    import importlib

    import mlxrun.backends.torch_backend as tb
    from mlxrun.backends import cuda_attention, cuda_ops, cuda_rope
    from mlxrun.build import build_model
    from mlxrun.loader import open_checkpoint

    from .conftest import write_random

    pytest.importorskip("transformers")  # (write_random's checkpoint)
    # (decorated under the interpreter: another module may have imported them without)
    if DEV != "cuda" and type(cuda_ops._add_rms_norm_kernel).__name__ != "InterpretedFunction":
        importlib.reload(cuda_ops)
    if DEV != "cuda" and type(cuda_attention._decode_attn_kernel).__name__ != "InterpretedFunction":
        importlib.reload(cuda_rope)  # first: the attention kernel calls its rope pieces
        cuda_attention = importlib.reload(cuda_attention)
    cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=64, max_position_embeddings=256,
               rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
    path, _ = write_random(tmp_path / "m", "llama", cfg)
    ckpt = open_checkpoint(str(path))
    real, fused_calls = cuda_attention.decode_attention, []

    def spy(q, *a, rope=None, **kw):
        fused_calls.append(rope is not None)
        return real(q, *a, rope=rope, **kw)

    monkeypatch.setattr(cuda_attention, "decode_attention", spy)
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(tb, "ROPE_FUSED", fused)
        be = tb.TorchBackend(DEV, "float32")
        be.triton_kernels, be.cuda_graphs = True, False
        m = build_model(ckpt.config, ckpt.tensors, be, None, progress=False)[0]
        cache = m.make_cache(1, 8)
        ids = np.random.default_rng(1).integers(3, 64, size=(1, 2))
        steps = [m.be.to_numpy(m(m.be.ids(ids), cache))[0, -1]]
        for t in (5, 9):
            steps.append(m.be.to_numpy(m(m.be.ids(np.array([[t]])), cache))[0, -1])
        outs.append(np.stack(steps))
    assert fused_calls == [True] * 4 + [False] * 4  # 2 steps x 2 layers, each way
    assert np.array_equal(outs[0], outs[1])
