"""Decode attention's launch from the environment (MLXRUN_ATTN_LAUNCH), a malformed value
one clear line."""

import pytest

from mlxrun.errors import MlxrunError

pytest.importorskip("torch")


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
