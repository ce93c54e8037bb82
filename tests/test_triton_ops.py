"""Dense Triton kernels: GEMV, graph-advance, fused small ops, decode attention, CUDA code path.

Shared set-up: tests/_kernels.py.
"""

import dataclasses

import numpy as np
import pytest

from ._kernels import (
    DEV,
    HAS_CUDA,
    LONG_ON_CPU,
    rel_err,
    torch,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gemv_equals_the_float64_product(dtype):
    """The batch-1 bf16/fp16 GEMV (cuda_ops.dense_gemv) against the float64 product: one and
    three rows of x, whole 4-row blocks and whole k-blocks (no masks), a partial row block
    and a K that ends inside a k-block; with silu (19 gate rows: a program's last pair half
    outside) it gives silu_mul of its own product bit for bit."""
    from mlxrun.backends import cuda_ops

    gen = torch.Generator().manual_seed(5)
    cases = [(64, 2048, {}), (38, 300, {}), (48, 1024, dict(warps=2, vec=8))]
    # the launch table's other settings (_DENSE_TUNED): 2 and 8 rows, 16 or 8 inputs a thread
    cases += [(40, 2048, dict(block_n=2, vec=16)), (48, 1024, dict(block_n=8, warps=2))]
    for n, k, kw in cases:
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
        for m in (1, 3):
            x = torch.randn(m, k, generator=gen).to(dtype)
            y = cuda_ops.dense_gemv(x.to(DEV), w.to(DEV), **kw)
            assert y.dtype == dtype and y.shape == (m, n)
            assert rel_err(y.cpu(), x.double() @ w.double().T) < 1e-2
            if n % 2 == 0:
                want = cuda_ops.silu_mul(y[:, : n // 2], y[:, n // 2 :])
                got = cuda_ops.dense_gemv(x.to(DEV), w.to(DEV), silu=True, **kw)
                assert torch.equal(got, want)


def test_dense_gemv_launch_table(monkeypatch):
    """dense_gemv's settings by shape: the GPU's table (by its name), MLXRUN_DENSE_CFG over
    it, a malformed value one MlxrunError naming the variable."""
    from mlxrun.backends import cuda_ops
    from mlxrun.errors import MlxrunError

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(cuda_ops, "_DENSE_CFG", {})
    assert cuda_ops._dense_cfg(dev)[(4096, 4096)] == (8, 2, 16)
    monkeypatch.setattr(cuda_ops, "_DENSE_CFG", {})
    monkeypatch.setenv("MLXRUN_DENSE_CFG", "4096,4096=2,2,8;1,2=4,4,16")
    cfg = cuda_ops._dense_cfg(dev)
    assert cfg[(4096, 4096)] == (2, 2, 8) and cfg[(1, 2)] == (4, 4, 16)
    assert cfg[(6144, 4096)] == (4, 4, 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cuda_ops, "_DENSE_CFG", {})
    assert (6144, 4096) not in cuda_ops._dense_cfg(dev)
    monkeypatch.setattr(cuda_ops, "_DENSE_CFG", {})
    monkeypatch.setenv("MLXRUN_DENSE_CFG", "4096=2")
    with pytest.raises(MlxrunError, match="MLXRUN_DENSE_CFG"):
        cuda_ops._dense_cfg(dev)


def test_embed_shard_equals_the_masked_lookup():
    """A rank's term of a vocabulary-split embedding (cuda_ops.embed_shard): its rows in
    fp32, zeros for ids outside [start, start + rows), the table's padding rows included."""
    from mlxrun.backends import cuda_ops

    w = torch.randn(10, 1500, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ids = torch.tensor([[12, 3, 17, 18, 10, 25]])
    start, rows = 10, 8  # rows 8 and 9 of w are padding
    local = ids - start
    inside = (local >= 0) & (local < rows)
    want = torch.where(inside[..., None], w[local.clamp(0, 9)].float(), 0.0)
    got = cuda_ops.embed_shard(ids.to(DEV), w.to(DEV), start, rows)
    assert got.dtype == torch.float32 and got.shape == (1, 6, 1500)
    assert torch.equal(got.cpu(), want) and inside.tolist() == [[1, 0, 1, 0, 1, 0]]


def test_graph_advance_kernel_equals_the_torch_ops():
    """A graph-mode cache moved on by the one-launch kernel holds what the torch ops give:
    position, rope positions (left padding subtracted) and the mask's new slot; rewind
    restores the state at the host offset."""
    from mlxrun.backends.torch_backend import StaticCache

    caches = [StaticCache(1, 3, 1, 4, 9, torch.float32, DEV, fused=f) for f in (False, True)]
    for c in caches:
        c.offset = 4
        c.enter_graph(np.array([0, 2, 4]))
        for _ in range(3):
            c.advance(1)
    plain, fused = caches
    assert plain.pos.item() == fused.pos.item() == 7
    assert torch.equal(fused.positions(1, None), plain.positions(1, None))
    assert fused.positions(1, None).view(-1).tolist() == [7, 5, 3]
    assert torch.equal(fused.mask(1, None), plain.mask(1, None))
    assert fused.mask(1, None)[:, 0, 0].int().tolist() == [
        [1, 1, 1, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1, 1, 0],
    ]
    fused.rewind()
    assert fused.pos.item() == 4 and fused.mask(1, None)[0, 0, 0].int().sum().item() == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_small_ops_equal_the_stock_ops(dtype):
    """RMSNorm (+ residual add), rotary embedding with the KV-cache store, SiLU-multiply and
    the greedy argmax as one kernel each give what the PyTorch backend's stock ops give,
    rounding steps included."""
    from mlxrun.backends import cuda_attention, cuda_ops
    from mlxrun.backends.torch_backend import TorchBackend

    stock = TorchBackend(DEV, "bfloat16" if dtype == torch.bfloat16 else "float32")
    stock.triton_kernels = False
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    # bf16: the interpreter truncates float32 -> bf16 where the GPU rounds to nearest
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    h, y, w = rnd(2, 5, 96), rnd(2, 5, 96), rnd(96)
    hs, xs = stock.add_rms_norm(h, y, w, 1e-5)
    hf, xf = cuda_ops.add_rms_norm(h, y, w, 1e-5)
    if HAS_CUDA or dtype == torch.float32:
        assert torch.equal(hf, hs)  # one rounded add either way
    assert rel_err(hf.float().cpu(), hs.float().cpu()) < tol
    assert rel_err(xf.float().cpu(), xs.float().cpu()) < tol
    _, x0 = cuda_ops.add_rms_norm(h, None, w, 1e-5)
    assert rel_err(x0.float().cpu(), stock.rms_norm(h, w, 1e-5).float().cpu()) < tol

    # q, k, v as the model passes them: (B, H, T, D) views of the joint q/k/v product;
    # left-padded positions; written into a cache at offset 3 (eager) and at a slot (graph)
    qkv = rnd(2, 7, (4 + 2 + 2) * 32)
    q = qkv[..., :128].reshape(2, 7, 4, 32).swapaxes(1, 2)
    k = qkv[..., 128:192].reshape(2, 7, 2, 32).swapaxes(1, 2)
    v = qkv[..., 192:].reshape(2, 7, 2, 32).swapaxes(1, 2)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [-2, -1, 0, 1, 2, 3, 4]], device=DEV)
    inv = torch.from_numpy(1.0 / 10000 ** (np.arange(0, 32, 2) / 32)).float().to(DEV)
    kc, vc = rnd(2, 2, 12, 32), rnd(2, 2, 12, 32)  # stale values around the written slots
    kw, vw = kc.clone(), vc.clone()
    kw[:, :, 3:10], vw[:, :, 3:10] = stock.rope(k, pos, inv), v
    slot = torch.tensor([3], device=DEV)
    got = cuda_attention.rope_qkv(q, k, v, pos, inv, kc, vc, slot)
    assert got.is_contiguous() and got.shape == q.shape
    assert rel_err(got.float().cpu(), stock.rope(q, pos, inv).float().cpu()) < tol
    assert rel_err(kc.float().cpu(), kw.float().cpu()) < tol
    assert torch.equal(vc, vw)  # v copied bit for bit, nothing else touched
    assert torch.equal(kc[:, :, :3], kw[:, :, :3]) and torch.equal(kc[:, :, 10:], kw[:, :, 10:])
    one = cuda_attention.rope_qkv(q[:1], k[:1], v[:1], pos[1:], inv, kc[:1], vc[:1], slot)
    assert rel_err(one.float().cpu(), stock.rope(q[:1], pos[1:], inv).float().cpu()) < tol
    # a sliding-window layer's ring: the writes wrap past the end of the buffer to its start
    kc2, vc2 = rnd(2, 2, 12, 32), rnd(2, 2, 12, 32)
    kw2, vw2 = kc2.clone(), vc2.clone()
    ring = [9, 10, 11, 0, 1, 2, 3]
    kw2[:, :, ring], vw2[:, :, ring] = stock.rope(k, pos, inv), v
    cuda_attention.rope_qkv(q, k, v, pos, inv, kc2, vc2, torch.tensor([9], device=DEV))
    assert rel_err(kc2.float().cpu(), kw2.float().cpu()) < tol and torch.equal(vc2, vw2)

    # greedy argmax over a vocabulary of 3 blocks and a bit, split across programs: a tie
    # across blocks gives the first index, as torch.argmax
    logits = rnd(3, 9000)
    logits[1, 8500] = logits[1, 123] = logits[1].max() + 1
    logits[2, :] = -1.0
    assert torch.equal(cuda_ops.argmax(logits).cpu(), logits.float().cpu().argmax(-1))
    out = torch.full((3,), 7, dtype=torch.int64, device=DEV)
    assert cuda_ops.argmax(logits, out=out) is out and out.tolist()[1:] == [123, 0]
    logits[0, :] = float("nan")  # still an id in range: the next step embeds it
    assert 0 <= cuda_ops.argmax(logits)[0].item() < 9000
    # finite_rows' flags from the same launch: the last block's padding is no inf
    logits[2, 8999] = float("-inf")
    ok = torch.zeros(3, dtype=torch.bool, device=DEV)
    cuda_ops.argmax(logits, out=out, ok=ok)
    assert ok.tolist() == [False, True, False] and out.tolist()[1:] == [123, 0]
    assert ok.tolist() == torch.isfinite(logits).all(-1).tolist()

    gu = rnd(2, 3, 3000)  # a joint gate/up product; 1500 is not a multiple of the block
    gate, up = gu[..., :1500], gu[..., 1500:]
    assert (
        rel_err(
            cuda_ops.silu_mul(gate, up).float().cpu(),
            stock.silu_mul(gate, up).float().cpu(),
        )
        < tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa(dtype):
    """One new token per sequence against a GQA cache, split across programs over the keys:
    what SDPA gives, with no mask, with a per-sequence mask (left padding, an unfilled tail
    that whole blocks of keys skip), and with one mask for the batch; in one split, the
    output written by the attention kernel itself."""
    import torch.nn.functional as F

    from mlxrun.backends import cuda_attention

    g = torch.Generator().manual_seed(0)
    B, NH, NKV, S, D = 3, 8, 2, 200, 32  # 200 keys: 4 blocks of 64, the last partial

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    q, k, v = rnd(B, NH, 1, D), rnd(B, NKV, S, D), rnd(B, NKV, S, D)
    slots = torch.arange(S, device=DEV)
    pads = torch.tensor([0, 5, 70], device=DEV)
    filled = 90  # keys past it are stale: in graph decode the mask hides them
    per_seq = ((slots[None] >= pads[:, None]) & (slots[None] < filled))[:, None, None]
    one = (slots < 150)[None, None, None]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for mask in (None, per_seq, one):
        want = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, scale=0.2, enable_gqa=True
        )
        got = cuda_attention.decode_attention(q, k, v, 0.2, mask)
        assert got.shape == q.shape and got.dtype == dtype
        assert rel_err(got.float().cpu(), want.cpu()) < tol
        # one block of 256 keys, so one split: the attention kernel writes the output (no
        # combine), equal to what the combine makes of the one split
        one_split = cuda_attention.AttnLaunch(block=256)
        got = cuda_attention.decode_attention(q, k, v, 0.2, mask, launch=one_split)
        assert rel_err(got.float().cpu(), want.cpu()) < tol
        combined = dataclasses.replace(one_split, direct=False)
        assert torch.equal(
            got, cuda_attention.decode_attention(q, k, v, 0.2, mask, launch=combined)
        )


def test_attention_takes_two_splits_at_large_batches():
    """A plain cache takes at least AttnLaunch.min_splits (2) splits where per_sm alone gives
    one (B * NKV > 2 x SMs; 4 SMs under the interpreter): bit-equal to per_sm=4's two
    splits, and min_splits=1 to the one-split launch before (float32, where one split and
    two with the combine differ in the last bit)."""
    from mlxrun.backends import cuda_attention as ca

    g = torch.Generator().manual_seed(2)
    B = ca._num_sms(torch.device(DEV)) + 1  # B x 2 kv heads > 2 x SMs, on a GPU too
    q = torch.randn(B, 4, 1, 32, generator=g).to(DEV)
    k, v = (torch.randn(B, 2, 300, 32, generator=g).to(DEV) for _ in range(2))

    def att(**kw):
        return ca.decode_attention(q, k, v, 0.2, None, launch=ca.AttnLaunch(**kw))

    two, one = att(), att(min_splits=1)
    assert torch.equal(two, att(per_sm=4, min_splits=1))
    assert torch.equal(one, att(per_sm=1, min_splits=1))  # one split either way
    assert not torch.equal(two, one)


def test_attention_launch_from_the_environment(monkeypatch):
    """MLXRUN_ATTN_LAUNCH (for A/B timing in the model) sets the launch decode_attention
    takes when given none: per_sm=1 gives what AttnLaunch(per_sm=1) gives, bit for bit (one
    split here, no combine, where the default takes two); a malformed value is one
    MlxrunError line."""
    from mlxrun.backends import cuda_attention
    from mlxrun.errors import MlxrunError

    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 1, 32, generator=g).to(DEV)
    k, v = (torch.randn(3, 2, 200, 32, generator=g).to(DEV) for _ in range(2))
    monkeypatch.setenv("MLXRUN_ATTN_LAUNCH", "per_sm=1")
    cuda_attention._env_launch.cache_clear()
    try:
        got = cuda_attention.decode_attention(q, k, v, 0.2, None)
        assert cuda_attention._env_launch() == cuda_attention.AttnLaunch(per_sm=1)
        one = cuda_attention.decode_attention(
            q, k, v, 0.2, None, launch=cuda_attention.AttnLaunch(per_sm=1)
        )
        assert torch.equal(got, one)
        for bad in ("per_sm", "persm=1", "per_sm=x"):
            monkeypatch.setenv("MLXRUN_ATTN_LAUNCH", bad)
            cuda_attention._env_launch.cache_clear()
            with pytest.raises(MlxrunError, match="MLXRUN_ATTN_LAUNCH"):
                cuda_attention.decode_attention(q, k, v, 0.2, None)
    finally:
        cuda_attention._env_launch.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_rows_are_written_and_read_in_place(dtype):
    """The serving engine's decode step over a slot cache: rope_qkv with `rows` stores each
    sequence's k, v in its own slot at its own position, touching nothing else, and
    decode_attention with `rows` reads each sequence's slot in place, as SDPA over the
    gathered rows does (a dummy row in slot 0 that sees only the last position included)."""
    import torch.nn.functional as F

    from mlxrun.backends import cuda_attention
    from mlxrun.backends.torch_backend import TorchBackend

    stock = TorchBackend(DEV, "bfloat16" if dtype == torch.bfloat16 else "float32")
    stock.triton_kernels = False
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    SLOTS, NH, NKV, S, D = 5, 4, 2, 80, 32
    rows = torch.tensor([3, 1, 4, 0], device=DEV)  # three sequences and a dummy
    pos = torch.tensor([7, 0, 66, S - 1], device=DEV)
    q, k, v = rnd(4, NH, 1, D), rnd(4, NKV, 1, D), rnd(4, NKV, 1, D)
    kc, vc = rnd(SLOTS, NKV, S, D), rnd(SLOTS, NKV, S, D)
    kw, vw = kc.clone(), vc.clone()
    inv = torch.from_numpy(1.0 / 10000 ** (np.arange(0, D, 2) / D)).float().to(DEV)
    for b in range(4):
        kw[rows[b], :, pos[b]] = stock.rope(k[b : b + 1], pos[b].view(1, 1), inv)[0, :, 0]
        vw[rows[b], :, pos[b]] = v[b, :, 0]
    qr = cuda_attention.rope_qkv(q, k, v, pos.view(-1, 1), inv, kc, vc, pos, rows=rows)
    assert rel_err(qr.float().cpu(), stock.rope(q, pos.view(-1, 1), inv).float().cpu()) < tol
    assert rel_err(kc.float().cpu(), kw.float().cpu()) < tol
    assert torch.equal(vc, vw)  # v stored bit for bit, every other position untouched

    keys = torch.arange(S, device=DEV)[None]
    lo = torch.tensor([0, 0, 0, S - 1], device=DEV)[:, None]
    mask = ((keys >= lo) & (keys <= pos[:, None]))[:, None, None]
    got = cuda_attention.decode_attention(qr, kc, vc, 0.2, mask, rows=rows)
    want = F.scaled_dot_product_attention(
        qr.float(), kc[rows].float(), vc[rows].float(), attn_mask=mask, scale=0.2,
        enable_gqa=True,
    )  # fmt: skip
    assert got.shape == q.shape and rel_err(got.float().cpu(), want.cpu()) < tol


def test_decode_attention_with_sinks():
    """A sink logit per head (gpt-oss) joins the combine's denominator: what the plain torch
    path gives, over several splits, with and without a mask, sinks large and small."""
    from mlxrun.backends import cuda_attention
    from mlxrun.backends.torch_backend import _sink_attention

    g = torch.Generator().manual_seed(1)
    B, NH, NKV, S, D = 2, 8, 2, 200, 32
    q, k, v = (torch.randn(*s, generator=g).to(DEV) for s in
               ((B, NH, 1, D), (B, NKV, S, D), (B, NKV, S, D)))  # fmt: skip
    mask = (torch.arange(S, device=DEV) < 150)[None, None, None]
    for sinks in (torch.randn(NH, generator=g), torch.full((NH,), 30.0)):
        sinks = sinks.to(DEV)
        for m in (None, mask):
            want = _sink_attention(q, k, v, 0.2, m, sinks)
            got = cuda_attention.decode_attention(q, k, v, 0.2, m, sinks)
            assert rel_err(got.cpu(), want.cpu()) < 1e-5
    assert rel_err(cuda_attention.decode_attention(q, k, v, 0.2, None).cpu(), want.cpu()) > 1e-2


def test_cuda_code_path_honours_biases_activation_and_window(tmp_path):
    """The CUDA code path (joint q/k/v product with its biases, decode attention kernel under
    a sliding-window mask, the activation outside the SiLU epilogues): the logits and greedy
    tokens of transformers on the same weights, through a prompt and decode that cross the
    window (Qwen3 with attention biases, tanh-GELU, every layer sliding, window 6)."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.generate import generate_step
    from mlxrun.loader import open_checkpoint
    from mlxrun.sampling import SamplingParams

    from .conftest import rel_err
    from .test_conformance import _make

    opts = dict(attention_bias=True, use_sliding_window=True, sliding_window=6,
                max_window_layers=0, head_dim=16, hidden_act="gelu_pytorch_tanh")  # fmt: skip
    d, hf = _make(tmp_path, "m", "qwen3", opts)
    ckpt = open_checkpoint(str(d))
    assert ckpt.config.layer_windows == (6, 6)
    ids = np.random.default_rng(0).integers(3, 64, size=9)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
        out = hf.generate(torch.tensor(ids)[None], max_new_tokens=3, min_new_tokens=3,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    be = TorchBackend(DEV, "float32")
    be.triton_kernels, be.cuda_graphs = True, False
    m = build_model(ckpt.config, ckpt.tensors, be, None, progress=False)[0]
    got = be.to_numpy(m(be.ids(ids[None]), m.make_cache(1, 9)))[0]
    assert rel_err(got, ref) < (2e-3 if HAS_CUDA else 1e-4)
    toks = [int(t[0]) for t in generate_step(m, [ids.tolist()], SamplingParams(), 3)]
    assert toks == out[0, len(ids) :].tolist()


@LONG_ON_CPU
def test_cuda_code_path_window_rings(tmp_path):
    """The CUDA code path with sliding-window rings (rope/cache kernel writing mod the ring,
    decode attention under the ring mask): transformers' greedy tokens through chunks of 3
    and 10 decode steps (rings of 8, wrapped twice); and the graph-mode ring (device slot
    and mask moved with the position, no capture) equal to the unbounded cache over a
    left-padded batch."""
    from mlxrun.backends.torch_backend import TorchBackend
    from mlxrun.build import build_model
    from mlxrun.generate import generate_step
    from mlxrun.loader import open_checkpoint
    from mlxrun.sampling import SamplingParams

    from .conftest import rel_err, write_random

    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                rms_norm_eps=1e-5, head_dim=16, use_sliding_window=True, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    d, hf = write_random(tmp_path / "m", "qwen2", base, std=0.2)
    ids = np.random.default_rng(0).integers(3, 64, size=10)
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids)[None], max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    ckpt = open_checkpoint(str(d))
    be = TorchBackend(DEV, "float32")
    be.triton_kernels, be.cuda_graphs = True, False
    t = build_model(ckpt.config, ckpt.tensors, be, None, progress=False)[0]
    assert t.make_cache(1, 20, 3).caps == [8, 20]
    toks = generate_step(t, [ids.tolist()], SamplingParams(), 10, prefill_chunk=3)
    assert [int(x[0]) for x in toks] == out[0, len(ids) :].tolist()

    prompts, pads = np.array([[0, 0, 5, 6], [8, 9, 10, 11]]), np.array([2, 0])
    full, graph = t.make_cache(2, 24), t.make_cache(2, 24, chunk=2)
    for c in (full, graph):
        t(be.ids(prompts[:, :2]), c, pads)
        t(be.ids(prompts[:, 2:]), c, pads)
    graph.enter_graph(pads)
    for i in range(12):  # positions 4..15: the ring of 7 wraps
        tok = be.ids(np.array([[13 + i], [30 + i]]))
        a = be.to_numpy(t(tok, full, pads, last_only=True))
        b = be.to_numpy(t(tok, graph, pads, last_only=True))
        graph.offset += 1
        assert rel_err(b, a) < (2e-3 if HAS_CUDA else 1e-5), i
