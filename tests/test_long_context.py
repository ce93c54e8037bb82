"""Long context against transformers on tiny random models: each rope scaling type at
positions far past the original context, dynamic NTK through prefill and decode, and the
window-bounded KV cache of sliding-window layers past the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.backends.mlx_backend import MLXCache
from mlxrun.backends.torch_backend import StaticCache
from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

from .conftest import hf_greedy, rel_err, write_random

# (imported here, at collection: without a GPU it turns the Triton interpreter on before
# anything imports triton)
from .test_engine import HAS_CUDA, _interpreted_kernels, run_all  # noqa: E402

VOCAB = 64
BASE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
FAR = 10_000  # the second half of a prompt sits at positions FAR.., the original context is 256
HALF = 6

ROPES = {
    "llama3": ("llama", dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=256)),
    "linear": ("llama", dict(rope_type="linear", factor=40.0)),
    # Qwen's YaRN, and gpt-oss's (no truncation of the ramp, an explicit attention factor)
    "yarn_qwen2": ("qwen2", dict(rope_type="yarn", factor=40.0,
                                 original_max_position_embeddings=256)),
    "yarn_untruncated": ("llama", dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                       beta_slow=1.0, truncate=False,
                                       original_max_position_embeddings=256)),
    "yarn_mscale": ("llama", dict(rope_type="yarn", factor=16.0, mscale=1.0,
                                  mscale_all_dim=0.5, original_max_position_embeddings=256)),
}  # fmt: skip


class _FarTorch(StaticCache):
    """A cache whose rope positions jump by `shift` (transformers' position_ids with a gap)."""

    shift = 0

    def positions(self, length, pads):
        return super().positions(length, pads) + self.shift


class _FarMLX(MLXCache):
    shift = 0

    def positions(self, length, pads):
        return super().positions(length, pads) + self.shift


def _far_logits(m, ids: np.ndarray, table=None) -> np.ndarray:
    """Logits of ids[:HALF] at positions 0.. and of ids[HALF:] at FAR.. (two passes)."""
    tr, be = m.transformer, m.backend
    c = tr.config
    args = (c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim)
    if be.name == "mlx":
        cache = _FarMLX(*args, be._dt, len(ids))
    else:
        cache = _FarTorch(*args, len(ids), be._dt, be._dev)
    first = be.to_numpy(tr(be.ids(ids[None, :HALF]), cache))[0]
    cache.shift = FAR - HALF
    return np.concatenate([first, be.to_numpy(tr(be.ids(ids[None, HALF:]), cache))[0]])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("longctx")


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_scaling_far_past_the_original_context(root, name):
    mt, rs = ROPES[name]
    d, hf = write_random(root / name, mt, {**BASE, "rope_scaling": rs}, std=0.2)
    ids = np.random.default_rng(1).integers(3, VOCAB, size=2 * HALF)
    pos = torch.cat([torch.arange(HALF), torch.arange(FAR, FAR + HALF)])[None]
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None], position_ids=pos).logits[0].numpy()
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
        assert rel_err(_far_logits(m, ids), ref) < 1e-4, backend
    # the test can fail: without the scaling the far half differs
    tr = m.transformer
    tr.rope = m.backend.rope_table(tr.config.replace(rope_scaling=None).rope_freqs())
    assert rel_err(_far_logits(m, ids)[HALF:], ref[HALF:]) > 1e-2


def test_rope_inverse_frequencies_equal_transformers():
    """Within 8 float32 ulps, at a real model's sizes (head_dim 128, theta 500000 and 1e6):
    torch's and numpy's vectorised float32 pow each miss the rounded power by an ulp or two,
    differently by CPU (2 ulps apart where AVX2 ran them, 4 after llama3's blend with AVX-512);
    a wrong scaling is off by orders of magnitude more."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [rs for _, rs in ROPES.values()] + [dict(rope_type="dynamic", factor=4.0)]
    for theta in (500000.0, 1e6):
        for rs in cases:
            kw = dict(BASE, hidden_size=1024, num_attention_heads=8, rope_theta=theta)
            kw["rope_parameters"] = {**rs, "rope_theta": theta}
            cfg = AutoConfig.for_model("llama", **kw)
            t = rs["rope_type"]
            seq = 4000 if t == "dynamic" else None
            want, att = ROPE_INIT_FUNCTIONS[t](cfg, "cpu", seq)
            mc = ModelConfig.from_dict({"model_type": "llama", **kw})
            got = mc.rope_freqs(seq)
            np.testing.assert_array_max_ulp(got, want.numpy(), maxulp=8)
            assert mc.attention_scale == pytest.approx(128**-0.5 * att**2, rel=1e-12)


def test_dynamic_ntk_prefill_and_decode_match_transformers(root):
    """transformers recomputes dynamic NTK's base on every pass past max_position_embeddings
    from that pass's length; cached keys keep the rotation they were stored with."""
    kw = {**BASE, "max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic",
                                                                  "factor": 4.0}}  # fmt: skip
    d, hf = write_random(root / "dynamic", "llama", kw, std=0.2)
    ids = np.random.default_rng(2).integers(3, VOCAB, size=40)
    want = hf_greedy(hf, ids, 8)
    with torch.no_grad():
        hf.model.rotary_emb.__init__(hf.config)  # the generation grew its cached length
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
        assert rel_err(m.logits(ids), ref) < 1e-4, backend
        steps = generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=8)
        assert [int(t[0]) for t in steps] == want, backend


@pytest.mark.parametrize(
    "rs, words",
    [
        ({"rope_type": "longrope", "factor": 4.0}, ["rope_scaling", "longrope", "yarn"]),
        ({"type": "su"}, ["'su'"]),
        ({"rope_type": "linear"}, ["linear", "factor"]),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, ["truncate"]),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, ["beta_fast"]),
    ],
)
def test_unknown_rope_is_refused(rs, words):
    with pytest.raises(MlxrunError) as e:
        ModelConfig.from_dict({"model_type": "llama", **BASE, "rope_scaling": rs})
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


WINDOW = 6
SLIDING = {  # every layer (Mistral); alternating by layer_types, Gemma-2/3 style (Qwen2)
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "alternating": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"])),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SLIDING))
def test_window_ring_cache_matches_transformers(root, name):
    """A sliding-window layer's cache holds window + chunk - 1 positions; prefill in chunks
    of 4 and decode one token at a time past the window (the ring wraps several times):
    logits at every position within 1e-4 of transformers on the whole sequence."""
    mt, opts = SLIDING[name]
    d, hf = write_random(root / name, mt, {**BASE, **opts}, std=0.2)
    ids = np.random.default_rng(3).integers(3, VOCAB, size=30)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    chunk = 4
    for backend in ("cpu", "mlx"):
        m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
        tr, be = m.transformer, m.backend
        cache = tr.make_cache(1, len(ids), chunk=chunk)
        cuts = [0, 4, 8, 12, *range(13, len(ids) + 1)]  # 3 prefill chunks, then decode
        got = np.concatenate(
            [be.to_numpy(tr(be.ids(ids[None, a:b]), cache))[0] for a, b in zip(cuts, cuts[1:])]
        )
        assert rel_err(got, ref) < 1e-4, backend
        held = [k.shape[2] for k in cache.keys]
        want = [WINDOW + chunk - 1 if tr.config.window(i) else len(ids) for i in range(2)]
        assert held == want, backend


def test_window_ring_graph_mode_equals_unbounded_cache(root):
    """The CUDA graph's device-side ring (slot pos % capacity, its mask moved on with the
    position) gives the logits of the unbounded cache, decoding a left-padded batch well
    past the window; run here without capture."""
    mt, opts = SLIDING["alternating"]
    d, _ = write_random(root / "graph_ring", mt, {**BASE, **opts}, std=0.2)
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    t, be = m.transformer, m.backend
    prompts = np.array([[0, 0, 5, 6], [8, 9, 10, 11]])
    pads = np.array([2, 0])
    full, graph = t.make_cache(2, 24), t.make_cache(2, 24, chunk=2)
    assert [k.shape[2] for k in graph.keys] == [WINDOW + 1, 24]
    for c in (full, graph):
        t(be.ids(prompts[:, :2]), c, pads)
        t(be.ids(prompts[:, 2:]), c, pads)
    graph.enter_graph(pads)
    for i in range(16):  # positions 4..19: the ring of 7 wraps twice
        tok = np.array([[13 + i], [30 + i]])
        a = be.to_numpy(t(be.ids(tok), full, pads, last_only=True))
        b = be.to_numpy(t(be.ids(tok), graph, pads, last_only=True))
        graph.offset += 1
        assert rel_err(b, a) < 1e-5, i


def _hf_greedy(hf, prompt, n, eos=2):
    """hf_greedy up to and including the first `eos` (the engine stops there)."""
    toks = hf_greedy(hf, prompt, n)
    return toks[: toks.index(eos) + 1] if eos in toks else toks


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_window_ring_slot_cache_serves_transformers_tokens(root, backend):
    """The serving engine's slot cache with rings of window + chunk - 1 = 9 slots: requests
    of 3-25 tokens join and leave 3 slots in chunks of 4 and decode past the window; a
    chat's next turn reuses its slot's rings, a prefix the rings no longer hold is
    prefilled again. Every request gets transformers' greedy tokens."""
    from mlxrun.engine import Engine, Request

    mt, opts = SLIDING["mistral"]
    d, hf = write_random(root / f"engine_{backend}", mt, {**BASE, **opts}, std=0.2)
    m = mlxrun.load(str(d), backend=backend, dtype="float32", progress=False)
    rng = np.random.default_rng(4)
    ps = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (3, 25, 9, 14, 6)]
    eng = Engine(m.transformer, m.tokenizer, max_batch=3, context=64, prefill_chunk=4)
    try:
        assert [k.shape[2] for k in eng.cache.keys] == [WINDOW + 3] * 2
        for p, evs in zip(ps, run_all(eng, [Request(p, max_tokens=10) for p in ps])):
            assert [e.token for e in evs] == _hf_greedy(hf, p, 10)
        (first,) = run_all(eng, [Request(ps[1], max_tokens=6)])
        turn2 = ps[1] + [e.token for e in first] + [7, 8, 9]
        (second,) = run_all(eng, [Request(turn2, max_tokens=6)])
        assert second[-1].cached_tokens == len(ps[1]) + len(first) - 1
        assert [e.token for e in second] == _hf_greedy(hf, turn2, 6)
        short = ps[1][:12] + [5, 5]  # 12 tokens held, but the rings moved on past them
        (third,) = run_all(eng, [Request(short, max_tokens=6)])
        assert third[-1].cached_tokens == 0
        assert [e.token for e in third] == _hf_greedy(hf, short, 6)
    finally:
        eng.close()


# Both on a GPU; on a CPU, where the interpreter takes a minute for Mistral, CI runs the
# alternating layers (rings and full rows in one model) and `-m long` Mistral's rings too
_ALL_RINGS = pytest.mark.cuda if torch.cuda.is_available() else pytest.mark.long


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=_ALL_RINGS) for n in SLIDING],  # ~9 s each on 2 cores
)
def test_window_ring_fixed_steps_serve_transformers_tokens(root, name):
    """The engine's fixed-shape steps over rings of window + chunk - 1 = 9 slots (CUDA graphs
    on a GPU; here the same steps, their Triton kernels interpreted): rope_qkv's store at
    position % 9, the per-row ring mask of decode_attention, the dummy rows' scratch row.
    Three requests decode past the window in the bucket of 4 (a dummy beside them), last
    prefill chunks run as steps (a whole 3-token prompt, the tails after eager chunks of 4,
    a chat's next turn after its cached rings): every request gets transformers' greedy
    tokens."""
    from mlxrun.engine import Engine, Request

    mt, opts = SLIDING[name]
    d, hf = write_random(root / f"fixed_{name}", mt, {**BASE, **opts, "hidden_size": 64},
                         std=0.2)  # fmt: skip
    if HAS_CUDA:
        m = mlxrun.load(str(d), backend="cuda", dtype="float32", progress=False)
    else:
        if not _interpreted_kernels():
            pytest.skip("needs triton")
        m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
        m.transformer.be.triton_kernels = True  # the CUDA code path's kernels, interpreted
    rng = np.random.default_rng(5)
    ps = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (14, 3, 6)]
    eng = Engine(m.transformer, m.tokenizer, max_batch=4, context=48, prefill_chunk=4)
    try:
        assert eng.graphs is not None
        assert [k.shape[2] for k in eng.cache.keys] == [
            WINDOW + 3 if m.config.window(i) else 48 for i in range(2)
        ]
        # the 14-token one in slot 0 decodes past its ring's slot 2 (47 % 9), where the
        # dummy row would write without its scratch row
        reqs = [Request(p, max_tokens=10) for p in ps]
        outs = run_all(eng, reqs)
        for p, evs in zip(ps, outs):
            assert [e.token for e in evs] == _hf_greedy(hf, p, 10)
        assert (4, None) in eng.graphs.steps  # three rows and a dummy
        assert all(r.phases.chunks[-1][2] for r in reqs)  # last chunks as steps
        turn2 = ps[0] + [e.token for e in outs[0]] + [7, 8]
        (second,) = run_all(eng, [Request(turn2, max_tokens=8)])
        assert second[-1].cached_tokens >= len(ps[0]) + 6
        assert [e.token for e in second] == _hf_greedy(hf, turn2, 8)
    finally:
        eng.close()


def test_planner_counts_only_the_window_and_equals_the_caches(root):
    """Mistral-7B's shape (32 layers, window 4096) at 32k context: the plan's KV is 32 layers
    x (4096 + chunk - 1) positions, not 32k; and on a tiny model the planned bytes are
    the bytes the cache allocates, window layers and full ones mixed."""
    from mlxrun.memory import DeviceMemory, config_shapes, footprint, make_plan

    GiB = 1 << 30
    mistral = ModelConfig.from_dict({
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096,
    })  # fmt: skip
    fp = footprint(mistral, config_shapes(mistral), "bfloat16")
    per_pos = 32 * 2 * 8 * 128 * 2  # layers x k,v x kv heads x head_dim x bf16
    assert fp.kv_bytes_per_token == per_pos
    gpu = DeviceMemory("cuda", "H100 80GB", 80 * GiB, 79 * GiB, False)
    plan = make_plan(mistral, fp, gpu, context=32768, batch=4, prefill_chunk=512)
    assert plan.kv_bytes == 4 * per_pos * (4096 + 511)
    unbounded = make_plan(
        mistral.replace(layer_windows=()),
        fp.__class__(**{**fp.__dict__, "kv_windows": ()}),
        gpu,
        context=32768,
        batch=4,
        prefill_chunk=512,
    )
    assert unbounded.kv_bytes == 4 * per_pos * 32768
    assert plan.max_batch > 5 * unbounded.max_batch

    mt, opts = SLIDING["alternating"]
    d, _ = write_random(root / "plan", mt, {**BASE, **opts}, std=0.2)
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    tr = m.transformer
    cache = tr.make_cache(3, 100, chunk=5)
    held = sum(int(b.nbytes) for b in cache.keys + cache.values)
    assert held == tr.kv_bytes(3, 100, 5) == 2 * 2 * 8 * 4 * 3 * (WINDOW + 4 + 100)
    fp = footprint(tr.config, config_shapes(tr.config), "float32")
    assert fp.kv_bytes(100, 3, 5) == held


def test_bench_shape_and_kv_bytes_read():
    """shape:llama3.1-8b runs 128k positions through llama3 rope; the bench's roofline
    counts the KV a decode step reads: every position of a full layer, the window of a
    sliding one."""
    from mlxrun.bench import kv_read_bytes, shape_config

    c = shape_config("llama3.1-8b")
    assert c.context_length == 131072 and c.rope_scaling["rope_type"] == "llama3"
    per_pos = 32 * 2 * 8 * 128 * 2
    assert kv_read_bytes(c, "bfloat16", 32768) == per_pos * 32768
    alt = c.replace(layer_windows=(4096, None) * 16)
    assert kv_read_bytes(alt, "bfloat16", 32768) == per_pos / 32 * 16 * (4096 + 32768)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", list(SLIDING))
def test_cuda_graph_ring_decode_matches_transformers(root, name):
    """On a GPU: the Triton rope/cache kernel writing into rings of 9 slots (chunks of 4)
    and the captured decode step with its ring masks, 20 tokens past a window of 6."""
    mt, opts = SLIDING[name]
    d, hf = write_random(root / f"cuda_{name}", mt, {**BASE, **opts}, std=0.2)
    ids = np.random.default_rng(5).integers(3, VOCAB, size=14)
    want = _hf_greedy(hf, ids.tolist(), 20, eos=-1)
    m = mlxrun.load(str(d), backend="cuda", dtype="float32", progress=False)
    steps = generate_step(m.transformer, [ids.tolist()], SamplingParams(), max_tokens=20,
                          prefill_chunk=4)  # fmt: skip
    assert [int(t[0]) for t in steps] == want
