"""The bench instrument on a tiny random shape: every number finite and positive, bytes per
token against a count by hand from the config, the transformers peer on the same shapes,
skip reasons, JSON and PNG output, and the user errors."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import numpy as np
import pytest

from mlxrun import bench, bench_models, bench_timing
from mlxrun.bench import build_random, format_report, run_bench, shape_config
from mlxrun.errors import MlxrunError
from mlxrun.quant.formats import resolve

QUANTS = ["none", "int4", "fp4"]
PROMPT, GEN = 16, 8


def _cuda_error() -> str | None:
    """get_backend's own message for cuda on this machine (None where CUDA exists)."""
    from mlxrun.backends import get_backend

    try:
        get_backend("cuda")
    except MlxrunError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench_timing.COPY_BYTES, "cpu", 32 << 20)  # a smaller copy keeps the test fast
        r = run_bench(
            "shape:tiny",
            ["cpu", "mlx", "cuda"],
            QUANTS,
            prompt_tokens=PROMPT,
            gen_tokens=GEN,
            reps=2,
            compare=["transformers"],
            json_path=d / "bench.json",
            progress=False,
        )
    return r, d


def _tiny_bytes_per_token(quant: str) -> int:
    """Bytes one decode step reads for shape:tiny in float32, batch 1, counted by hand.

    hidden 64, intermediate 128, 2 layers, 4 heads x 16, 2 KV heads x 16, vocab 512, untied.
    """
    mat = {  # bytes of one (out, in) matrix
        "none": lambda o, i: o * i * 4,  # float32
        "int4": lambda o, i: o * i // 2 + 2 * o * (i // 64) * 4,  # codes + f32 scale, bias / 64
        "fp4": lambda o, i: o * i // 2 + o * (i // 32),  # mxfp4: codes + uint8 E8M0 scale / 32
    }[quant]
    layer = (
        mat(64, 64)  # q_proj: 4 heads x 16 = 64 outputs
        + 2 * mat(32, 64)  # k_proj, v_proj: 2 KV heads x 16 = 32 outputs
        + mat(64, 64)  # o_proj
        + 2 * mat(128, 64)  # gate_proj, up_proj
        + mat(64, 128)  # down_proj
        + 2 * 64 * 4  # two RMSNorm weights, float32
    )
    head = mat(512, 64)  # untied lm_head, read in full
    embed_row = mat(512, 64) // 512  # the untied embedding: only the gathered row
    final_norm = 64 * 4
    # KV: 2 layers x (K, V) x 2 KV heads x 16 x 4 bytes, over a mean context of 16 + 8/2 = 20
    kv = 2 * 2 * 2 * 16 * 4 * (PROMPT + GEN // 2)
    return 2 * layer + final_norm + head + embed_row + kv


def test_bytes_per_token_by_hand():
    assert _tiny_bytes_per_token("none") == 437_760  # the same sum, written out once
    assert _tiny_bytes_per_token("int4") == 78_120
    assert _tiny_bytes_per_token("fp4") == 68_130


def test_every_row_measured_and_finite(report):
    r, _ = report
    got = [(row.backend, row.quant) for row in r.rows]
    ran = ["cpu", "mlx"] + ([] if _cuda_error() else ["cuda"])
    want = [(b, q) for b in ran for q in QUANTS] + [("transformers", "none")]
    assert got == want
    for row in r.rows:
        nums = [
            row.load_s, row.ttft_ms, row.prefill_tps, row.decode_tps, row.decode_tps_min,
            row.decode_tps_max, row.peak_memory_bytes, row.weight_bytes,
            row.weight_bytes_per_step, row.kv_bytes_per_step, row.bytes_per_token,
            row.bandwidth_Bps, row.roofline, *row.decode_tps_reps, *row.ttft_ms_reps,
        ]  # fmt: skip
        assert all(math.isfinite(x) and x > 0 for x in nums), (row.backend, row.quant, nums)
        assert len(row.decode_tps_reps) == 2 and len(row.ttft_ms_reps) == 2
        assert row.decode_tps_min <= row.decode_tps <= row.decode_tps_max
        assert row.prefill_tps == pytest.approx(PROMPT / (row.ttft_ms / 1e3))
        assert row.roofline == pytest.approx(
            row.decode_tps * row.bytes_per_token / row.bandwidth_Bps
        )
        # rows on one memory share its best copy bandwidth (torch's and MLX's CPU copies differ)
        same = [b["median_Bps"] for b in r.bandwidth.values() if b["memory"] == row.memory]
        assert row.bandwidth_Bps == max(same)


def test_bytes_per_token_match_the_config(report):
    r, _ = report
    for row in r.rows:
        assert row.bytes_per_token == _tiny_bytes_per_token(row.quant), (row.backend, row.quant)
    # transformers counts its own parameters: the same bytes as ours for the same shapes
    hf = r.rows[-1]
    assert hf.engine == "transformers" and hf.weights == "float32"
    # held = per step read - the gathered row + the whole untied embedding (512 x 64 x 4)
    dense = next(row for row in r.rows if row.quant == "none")
    assert dense.weight_bytes == dense.weight_bytes_per_step - 256 + 512 * 64 * 4
    assert hf.weight_bytes == dense.weight_bytes


def test_skips_cuda_with_its_reason(report):
    r, _ = report
    reason = _cuda_error()
    if reason is None:
        pytest.skip("CUDA is available here")
    assert [(s.backend, s.quant, s.reason) for s in r.skipped] == [("cuda", "*", reason)]
    text = format_report(r)
    assert f"skipped cuda: {reason}" in text
    for col in ("TTFT ms", "prefill tok/s", "decode tok/s", "peak GB", "roofline %"):
        assert col in text
    assert "int4 g64" in text and "mxfp4" in text


def test_json_holds_every_number(report):
    r, d = report
    data = json.loads((d / "bench.json").read_text())
    assert data["settings"]["prompt_tokens"] == PROMPT and data["settings"]["reps"] == 2
    assert len(data["rows"]) == len(r.rows)
    for got, row in zip(data["rows"], r.rows, strict=True):
        assert got["decode_tps_reps"] == row.decode_tps_reps
        assert got["bytes_per_token"] == row.bytes_per_token
        assert got["roofline"] == row.roofline
    assert {"torch:cpu", "mlx:cpu"} <= set(data["bandwidth"])
    assert [s["backend"] for s in data["skipped"]] == ([] if _cuda_error() is None else ["cuda"])
    assert not list(d.glob(".*tmp"))  # the temporary file was renamed, not left behind


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
@pytest.mark.parametrize("quant", ["none", "int4", "fp8", "fp4", "nvfp4"])
def test_random_shape_model_is_sane(backend, quant):
    """Random packed weights decode to small finite values and the logits stay finite."""
    from mlxrun.backends import get_backend

    be = get_backend(backend, "float32")
    spec = None if quant == "none" else resolve(quant)
    m = build_random(shape_config("shape:tiny"), be, spec)
    w = m.layers[0].gate_proj
    dense = be.to_numpy(w if spec is None else be.dequantize(w))
    assert dense.shape == (128, 64)
    assert np.isfinite(dense).all() and 0 < dense.std() < 0.2 and np.abs(dense).max() < 1.5
    ids = np.arange(PROMPT).reshape(1, -1)
    logits = be.to_numpy(m(be.ids(ids), m.make_cache(1, PROMPT)))
    assert logits.shape == (1, PROMPT, 512) and np.isfinite(logits).all()


# Parameter counts published for the real models these shapes copy.
@pytest.mark.parametrize(
    "name, params",
    [
        ("llama3-8b", 8_030_261_248),
        ("llama3.1-8b", 8_030_261_248),
        ("llama3-1b", 1_235_814_400),
        ("smollm2", 134_515_008),
    ],
)
def test_shapes_match_the_real_models(name, params):
    c = shape_config(name)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H
    total = V * H + c.num_hidden_layers * layer + H + (0 if c.tie_word_embeddings else V * H)
    assert total == params


def test_errors():
    with pytest.raises(MlxrunError, match="shape:llama3-8b"):
        run_bench("shape:llama9", ["cpu"], ["none"], progress=False)
    with pytest.raises(MlxrunError, match="--reps must be at least 1"):
        run_bench("shape:tiny", ["cpu"], ["none"], reps=0, progress=False)
    with pytest.raises(MlxrunError, match="--gen-tokens"):
        run_bench("shape:tiny", ["cpu"], ["none"], gen_tokens=1, progress=False)
    with pytest.raises(MlxrunError, match="--compare"):
        run_bench("shape:tiny", ["cpu"], ["none"], compare=["vllm"], progress=False)
    with pytest.raises(MlxrunError, match="unknown quantization format"):
        run_bench("shape:tiny", ["cpu"], ["int3"], progress=False)
    with pytest.raises(MlxrunError, match="unknown backend"):
        run_bench("shape:tiny", ["tpu"], ["none"], progress=False)


def test_no_runnable_backend_names_each_reason():
    reason = _cuda_error()
    if reason is None:
        pytest.skip("CUDA is available here")
    with pytest.raises(MlxrunError, match="nothing could be measured") as e:
        run_bench("shape:tiny", ["cuda", "mps"], ["none"], progress=False)
    assert reason in str(e.value) and "mps" in str(e.value)


def test_stored_quantized_source_skips_other_formats():
    """A checkpoint stored Q4_1 (the bundled GGUF's block, written here to skip the slow
    GGUF open): none and int4 run, fp8 would round the weights twice and says what runs."""
    stored = {"group_size": 32, "bits": 4, "mode": "affine"}
    src = bench_models._Source("smollm2", False, shape_config("smollm2"), "x.gguf", stored)
    assert bench._stored_skip(src, None) is None
    assert bench._stored_skip(src, resolve("int4")) is None  # runs as stored, g32 kept
    assert bench._stored_skip(src, resolve("fp8")) == (
        "the checkpoint is stored quantized (affine 4-bit g32): it runs as stored under int4 "
        "and dequantized under none; re-quantizing it to fp8 (mxfp8) would round the weights "
        "twice"
    )
    src3 = dataclasses.replace(src, stored={"group_size": 64, "bits": 3})
    assert bench._stored_skip(src3, resolve("int4")).startswith(
        "the checkpoint is stored quantized (affine 3-bit g64): it runs dequantized under none;"
    )


def test_stored_quantized_source_as_stored_and_dequantized():
    """What `--quant int4` and `--quant none` run for the bundled Q4_1 GGUF: the stored
    packing (int4 g32 layers, a Q8_0 tied embedding), and the same model expanded to
    float32, which gives the same logits; bytes counted by hand from SmolLM2's shapes."""
    from mlxrun.api import load

    stored = load("smollm2", backend="mlx", progress=False).transformer
    dense = bench_models._dequantized(stored)
    assert bench_models._weights_label(stored, "stored") == "int4 g32, head int8 g32 (stored)"
    assert bench_models._weights_label(dense) == "float32"
    assert dense.head is dense.embed  # tied: one array, read once
    # per layer 576x576 (q, o), 192x576 (k, v), 1536x576 (gate, up), 576x1536 (down)
    layer_params = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536
    embed_params, norms = 49152 * 576, (30 * 2 + 1) * 576 * 4
    # int4 g32: half a byte + a float32 scale and bias per 32; Q8_0: a byte + the same
    packed = 30 * layer_params * (0.5 + 8 / 32) + embed_params * (1 + 8 / 32) + norms
    assert bench.weight_bytes(stored) == (packed, packed) == (115_156_224, 115_156_224)
    assert bench.weight_bytes(dense) == (134_515_008 * 4,) * 2  # every parameter in float32
    be = stored.be
    ids = be.ids(np.array([[1, 504, 3458, 282, 4649, 314, 5125, 47]]))
    a = be.to_numpy(stored(ids, stored.make_cache(1, 8)))
    b = be.to_numpy(dense(ids, dense.make_cache(1, 8)))
    np.testing.assert_allclose(b, a, atol=1e-3 * np.abs(a).max())
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_plot(report, tmp_path, monkeypatch):
    r, _ = report
    pytest.importorskip("matplotlib")
    bench.plot_report(r, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(MlxrunError, match="pip install matplotlib"):
        bench.plot_report(r, tmp_path / "again.png")
    with pytest.raises(MlxrunError, match="pip install matplotlib"):
        run_bench("shape:tiny", ["cpu"], ["none"], plot_path=tmp_path / "x.png", progress=False)
