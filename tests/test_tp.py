"""Tensor parallelism: shards against the whole tensors, the division rules, and models
split over two (or three) processes started by the platforms' launchers (torchrun with
gloo, mlx.launch with the ring backend on loopback), whose logits and greedy text must
equal the one-process run's (mixture-of-experts models among them: one launch a test, as
starting the ranks costs more than running them; their shards: tests/test_tp_moe.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import mlxrun
from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError
from mlxrun.shard import (
    VocabShard,
    check,
    shard_config,
    shard_shapes,
    shard_tensors,
    split_axis,
    vocab_shard,
    working_counts,
)
from mlxrun.weights import Tensor, load_safetensors

from .conftest import SMOLLM2, TINY, rel_err, write_random
from .tp_worker import load_job

WORKER = Path(__file__).with_name("tp_worker.py")
IDS = [1, 5, 9, 14, 30, 7, 3, 41]
PROMPT = "w5 w9 w14 w30"


def _cfg(**kw) -> ModelConfig:
    base = dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=100,
    )
    return ModelConfig.from_dict(base | kw)


def test_division_rules_name_the_counts_that_work():
    smol = _cfg()  # SmolLM2-135M: 9 heads, 3 KV heads, head_dim 64, 1536 MLP rows
    with pytest.raises(MlxrunError, match=r"9 attention heads and 3 KV heads do not divide by 2"):
        check(smol, 2, {32})
    with pytest.raises(MlxrunError, match=r"rank counts that work: 1, 3$"):
        check(smol, 2, {32})
    check(smol, 3, {32})  # 3 heads, 1 KV head, 512 MLP rows a rank; o: 192 inputs
    assert working_counts(smol, {32}) == [1, 3]
    # o_proj's inputs a rank (heads x head_dim) must be whole groups: 3 x 64 = 192 is not 128k
    with pytest.raises(
        MlxrunError, match=r"o_proj's 192 inputs a rank are not whole groups of 128"
    ):
        check(smol, 3, {128})
    # more ranks than KV heads: refused, not replicated
    one_kv = _cfg(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1
    )
    with pytest.raises(
        MlxrunError, match=r"1 KV heads do not divide by 2; rank counts that work: 1$"
    ):
        check(one_kv, 2, set())
    r = shard_config(smol, 3)
    assert (r.num_attention_heads, r.num_key_value_heads, r.intermediate_size, r.head_dim) == (
        3,
        1,
        512,
        64,
    )


def test_shards_are_views_and_quantized_columns_are_whole_groups(tmp_path):
    """Row and column shards are views of the memory map (no bytes read), and a packed
    matrix's column shard dequantizes to exactly those columns of the whole matrix."""
    from mlxrun.quant.formats import QuantSpec
    from mlxrun.quant.reference import dequantize, quantize
    from mlxrun.weights import save_safetensors

    rng = np.random.default_rng(0)
    spec = QuantSpec("affine", 4, 32)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    q = quantize(w, spec)
    packed, scales, biases = q["weight"], q["scales"], q["biases"]
    p = "model.layers.0.mlp.down_proj"
    save_safetensors(
        tmp_path / "m.safetensors",
        {
            f"{p}.weight": Tensor.from_numpy(packed),
            f"{p}.scales": Tensor.from_numpy(scales),
            f"{p}.biases": Tensor.from_numpy(biases),
            "model.layers.0.self_attn.q_proj.weight": Tensor.from_numpy(w),
            "model.norm.weight": Tensor.from_numpy(w[0]),
        },
    )
    tensors, _ = load_safetensors(tmp_path / "m.safetensors")
    whole = dequantize(packed, scales, biases, spec)
    for rank in range(2):
        s = shard_tensors(tensors, 2, rank)
        for name, t in s.items():
            assert np.shares_memory(t.data, tensors[name].data), name
        q = s["model.layers.0.self_attn.q_proj.weight"].data
        assert np.array_equal(q, w[rank * 4 : rank * 4 + 4])
        cols = slice(rank * 128, rank * 128 + 128)
        got = dequantize(
            np.ascontiguousarray(s[f"{p}.weight"].data),
            np.ascontiguousarray(s[f"{p}.scales"].data),
            np.ascontiguousarray(s[f"{p}.biases"].data),
            spec,
        )
        assert np.array_equal(got, whole[:, cols])
        assert s["model.norm.weight"] is tensors["model.norm.weight"]
    assert [split_axis(n) for n in (f"{p}.scales", "model.layers.3.self_attn.k_proj.bias")] == [
        -1,
        0,
    ]


def test_vocab_split_rule_and_padded_rows(tmp_path):
    """The embedding and head split by vocabulary rows when vocab > hidden (replicated
    otherwise); a vocabulary that does not divide is padded to a multiple of the ranks with
    zero rows. Whole rows are views of the memory map; a packed head's rank rows
    dequantize to exactly those rows of the whole matrix, the padding to zeros."""
    from mlxrun.quant.formats import QuantSpec
    from mlxrun.quant.reference import dequantize, quantize
    from mlxrun.weights import save_safetensors

    def small(vocab):
        return _cfg(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)

    assert vocab_shard(small(64), 2, 1) is None  # vocab <= hidden: replicated
    assert vocab_shard(small(100), 1, 0) is None
    assert vocab_shard(small(97), 2, 1) == VocabShard(97, 49, 49)
    assert vocab_shard(small(97), 3, 2) == VocabShard(97, 33, 66)
    rng = np.random.default_rng(0)
    spec = QuantSpec("affine", 4, 32)
    V, H = 97, 64
    emb = rng.standard_normal((V, H)).astype(np.float32)
    q = quantize(rng.standard_normal((V, H)).astype(np.float32), spec)
    save_safetensors(
        tmp_path / "m.safetensors",
        {"model.embed_tokens.weight": Tensor.from_numpy(emb)}
        | {f"lm_head.{k}": Tensor.from_numpy(q[k]) for k in ("weight", "scales", "biases")},
    )
    tensors, _ = load_safetensors(tmp_path / "m.safetensors")
    whole = dequantize(q["weight"], q["scales"], q["biases"], spec)
    cfg = small(V)
    for rank, n in ((0, 33), (1, 33), (2, 31)):  # 97 over 3: 33 rows a rank, 2 padding
        v = vocab_shard(cfg, 3, rank)
        s = shard_tensors(tensors, 3, rank, v)
        e = s["model.embed_tokens.weight"].data
        assert e.shape == (33, H)
        assert np.array_equal(e[:n], emb[v.start : v.start + n]) and not e[n:].any()
        if n == 33:
            assert np.shares_memory(e, tensors["model.embed_tokens.weight"].data)
        got = dequantize(*(np.ascontiguousarray(s[f"lm_head.{k}"].data) for k in ("weight", "scales", "biases")), spec)  # fmt: skip
        assert np.array_equal(got[:n], whole[v.start : v.start + n]) and not got[n:].any()
    # the plan counts a rank's rows: Llama-3-8B's 128256 over 2 is 64128 a rank
    from mlxrun.planning import model_shapes, plan

    big, shapes = model_shapes("shape:llama3-8b")
    shapes = shard_shapes(shapes, 2, big)
    assert shapes["model.embed_tokens.weight"][0] == shapes["lm_head.weight"][0] == (64128, 4096)
    p = plan("shape:llama3-8b", backend="cpu", dtype="bfloat16", tp=2, context=1024)
    assert p.footprint.weight_bytes == sum(2 * int(np.prod(s)) for s, _ in shapes.values())


def test_gguf_rank_reads_its_vocabulary_rows(tmp_path):
    """A GGUF's Q4_1 embedding and Q8_0 head (SmolLM2's block types), 97 rows over 2 ranks:
    each rank's rows, cut from the file's blocks before they are unpacked, dequantize to
    those rows of the whole table (gguf's dequantize), the last rank's padding to zeros."""
    import gguf

    from mlxrun.gguf.names import arch_of
    from mlxrun.gguf.tensors import convert
    from mlxrun.quant import gguf_blocks as gb
    from mlxrun.quant.formats import QuantSpec
    from mlxrun.quant.reference import dequantize

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(1)
    path, want = tmp_path / "vocab.gguf", {}
    w = gguf.GGUFWriter(str(path), "llama")
    for name, q in (("token_embd.weight", Q.Q4_1), ("output.weight", Q.Q8_0)):
        blocks = gguf.quants.quantize(rng.standard_normal((97, 64)).astype(np.float32), q)
        w.add_tensor(name, blocks, raw_dtype=q)
        want[name] = gguf.quants.dequantize(blocks, q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    cfg = _cfg(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    for rank, n in ((0, 49), (1, 48)):
        v = vocab_shard(cfg, 2, rank)
        part = convert(path, raw, {}, arch_of(path, "llama"), (2, rank), (), v)[0]
        for hf, name in (("model.embed_tokens", "token_embd.weight"), ("lm_head", "output.weight")):
            t = {k: part[f"{hf}.{k}"] for k in ("weight", "scales", "biases")}
            assert t["weight"].shape[0] == 49
            spec = QuantSpec("affine", gb.AFFINE[raw[name].tensor_type.name][0], 32)
            got = dequantize(t["weight"].data, t["scales"].float32(), t["biases"].float32(), spec)
            np.testing.assert_allclose(got[:n], want[name][v.start : v.start + n], rtol=1e-6)
            assert not got[n:].any()


def _torchrun(n: int) -> list[str]:
    # --standalone: a free port of its own, so concurrent runs on one host do not collide
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
    ]


def _mlx_launch(n: int) -> list[str]:
    exe = shutil.which("mlx.launch")
    if exe is None:
        pytest.skip("mlx.launch is not on PATH")
    return [exe, "--python", sys.executable, "-n", str(n), "--backend", "ring"]


def _env() -> dict:
    # one thread a rank (torchrun sets it too): two ranks on two cores
    return os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run_split(launch: list[str], jobs: list[dict], out: Path) -> None:
    out.mkdir()
    r = subprocess.run(
        [*launch, str(WORKER), json.dumps(jobs), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr[-3000:]


def _compare(jobs: list[dict], out: Path) -> None:
    for i, job in enumerate(jobs):
        m = load_job(job)  # the same load, in this one process
        ranks = sorted(out.glob(f"{i}.rank*.rows"))
        v = vocab_shard(m.config, len(ranks), 0)
        want = [m.config.vocab_size if v is None else v.rows] * 2  # embedding, head
        assert [json.loads(p.read_text()) for p in ranks] == [want] * len(ranks), job
        assert rel_err(np.load(out / f"{i}.npy"), m.logits(job["ids"])) <= 1e-5, job
        o = m.config.moe
        if o is not None:  # each rank held its share of every expert's rows
            got = [json.loads(p.read_text()) for p in sorted(out.glob(f"{i}.rank*.experts"))]
            want = [o.num_experts, o.intermediate_size // len(ranks), m.config.hidden_size]
            assert got == [want] * len(ranks), job
        texts = {p.read_text() for p in out.glob(f"{i}.rank*.txt")}
        assert texts == {(out / f"{i}.txt").read_text()}, job  # every rank drew the same
        if job.get("temperature"):
            continue  # sampled with a seed rank 0 drew: no one-process twin
        text = m.generate(job["prompt"], max_tokens=job["max_tokens"], chat=False)
        assert (out / f"{i}.txt").read_text() == text, job


def _jobs(tiny_dir, backend: str, cases) -> list[dict]:
    return [
        dict(
            model=str(tiny_dir(name)[0]),
            backend=backend,
            ids=IDS,
            prompt=PROMPT,
            max_tokens=8,
            **quant,
        )
        for name, quant in cases
    ]


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    """tied -> a tiny llama whose vocabulary (97) does not divide by 2 ranks: the last
    rank's rows end in a zero row whose logit is cut after the gather."""
    root = tmp_path_factory.mktemp("odd_vocab")
    out = {}
    for tied in (True, False):
        kw = dict(TINY["llama_gqa_tied"], vocab_size=97, tie_word_embeddings=tied)
        kw.pop("model_type")
        out[tied] = str(write_random(root / f"tied{tied}", "llama", kw, seed=3)[0])
    return out


def _odd_jobs(odd_vocab, backend: str, cases) -> list[dict]:
    return [
        dict(model=odd_vocab[tied], backend=backend, ids=[*IDS, 96], prompt=PROMPT + " w96",
             max_tokens=8, **quant)
        for tied, quant in cases
    ]  # fmt: skip


def _moe_jobs(tiny_moe_dirs, backend: str, cases) -> list[dict]:
    return _jobs(lambda name: (tiny_moe_dirs[name],), backend, cases)


def test_gloo_two_ranks_equal_one_process(tiny_dir, odd_vocab, tiny_moe_dirs, moe_ggufs, tmp_path):
    """Dense GQA with a tied head, int4 g32 quantized on load, and q/k/v biases (qwen2);
    a vocabulary of 97 (padded to 98) with an untied int4 head. Mixture-of-experts, every
    expert's rows split: Qwen3-MoE int4 g32 (a rank's slices quantized on load), gpt-oss
    (biases, sinks, the clamped SwiGLU) dense in transformers' fused layout and in
    OpenAI's stored MXFP4; Qwen2-MoE int4 g32 (a shared expert); a qwen3moe GGUF whose
    experts (Q4_K gate, F16 up, Q8_0 down) are cut from the file's blocks (gpt-oss's MXFP4
    GGUF experts: their slices in tests/test_tp_moe.py)."""
    jobs = (
        _jobs(
            tiny_dir,
            "cpu",
            [
                ("llama_gqa_tied", {}),
                ("llama_gqa_tied", {"quant": "int4", "group_size": 32}),
                ("qwen2_bias", {}),
            ],
        )
        + _odd_jobs(odd_vocab, "cpu", [(False, {"quant": "int4", "group_size": 32})])
        + _moe_jobs(
            tiny_moe_dirs,
            "cpu",
            [
                ("qwen3_moe", {"quant": "int4", "group_size": 32}),
                ("gpt_oss", {}),
                ("gpt_oss_openai", {}),
                ("qwen2_moe", {"quant": "int4", "group_size": 32}),
            ],
        )
        + _moe_jobs(moe_ggufs, "cpu", [("qwen3moe", {})])
    )
    _run_split(_torchrun(2), jobs, tmp_path / "out")
    _compare(jobs, tmp_path / "out")


def test_mlx_ring_two_ranks_equal_one_process(tiny_dir, odd_vocab, tiny_moe_dirs, tmp_path):
    """Dense with an untied head and q/k norms (qwen3, head_dim 32), int4 g64, and sampled
    text (temperature 1, no seed) that all ranks must agree on; a vocabulary of 97 (padded
    to 98) with a tied dense head. Mixture-of-experts: Qwen3-MoE dense (mx.gather_mm over
    a rank's rows), gpt-oss's MXFP4 experts in mlx-lm's stacked layout (gather_qmm), and
    Qwen2-MoE dense (the shared expert's partial joins the experts' in one all_sum)."""
    pytest.importorskip("mlx.core")
    jobs = (
        _jobs(
            tiny_dir,
            "mlx",
            [
                ("qwen3_qknorm", {}),
                ("qwen3_qknorm", {"quant": "int4"}),
                ("qwen3_qknorm", {"temperature": 1.0}),  # no seed given: the ranks share one
            ],
        )
        + _odd_jobs(odd_vocab, "mlx", [(True, {})])
        + _moe_jobs(
            tiny_moe_dirs, "mlx", [("qwen3_moe", {}), ("gpt_oss_mlx_lm", {}), ("qwen2_moe", {})]
        )
    )
    _run_split(_mlx_launch(2), jobs, tmp_path / "out")
    _compare(jobs, tmp_path / "out")


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_three_ranks_equal_one_process(tmp_path):
    """The bundled GGUF (Q4_1, loaded as affine 4-bit g32), and expanded to float32
    (--quant none), over 3 gloo ranks: 3 heads, 1 KV head, 512 MLP rows and 16384
    vocabulary rows a rank (2 ranks do not divide its 9 heads). gloo, not the ring: on two
    cores three ring ranks spent 73 s of CPU (24 s of it system time) where gloo's three
    spent 47 s."""
    job = dict(
        model=SMOLLM2,
        backend="cpu",
        ids=[1, 504, 3458, 282, 2241, 314, 4649, 47],
        prompt="The capital of France is",
        max_tokens=6,
    )
    jobs = [job, job | {"quant": "none"}]
    _run_split(_torchrun(3), jobs, tmp_path / "out")
    for i in range(len(jobs)):
        assert (tmp_path / "out" / f"{i}.txt").read_text().startswith(" Paris")
    _compare(jobs, tmp_path / "out")


GENERATE = ["-m", "mlxrun", "generate", "--dtype", "float32", "--no-chat", "--max-tokens", "6"]


@pytest.mark.long  # ~9 s: two torchrun processes; the gloo and ring tests stay by default
def test_cli_under_torchrun_prints_once(tiny_dir):
    """`torchrun -m mlxrun generate`: rank 0 alone prints, the one-process answer."""
    d = str(tiny_dir("llama_gqa_tied")[0])
    m = mlxrun.load(d, backend="cpu", dtype="float32", progress=False)
    want = m.generate(PROMPT, max_tokens=6, chat=False)
    r = subprocess.run(
        [*_torchrun(2), *GENERATE, "-b", "cpu", "-p", PROMPT, "--model", d],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == want + "\n" and want.strip()
    assert r.stderr.count("Backend:") == 1 and "tensor parallel rank 0 of 2 (gloo)" in r.stderr


def test_error_on_split_ends_every_rank_with_one_line(tiny_dir):
    """A model that does not split over 2 ranks (1 KV head): one error line, the ranks
    exit with status 1, nothing hangs."""
    pytest.importorskip("mlx.core")
    bad = str(tiny_dir("llama3_untied_scaled")[0])
    r = subprocess.run(
        [*_mlx_launch(2), "--", *GENERATE, "-b", "mlx", "-p", PROMPT, "--model", bad],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert out.count("mlxrun: error:") == 1, out[-3000:]
    assert "1 KV heads do not divide by 2; rank counts that work: 1" in out
    # mlx.launch reports each rank that exits by itself; it ends any rank still running
    # once one has failed, so the second report may be missing (or carry its signal)
    assert "exited with code 1" in out, out[-3000:]


@pytest.mark.long  # ~9 s: two server ranks under torchrun
def test_serve_over_two_ranks_answers_as_one_process(tiny_dir):
    """`torchrun -m mlxrun serve` (gloo): rank 0 serves, both ranks step together; three
    concurrent clients each get the one-process greedy text; SIGTERM to the launcher ends
    it without a hang (the follower waits for rank 0's stop)."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from tests.test_serve import free_port, wait_ready  # noqa: PLC0415

    d = str(tiny_dir("llama_gqa_tied")[0])
    m = mlxrun.load(d, backend="cpu", dtype="float32", progress=False)
    prompts = [PROMPT, "a b c", PROMPT + " and more of the same words"]
    want = [m.generate(p, max_tokens=6, chat=False) for p in prompts]
    port = free_port()
    cmd = [*_torchrun(2), "-m", "mlxrun", "serve", "--model", d, "-b", "cpu", "--dtype",
           "float32", "--port", str(port), "--max-batch", "2", "--context", "128"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask(p):
            r = c.completions.create(model=d, prompt=p, max_tokens=6, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(3) as pool:  # 3 clients, 2 slots: one waits, then joins
            got = list(pool.map(ask, prompts))
        assert got == want
        assert httpx.get(url + "/health").json()["running"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the ranks did not exit within 90 s of SIGTERM")
    # torchrun itself ends with a traceback of its own after forwarding SIGTERM; the ranks
    # must have shut down cleanly (rank 0's server finished, no engine error)
    assert "Finished server process" in out and "engine error" not in out, out[-3000:]
