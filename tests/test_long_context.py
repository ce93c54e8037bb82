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

from .conftest import rel_err, write_random

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
    """Within two float32 ulps (torch's vectorised pow and numpy's powf disagree on ~1.5% of
    arbitrary bases), at a real model's sizes (head_dim 128, theta 500000 and 1e6)."""
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
            np.testing.assert_array_max_ulp(got, want.numpy(), maxulp=2)
            assert mc.attention_scale == pytest.approx(128**-0.5 * att**2, rel=1e-12)


def test_dynamic_ntk_prefill_and_decode_match_transformers(root):
    """transformers recomputes dynamic NTK's base on every pass past max_position_embeddings
    from that pass's length; cached keys keep the rotation they were stored with."""
    kw = {**BASE, "max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic",
                                                                  "factor": 4.0}}  # fmt: skip
    d, hf = write_random(root / "dynamic", "llama", kw, std=0.2)
    ids = np.random.default_rng(2).integers(3, VOCAB, size=40)
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids)[None], max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        hf.model.rotary_emb.__init__(hf.config)  # the generation grew its cached length
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    want = out[0, len(ids) :].tolist()
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
