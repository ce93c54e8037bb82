"""The CUDA decode path: graph-mode cache math (checked on any device), and on a GPU the
captured graph against eager decoding and against transformers. GPU tests skip cleanly
without one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mlxrun
from mlxrun.backends.torch_backend import TorchBackend
from mlxrun.generate import generate_step
from mlxrun.sampling import SamplingParams

from .conftest import TINY, hf_greedy, rel_err

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _greedy(m, prompts, n):
    return _tokens(m.transformer, prompts, n)


def _tokens(transformer, prompts, n):
    return [t.tolist() for t in generate_step(transformer, prompts, SamplingParams(), n)]


def assert_graph_cache_equals_eager(m, steps, length: int):
    """A left-padded pair of prompts prefilled into an eager cache and a graph-mode one of
    `length` positions, then `steps` (a [2, 1] token list each) decoded through both, here
    without capture: the logits must agree at every step. Returns the graph-mode cache."""
    t, be = m.transformer, m.backend
    prompts = np.array([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    pads = np.array([2, 0])
    eager, graph = t.make_cache(2, length), t.make_cache(2, length)
    t(be.ids(prompts), eager, pads, last_only=True)
    t(be.ids(prompts), graph, pads, last_only=True)
    graph.enter_graph(pads)
    for i, tok in enumerate(steps):
        a = be.to_numpy(t(be.ids(np.array(tok)), eager, pads, last_only=True))
        b = be.to_numpy(t(be.ids(np.array(tok)), graph, pads, last_only=True))
        graph.offset += 1
        assert rel_err(b, a) < 1e-6, i
    return graph


def test_graph_mode_cache_equals_eager_on_cpu(tiny_dir):
    """The device-side position, index_copy writes and whole-buffer mask that the CUDA graph
    records give the same logits as the eager prefix path, here run without capture."""
    d, _ = tiny_dir("qwen3_qknorm")
    m = mlxrun.load(str(d), backend="cpu", dtype="float32", progress=False)
    assert_graph_cache_equals_eager(m, ([[13], [14]], [[15], [16]], [[17], [18]]), 12)


@cuda
@pytest.mark.parametrize("name", list(TINY))
def test_cuda_matches_transformers(tiny_dir, name):
    d, hf = tiny_dir(name)
    ids = np.random.default_rng(1).integers(3, 96, size=24)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m = mlxrun.load(str(d), backend="cuda", dtype="float32", progress=False)
    assert rel_err(m.logits(ids), ref) < 1e-4
    want = hf_greedy(hf, ids, 32)
    assert [t[0] for t in _greedy(m, [ids.tolist()], 32)] == want


@cuda
def test_cuda_graph_session_is_reused(tiny_dir):
    """A second generation of the same shape replays the first one's graph on its cache, with
    the new prompts' padding; another shape captures anew. Tokens equal eager decoding."""
    d, _ = tiny_dir("llama_gqa_tied")
    m = mlxrun.load(str(d), backend="cuda", dtype="float32", progress=False)
    first, second = [[5, 6, 7, 8], [9, 10]], [[9, 10], [5, 6, 7, 8]]
    a = _greedy(m, first, 16)
    s = m.backend._session
    b = _greedy(m, second, 16)
    assert m.backend._session is s and not s.busy
    c = _greedy(m, [[5, 6, 7, 8, 9]], 16)
    assert m.backend._session is not s
    m.backend.cuda_graphs = False
    assert [a, b, c] == [_greedy(m, p, 16) for p in (first, second, [[5, 6, 7, 8, 9]])]


def _graph_vs_eager(transformer, prompts, n=64):
    runs = []
    for graphs in (False, True):
        transformer.be.cuda_graphs = graphs
        runs.append(_tokens(transformer, prompts, n))
    return runs


@cuda
@pytest.mark.parametrize(
    "dtype,quant",
    [("float32", None), ("bfloat16", None)]
    + [("bfloat16", q) for q in ("none", "int8", "fp8", "fp4", "nvfp4")],
)
def test_cuda_graph_equals_eager_smollm2(dtype, quant):
    """None: the GGUF as stored (int4 g32 linears, int8 embedding)."""
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356], [1, 4093, 198, 1780, 314, 260]]
    m = mlxrun.load("smollm2", backend="cuda", dtype=dtype, quant=quant, progress=False)
    eager, graph = _graph_vs_eager(m.transformer, prompts)
    assert graph == eager


@cuda
@pytest.mark.parametrize("quant", ["none", "int4", "fp8", "fp4"])
def test_cuda_graph_equals_eager_8b_shape(quant):
    from mlxrun.bench import build_random, shape_config
    from mlxrun.quant.formats import resolve

    be = TorchBackend("cuda", "bfloat16")
    model = build_random(shape_config("llama3-8b"), be, None if quant == "none" else resolve(quant))
    prompts = [[11, 2000, 31000, 7, 99, 1234, 5], [128000, 42, 17]]
    eager, graph = _graph_vs_eager(model, prompts)
    assert graph == eager


@cuda
def test_cuda_smollm2_logits_match_transformers():
    from transformers import AutoModelForCausalLM

    from mlxrun.loader import bundled_model_path

    g = bundled_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        g.parent, gguf_file=g.name, dtype=torch.float32
    ).eval()
    m = mlxrun.load("smollm2", backend="cuda", dtype="float32", progress=False)
    ids = m.tokenizer.prompt_ids("What is the capital of France?")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(m.logits(ids), ref) < 1e-4
    assert "Paris" in m.generate("What is the capital of France?", max_tokens=32)


def test_backend_flag_controls_graphs():
    assert TorchBackend("cpu").cuda_graphs is False
