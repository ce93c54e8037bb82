"""Tensor parallelism for mixture-of-experts models: every expert split by its intermediate
rows as the dense MLP is, the router replicated. Shards of each stored expert layout
against the whole tensors, and the division rules. The split models themselves run in
tests/test_tp.py's launches (tiny random Qwen3-MoE and gpt-oss, conftest.tiny_moe_dirs)."""

from __future__ import annotations

import numpy as np
import pytest

from mlxrun.config import ModelConfig
from mlxrun.errors import MlxrunError
from mlxrun.moe import MoEOptions, expert_names, fused_experts, stack_per_expert
from mlxrun.shard import (
    check,
    shard_config,
    shard_shapes,
    shard_tensors,
    stored_groups,
    vocab_shard,
)
from mlxrun.weights import load_safetensors


def _cfg(d: str) -> ModelConfig:
    import json
    from pathlib import Path

    return ModelConfig.from_dict(json.loads((Path(d) / "config.json").read_text()))


def _stacked(tensors: dict, cfg: ModelConfig, layer: int) -> dict[str, np.ndarray]:
    """The stacked experts the loader builds from `tensors` ({gate_proj.weight: (E, I, H)
    ...}, packed parts and biases alike), as numpy arrays."""
    t = dict(tensors)
    n = expert_names(cfg.model_type, f"model.layers.{layer}")
    used = set(stack_per_expert(t, n, cfg.moe.num_experts)) | set(fused_experts(t, n))
    pre = n.stacked + "."
    return {
        k[len(pre) :]: np.asarray(v.data)
        for k, v in t.items()
        if k.startswith(pre) and k not in used
    }


@pytest.mark.parametrize(
    "name", ["qwen3_moe", "qwen2_moe", "gpt_oss", "gpt_oss_openai", "gpt_oss_mlx_lm"]
)
def test_expert_shards_are_the_whole_experts_rows(tiny_moe_dirs, name):
    """Each layout's rank slices, stacked as the loader stacks them: gate/up (and their
    biases) are rows [r*I/2, (r+1)*I/2) of every whole expert, down its matching columns
    (packed: whole groups of words and scales); the down bias is rank 0's alone. The plan's
    shapes are the rank's."""
    d = tiny_moe_dirs[name]
    tensors, _ = load_safetensors(f"{d}/model.safetensors")
    cfg = _cfg(d)
    whole = _stacked(tensors, cfg, 0)
    assert whole, name
    I = cfg.moe.intermediate_size  # noqa: E741
    check(cfg, 2, stored_groups(cfg, tensors))
    shapes = shard_shapes({k: (v.shape, v.dtype) for k, v in tensors.items()}, 2, cfg)
    for rank in range(2):
        part = shard_tensors(tensors, 2, rank, vocab_shard(cfg, 2, rank))
        for k, t in part.items():
            assert shapes[k][0] == t.shape, k
        got = _stacked(part, cfg, 0)
        assert got.keys() == whole.keys()
        rows = slice(rank * I // 2, (rank + 1) * I // 2)
        for k, a in got.items():
            w = whole[k]
            if k == "down_proj.bias":
                assert np.array_equal(a, w if rank == 0 else np.zeros_like(w)) and w.any()
            elif k.startswith("down_proj."):  # (E, H, I*bits/32 or I/G): columns
                step = w.shape[-1] // 2
                assert np.array_equal(a, w[..., rank * step : (rank + 1) * step]), k
            else:
                assert np.array_equal(a, w[:, rows]), k
        router = f"model.layers.0.{expert_names(cfg.model_type, '').router[1:]}.weight"
        assert part[router] is tensors[router]  # replicated
        if cfg.moe.shared_intermediate_size:  # split as a dense MLP, its gate replicated
            S = cfg.moe.shared_intermediate_size  # noqa: N806
            p = "model.layers.0.mlp.shared_expert"
            half = slice(rank * S // 2, (rank + 1) * S // 2)
            for k in ("gate_proj", "up_proj"):
                assert np.array_equal(
                    part[f"{p}.{k}.weight"].data, tensors[f"{p}.{k}.weight"].data[half]
                )
            down = tensors[f"{p}.down_proj.weight"].data
            assert np.array_equal(part[f"{p}.down_proj.weight"].data, down[:, half])
            assert part[f"{p}_gate.weight"] is tensors[f"{p}_gate.weight"]
            assert shard_config(cfg, 2).moe.shared_intermediate_size == S // 2


def test_moe_division_rules_name_the_counts_that_work(tiny_moe_dirs):
    """Expert rows must divide by the ranks, and a rank's share of the experts' down inputs
    must be whole quantization groups; the rank's config holds its expert rows."""
    cfg = _cfg(tiny_moe_dirs["qwen3_moe"])
    assert shard_config(cfg, 2).moe.intermediate_size == 32
    assert shard_config(cfg, 2).intermediate_size == 32  # the dense layer's rows
    wide = cfg.replace(num_attention_heads=12, num_key_value_heads=6)
    with pytest.raises(MlxrunError, match=r"^cannot split .*: 40 expert rows \(moe intermediate "
                                          r"size\) do not divide by 3; rank counts that work: 1, 2$"):  # fmt: skip
        check(wide.replace(moe=MoEOptions(4, 2, 40)), 3, set())
    with pytest.raises(
        MlxrunError,
        match=r"the experts' down_proj's 48 inputs a rank are not whole groups of 32; "
        r"rank counts that work: 1, 3 \(or pick a --group-size",
    ):
        check(wide.replace(moe=MoEOptions(4, 2, 96)), 2, {32})
    # OpenAI's MXFP4 down scales count as groups of 32 (64 rows over 4 ranks: 16 a rank)
    d = tiny_moe_dirs["gpt_oss_openai"]
    tensors, _ = load_safetensors(f"{d}/model.safetensors")
    big = _cfg(d).replace(num_attention_heads=8, num_key_value_heads=4)
    assert 32 in stored_groups(big, tensors)
    with pytest.raises(MlxrunError, match=r"down_proj's 16 inputs a rank are not whole groups"):
        check(big, 4, stored_groups(big, tensors))


def test_plan_counts_a_ranks_share_of_the_experts():
    """Qwen3-30B-A3B's shape over 2 ranks: each expert projection holds half its rows (or
    columns), and the plan's weight bytes are the rank's tensors' (int4: 16.01 GiB whole,
    8.02 GiB a rank)."""
    from mlxrun.planning import model_shapes, plan

    cfg, shapes = model_shapes("shape:qwen3-30b-a3b")
    half = shard_shapes(shapes, 2, cfg)
    p = "model.layers.0.mlp.switch_mlp"
    assert half[f"{p}.gate_proj.weight"][0] == (128, 384, 2048)
    assert half[f"{p}.down_proj.weight"][0] == (128, 2048, 384)
    assert half["model.layers.0.mlp.gate.weight"] == shapes["model.layers.0.mlp.gate.weight"]
    rank = plan("shape:qwen3-30b-a3b", backend="cpu", dtype="bfloat16", tp=2, context=1024)
    assert rank.footprint.weight_bytes == sum(2 * int(np.prod(s)) for s, _ in half.values())
    q = [plan("shape:qwen3-30b-a3b", quant="int4", backend="cpu", dtype="bfloat16", tp=n,
              context=1024).footprint.weight_bytes for n in (1, 2)]  # fmt: skip
    assert q[1] == pytest.approx(q[0] / 2, rel=0.01)


def test_shared_expert_division_rules():
    """Qwen2-MoE's shared expert splits as a dense MLP: its rows must divide by the ranks,
    and a rank's share of its down inputs must be whole quantization groups."""
    cfg = ModelConfig(
        model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
        moe=MoEOptions(num_experts=4, top_k=2, intermediate_size=64, shared_intermediate_size=96),
    )  # fmt: skip
    check(cfg, 2, set())
    with pytest.raises(
        MlxrunError,
        match=r"the shared expert's down_proj's 48 inputs a rank are not whole groups of 32; "
        r"rank counts that work: 1 \(or pick",
    ):
        check(cfg, 2, {32})
    odd = cfg.replace(moe=MoEOptions(4, 2, 64, shared_intermediate_size=90))
    with pytest.raises(MlxrunError, match=r": 90 shared expert rows .* do not divide by 4;"):
        check(odd.replace(num_key_value_heads=4), 4, set())


def _gguf_experts(path: str, shard=None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The config and layer 0's stacked expert tensors of a GGUF, as the import converts
    them (a rank's slices with `shard` = (ranks, rank)); a shared expert's under
    "shared.*"."""
    from mlxrun.gguf import read_gguf

    g = read_gguf(path, shard)
    cfg = ModelConfig.from_dict(g.config)
    n = expert_names(cfg.model_type, "model.layers.0")
    if n.shared:
        for k in list(g.tensors):
            if k.startswith((n.shared + ".", n.shared_gate + ".")):
                g.tensors[n.stacked + ".shared." + k[len(n.shared) :].lstrip(".")] = g.tensors[k]
    pre = n.stacked + "."
    return cfg, {k[len(pre) :]: np.asarray(v.data) for k, v in g.tensors.items() if k.startswith(pre)}  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss", "qwen2moe"])
def test_gguf_expert_shards_are_the_whole_experts_rows(moe_ggufs, name):
    """A GGUF's stacked experts cut from the file's blocks before they are unpacked: Q4_K,
    F16, Q8_0 (qwen3moe) and MXFP4 (gpt-oss, with biases) rank slices are rows [r*I/2,
    (r+1)*I/2) of every expert's gate/up (and their biases) and the matching columns of
    down (whole blocks); the down bias is rank 0's alone. A shared expert (qwen2moe) splits
    as a dense MLP, its gate (1, hidden) whole on every rank."""
    cfg, whole = _gguf_experts(moe_ggufs[name])
    I = cfg.moe.intermediate_size  # noqa: E741
    kinds = {k.split(".")[-1] for k in whole}
    assert {"weight", "scales"} <= kinds and ("bias" in kinds) == (name == "gpt-oss")
    for rank in range(2):
        _, got = _gguf_experts(moe_ggufs[name], (2, rank))
        assert got.keys() == whole.keys()
        for k, a in got.items():
            w = whole[k]
            if k == "down_proj.bias":
                assert np.array_equal(a, w if rank == 0 else np.zeros_like(w)) and w.any()
            elif k.startswith(("down_proj.", "shared.down_proj.")):
                step = w.shape[-1] // 2
                assert np.array_equal(a, w[..., rank * step : (rank + 1) * step]), k
            elif k.startswith("shared._gate"):  # the shared expert_gate (1, hidden)
                assert np.array_equal(a, w), k
            elif k.startswith("shared."):  # gate/up (S, ...): rows
                step = w.shape[0] // 2
                assert np.array_equal(a, w[rank * step : (rank + 1) * step]), k
            else:
                assert np.array_equal(a, w[:, rank * I // 2 : (rank + 1) * I // 2]), k
        assert any(k.startswith("shared.") for k in got) == (name == "qwen2moe")


def test_gguf_k_quant_down_needs_whole_blocks_a_rank(tmp_path):
    """Q4_K experts' down over two ranks: 256 inputs an expert are one 256-value block, so
    a rank's 128 would cut it: one line naming the tensor and what is needed."""
    from .test_gguf_moe import _hf_random, write_moe_gguf

    path = tmp_path / "k.gguf"
    write_moe_gguf(path, "qwen3moe", _hf_random("qwen3moe"), {"ffn_down_exps": "Q4_K"})
    with pytest.raises(MlxrunError, match=r"^model\.layers\.0\.mlp\.switch_mlp\.down_proj\.weight: "
                       r"its 256 inputs are stored in GGUF Q4_K blocks of 256 values, and 256 / 2 "
                       r"ranks = 128 inputs a rank is not whole blocks; split it over a rank count "
                       r"that gives multiples of 256 inputs"):  # fmt: skip
        _gguf_experts(str(path), (2, 0))
