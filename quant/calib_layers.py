"""The model run one decoder layer at a time, for calibrated quantization (quant/calibrate.py
quantizes each layer from what it records here; quant/mixed_bits.py measures each linear's
sensitivity through the same pass).

A Layer is built from float32 numpy weights (`_layer`) and run over the calibration windows'
residual stream on any backend, through the model's own `Transformer.block` (`_run`). A
recording backend (`_Recorder`) keeps the input of every linear it runs, and `_Stats` reduces
them to what the searches need: H = X^T X, mean |x| per channel and a spread of input rows.
"""

from __future__ import annotations

import numpy as np

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Recorder:
    """The backend, recording the input of each linear it runs (keyed by the weight's id)
    as float32 numpy, so one pass of `Transformer.block` yields every linear's inputs."""

    def __init__(self, be):
        self._be, self.seen = be, {}

    def __getattr__(self, name):
        return getattr(self._be, name)

    def _keep(self, w, x) -> None:
        x = self._be.to_numpy(x)
        self.seen.setdefault(id(w), []).append(x.reshape(-1, x.shape[-1]).astype(np.float32))

    def linears(self, x, ws, biases=None):
        self._keep(ws[0], x)
        return self._be.linears(x, ws, biases)

    def linear(self, x, w, bias=None):
        self._keep(w, x)
        return self._be.linear(x, w, bias)

    def linear_sum(self, x, w, bias=None):
        self._keep(w, x)
        return self._be.linear_sum(x, w, bias)

    def silu_gated(self, x, gate, up):
        self._keep(gate, x)
        return self._be.silu_gated(x, gate, up)

    def gated_mlp(self, x, gate, up, act, biases=None):
        self._keep(gate, x)
        return self._be.gated_mlp(x, gate, up, act, biases)

    def moe_sum(self, x, logits, experts, opts, shared=None):
        """A layer of experts: its input and router logits, as float32 (tokens, -1); a
        shared expert's down input as down's. The model passes no logits (the backend
        runs its router): they are computed here, as the backend would."""
        if logits is None:
            logits = self.linear(x, experts.router, experts.router_bias)
        for a, key in ((x, "moe_x"), (logits, "moe_logits")):
            a = self._be.to_numpy(a)
            self.seen.setdefault(key, []).append(a.reshape(-1, a.shape[-1]).astype(np.float32))
        if shared is not None:
            self._keep(shared[1], shared[0])
        return self._be.moe_sum(x, logits, experts, opts, shared)


class _Stats:
    """Running H = X^T X (float64), sum |x| per channel, and up to `keep` input rows (an
    even spread over the calibration windows) of one linear input."""

    def __init__(self, keep: int = 512):
        self.h = self.abs = None
        self.n = 0
        self.keep, self.rows = keep, []

    def add(self, x: np.ndarray, every: int) -> None:
        g = (x.T @ x).astype(np.float64)
        a = np.abs(x).sum(0, dtype=np.float64)
        self.h = g if self.h is None else self.h + g
        self.abs = a if self.abs is None else self.abs + a
        self.n += len(x)
        self.rows.append(x[::every])

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(H / tokens as float32 [in, in], mean |x| [in], sample rows [<=keep, in])."""
        rows = np.concatenate(self.rows)[: self.keep]
        h = (self.h / self.n).astype(np.float32)
        return h, (self.abs / self.n).astype(np.float32), rows


def _layer(be, w: dict, ln_in, ln_post, extra: dict):
    """A Layer on `be` from float32 numpy weights (a layer of experts has no MLP linears:
    its experts come in `extra`)."""
    from mlxrun.model import Layer  # noqa: PLC0415

    mats = (be.array(w[k]) if k in w else None for k in LINEARS)
    return Layer(be.array(ln_in), be.array(ln_post), *mats, **extra)


def _run(shell, L, hs: np.ndarray, chunk: int, rec: _Recorder | None, i: int):
    """Layer L (the model's layer i: its attention window) over the residual stream hs
    [samples, T, hidden], `chunk` windows at a time: (the new residual stream,
    {id(weight): _Stats of its inputs} when `rec` is the shell's recording backend).

    Attention is the model's own (`Transformer.block`): layer i's sliding window in the
    mask, its sinks and biases in L. The cache holds this one layer, in slot 0."""
    be, cfg = shell.be, shell.config
    new = np.empty_like(hs)
    stats: dict = {}
    T = hs.shape[1]
    window = cfg.window(i)
    for s in range(0, len(hs), chunk):
        h = be.array(hs[s : s + chunk])
        x = be.rms_norm(h, L.input_layernorm, cfg.rms_norm_eps)
        kv, hd = cfg.num_key_value_heads, cfg.head_dim
        cache = be.make_cache(1, h.shape[0], kv, hd, T, [window])
        mask, pos = cache.mask(T, None, window), cache.positions(T, None)
        hn, _ = shell.block(L, h, x, L.input_layernorm, cache, 0, mask, pos)
        new[s : s + chunk] = be.to_numpy(hn)
        if rec is not None:
            for key, xs in rec.seen.items():
                if isinstance(key, str):  # a layer of experts' inputs, kept whole
                    stats.setdefault(key, []).extend(xs)
                    continue
                st = stats.setdefault(key, _Stats())
                for x_ in xs:
                    st.add(x_, max(1, len(hs) * T // st.keep))
            rec.seen.clear()
    return new, stats


def _names(i: int, moe: bool = False) -> dict[str, str]:
    """Layer i's linears by path (a layer of experts: attention only)."""
    p = f"model.layers.{i}"
    out = {k: f"{p}.self_attn.{k}" for k in LINEARS[:4]}
    if not moe:
        out.update({k: f"{p}.mlp.{k}" for k in LINEARS[4:]})
    return out
