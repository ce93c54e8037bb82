"""Launch settings from tables and the environment: quant/gemv4_table.py's batch-1 4-bit
GEMV launches fixed by shape (MLXRUN_GEMV4_LAUNCH) and decode attention's AttnLaunch
(MLXRUN_ATTN_LAUNCH), a malformed value one clear line."""

import types

import pytest

from mlxrun.errors import MlxrunError
from mlxrun.quant import gemv4_table
from mlxrun.quant.triton_launch import choose_config

pytest.importorskip("torch")


def _w(n, k, mode="affine", bits=4, g=64):
    return types.SimpleNamespace(n=n, k=k, bits=bits, group_size=g, mode=mode)


def test_a_table_entry_replaces_the_rules_for_its_shape_only(monkeypatch):
    import torch

    dev = torch.device("cuda")
    monkeypatch.setattr("mlxrun.quant.triton_launch._num_sms", lambda d: 132)

    def pick(m, w, spec):
        monkeypatch.setattr(gemv4_table, "TABLE", gemv4_table.parse(spec))
        return choose_config(m, w, dev)

    entry = "int4:2048x4096=g8w2s2e"
    cfg = pick(1, _w(2048, 4096), entry)
    assert (cfg.kernel, cfg.block_n, cfg.num_warps, cfg.split_k, cfg.early) == (
        "gemv", 8, 2, 2, True,
    )  # fmt: skip
    assert pick(1, _w(2048, 4096), "none") != cfg  # the rules pick another
    # another shape, format or batch keeps the rules' pick
    for m, w in ((1, _w(4096, 4096)), (1, _w(2048, 4096, "mxfp4", 4, 32)), (2, _w(2048, 4096))):
        assert pick(m, w, entry) == pick(m, w, "none")


@pytest.mark.parametrize(
    "spec", ["2048x4096=g8w2s2", "int4:2048=g8w2s2", "int4:2048x4096=g8w3s2", "int8:1x2=g8w1s1"]
)
def test_a_malformed_launch_table_is_one_clear_line(spec, monkeypatch):
    monkeypatch.setenv("MLXRUN_GEMV4_LAUNCH", spec)
    monkeypatch.setattr(gemv4_table, "TABLE", None)
    with pytest.raises(MlxrunError, match="MLXRUN_GEMV4_LAUNCH.*FMT:NxK=LAUNCH"):
        gemv4_table.lookup(_w(2048, 4096))
    monkeypatch.setenv("MLXRUN_GEMV4_LAUNCH", "none")
    monkeypatch.setattr(gemv4_table, "TABLE", None)
    assert gemv4_table.lookup(_w(2048, 4096)) is None


def test_the_attention_launch_from_the_environment(monkeypatch):
    """MLXRUN_ATTN_LAUNCH sets decode attention's AttnLaunch fields; a malformed value is
    one clear line."""
    pytest.importorskip("triton")
    from mlxrun.backends import cuda_attention as ca

    monkeypatch.setattr(ca, "ENV_LAUNCH", None)
    monkeypatch.setenv("MLXRUN_ATTN_LAUNCH", "block=32,per_sm=4")
    assert ca.env_launch() == ca.AttnLaunch(block=32, per_sm=4)
    for bad in ("block32", "blocks=32"):
        monkeypatch.setattr(ca, "ENV_LAUNCH", None)
        monkeypatch.setenv("MLXRUN_ATTN_LAUNCH", bad)
        with pytest.raises(MlxrunError, match="MLXRUN_ATTN_LAUNCH.*AttnLaunch"):
            ca.env_launch()
