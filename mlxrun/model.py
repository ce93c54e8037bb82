"""The Llama-family forward pass, written once against the backend interface.

Covers Llama 1-3.2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), and the
mixture-of-experts Qwen3-MoE, Qwen2-MoE (a shared expert), Mixtral and gpt-oss; the
differences are switches in ModelConfig (biases on any projection, the gate activation, a
sliding attention window per layer, experts in place of the MLP), not separate classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ModelConfig
from .moe import Experts

Array = Any


@dataclass
class Layer:
    input_layernorm: Array
    post_attention_layernorm: Array
    q_proj: Array
    k_proj: Array
    v_proj: Array
    o_proj: Array
    gate_proj: Array | None  # the dense MLP; None in a layer of experts (or its shared one)
    up_proj: Array | None
    down_proj: Array | None
    q_bias: Array | None = None
    k_bias: Array | None = None
    v_bias: Array | None = None
    o_bias: Array | None = None
    gate_bias: Array | None = None
    up_bias: Array | None = None
    down_bias: Array | None = None
    q_norm: Array | None = None
    k_norm: Array | None = None
    moe: Experts | None = None  # experts in place of the MLP (mlxrun/moe.py)
    sinks: Array | None = None  # (num_heads,) a learned logit per head in the softmax
    attn_out_norm: Array | None = None  # sandwich norms (Gemma): on the attention output
    mlp_out_norm: Array | None = None  # and the MLP output, before each residual add


def last_query(q: Array, mask):
    """The last query row of a pass alone: q (B, nh, T, hd) -> (B, nh, 1, hd), and its row
    of the mask. A causal mask ("causal", sdpa's own mode, queries aligned to the last keys)
    lets the last query see every key, so it becomes None; a boolean (B or 1, 1, T, S) mask
    keeps its last row (a sliding window, a ring, left padding). Masks of other kinds (the
    engine's fixed-shape steps) come with one-token passes only, which are never cut."""
    if mask is None or isinstance(mask, str):
        return q[:, :, -1:], None
    return q[:, :, -1:], mask[:, :, -1:]


class Transformer:
    """Parameters on a backend plus the forward pass. Built by `mlxrun.loader.build_model`."""

    def __init__(
        self, config: ModelConfig, backend, embed, layers: list[Layer], norm, head, vocab=None
    ):
        self.config = config
        self.be = backend
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.head = head  # the embedding again when tied
        # tensor parallel: embed and head hold this rank's vocabulary rows (shard.VocabShard)
        self.vocab = vocab
        self.rope = backend.rope_table(config.rope_freqs())
        # sliding layers with a base of their own (Gemma 3) rotate by their own table
        local = config.local_rope_theta is not None and config.layer_windows
        self.rope_local = backend.rope_table(config.rope_freqs(local=True)) if local else None
        # Gemma's query_pre_attn_scalar^-0.5, else head_dim^-0.5 (with YaRN's factor)
        self.scale = config.attn_scale or config.attention_scale
        # Gemma scales the embedding output by sqrt(hidden), in the compute dtype as HF does
        es = config.embed_scale
        self.embed_scale = None if es == 1.0 else backend.array(np.array(es, np.float32))
        # the KV cache's format (mlxrun/kvquant.py): None keeps k, v in the compute dtype
        self.kv_quant: str | None = None

    def weight_bytes(self) -> int:
        """Bytes of every weight array on the device (packed parts included, tied head once)."""
        seen, total = set(), 0

        def add(a):
            nonlocal total
            if a is None or id(a) in seen:
                return
            seen.add(id(a))
            if hasattr(a, "scales"):  # QuantizedWeight, and its kernel's repack (CUDA)
                k = a.kernel
                for part in (a.weight, a.scales, a.biases) + (
                    (k.weight, k.scales, k.biases) if k is not None else ()
                ):
                    add(part)
            else:
                total += int(a.nbytes)

        for a in (self.embed, self.norm, self.head):
            add(a)
        for L in self.layers:
            for a in vars(L).values():
                for part in a.arrays() if isinstance(a, Experts) else (a,):
                    add(part)
        return total

    def kv_bytes(self, batch: int, tokens: int, chunk: int | None = None) -> int:
        """Bytes of the KV cache `make_cache(batch, tokens, chunk)` allocates."""
        from mlxrun.backends.base import ring_capacity  # noqa: PLC0415
        from mlxrun.kvquant import kv_bytes_per_value  # noqa: PLC0415

        c = self.config
        itemsize = 4 if self.be.dtype == "float32" else 2
        per = kv_bytes_per_value(self.kv_quant, c.head_dim, itemsize, self.be.name)
        held = sum(ring_capacity(c.window(i), tokens, chunk) for i in range(c.num_hidden_layers))
        return int(2 * c.num_key_value_heads * c.head_dim * per * batch * held)

    def make_cache(self, batch: int, max_len: int, chunk: int | None = None):
        """A KV cache for `batch` sequences of up to `max_len` positions, in `kv_quant`'s
        format. With `chunk`, the most tokens any forward pass on it brings, a sliding-window
        layer keeps a ring of window + chunk - 1 positions instead of max_len."""
        c = self.config
        windows = [c.window(i) for i in range(c.num_hidden_layers)]
        kw = {} if self.kv_quant is None else {"kv_quant": self.kv_quant}
        return self.be.make_cache(
            c.num_hidden_layers, batch, c.num_key_value_heads, c.head_dim, max_len, windows, chunk,
            **kw,
        )  # fmt: skip

    def block(
        self, L: Layer, h: Array, x: Array, nxt: Array, cache, i: int, mask, pos, rope=None,
        last_row: bool = False,
    ):  # fmt: skip
        """One decoder layer: residual h (B, T, hidden) and x = its input norm applied ->
        (h, x) after the layer, x normalised by `nxt` (the next layer's input norm, or the
        final norm). Uses slot `i` of the cache and the rope table `rope` (the model's when
        None). With `last_row`, every position's keys and values are cached but only the
        last position's query attends and goes on: (h, x) are (B, 1, hidden). Calibration
        runs layers one at a time through this (quant/calib_layers.py)."""
        be, c = self.be, self.config
        B, T = x.shape[0], x.shape[1]
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if last_row and be.short_queries:  # only the last query attends: project it alone
            q = be.linear(x[:, -1:], L.q_proj, L.q_bias)
            k, v = be.linears(x, (L.k_proj, L.v_proj), (L.k_bias, L.v_bias))
        else:
            q, k, v = be.linears(x, (L.q_proj, L.k_proj, L.v_proj), (L.q_bias, L.k_bias, L.v_bias))
        q = q.reshape(B, q.shape[1], nh, hd).swapaxes(1, 2)
        k = k.reshape(B, T, nkv, hd).swapaxes(1, 2)
        v = v.reshape(B, T, nkv, hd).swapaxes(1, 2)
        if L.q_norm is not None:  # Qwen3 normalises each head before rope
            q = be.rms_norm(q, L.q_norm, c.rms_norm_eps)
            k = be.rms_norm(k, L.k_norm, c.rms_norm_eps)
        # q (B, nh, T, hd) rotated; k, v (B, nkv, offset+T, hd) from the cache
        rope = self.rope if rope is None else rope
        if self.rope_local is not None and c.window(i) is not None:
            rope = self.rope_local  # sliding layers with a base of their own (Gemma 3)
        q, k, v = be.rope_and_cache(q, k, v, pos, rope, cache, i)
        if last_row:  # every row's k, v are cached above; only the last query goes on
            q, mask = last_query(q, mask)
        o = be.attention(q, k, v, self.scale, mask, sinks=L.sinks)  # (B, nh, T or 1, hd)
        if last_row:  # the output projection and the MLP of the other rows feed nothing
            o, h, T = o[:, :, -1:], h[:, -1:], 1
        # o and down see this rank's heads / MLP rows only: partial sums of the output, and
        # their biases are added once, after the sum
        o = be.linear_sum(o.swapaxes(1, 2).reshape(B, T, nh * hd), L.o_proj, L.o_bias)
        if L.attn_out_norm is not None:
            o = be.rms_norm(o, L.attn_out_norm, c.rms_norm_eps)
        h, x = be.add_rms_norm(h, o, L.post_attention_layernorm, c.rms_norm_eps)
        if L.moe is not None:
            e = L.moe
            # the router is whole on every rank (the same experts picked); each expert's rows
            # are split, so the output is summed over the ranks as down_proj's is
            shared = None
            if e.shared_gate is not None:  # Qwen2-MoE: + sigmoid(x @ g^T) * the dense MLP,
                # its rows split too: its down partial joins the experts' in one sum
                a = be.gated_mlp(x, L.gate_proj, L.up_proj, "silu")
                shared = (a, L.down_proj, be.sigmoid(be.linear(x, e.shared_gate)))
            # no router logits: the backend runs the router (on CUDA in decode its linear,
            # bias and top-k are one kernel: cuda_moe.route_linear)
            y = be.moe_sum(x, None, e, c.moe, shared)
            h, x = be.add_rms_norm(h, y, nxt, c.rms_norm_eps)
            return h, x
        mlp_b = None if L.gate_bias is None else (L.gate_bias, L.up_bias)
        y = be.gated_mlp(x, L.gate_proj, L.up_proj, c.hidden_act, mlp_b)
        y = be.linear_sum(y, L.down_proj, L.down_bias)
        if L.mlp_out_norm is not None:
            y = be.rms_norm(y, L.mlp_out_norm, c.rms_norm_eps)
        h, x = be.add_rms_norm(h, y, nxt, c.rms_norm_eps)
        return h, x

    def __call__(
        self, ids: Array, cache, pads: np.ndarray | None = None, last_only: bool = False
    ) -> Array:
        """ids (B, T) -> logits (B, T, vocab), or (B, vocab) with `last_only`.

        `pads[b]` counts the left-padding slots of sequence b in the cache (batched prompts
        of different lengths); those slots are masked and the rope positions shifted.
        """
        be, c = self.be, self.config
        T = ids.shape[1]
        windows = [c.window(i) for i in range(len(self.layers))]
        # one mask per window in use: (B or 1, 1, T, keys) or None (or the backend's causal)
        masks = {w: cache.mask(T, pads, w) for w in set(windows)}
        pos = cache.positions(T, pads)
        rope = self.rope
        if c.rope_dynamic:  # NTK: frequencies of this pass's length, as transformers runs it
            rope = be.rope_table(c.rope_freqs(cache.offset + T))
        v = self.vocab
        if v is None:
            h = be.embedding(ids, self.embed)  # (B, T, hidden)
        else:  # each rank looks up the ids in its rows (zeros elsewhere); summed over ranks
            h = be.embedding_sum(ids, self.embed, v.start, v.rows, self.embed_scale is None)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        # Each residual add is done with the norm that follows it (one fused kernel on CUDA).
        h, x = be.add_rms_norm(h, None, self.layers[0].input_layernorm, c.rms_norm_eps)
        for i, L in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            nxt = self.norm if last else self.layers[i + 1].input_layernorm
            # A prompt pass that returns the last position's logits alone needs only that
            # row past the last layer's keys and values: its attention, output projection
            # and MLP run on one query row, not T (mlx-lm's prefill leaves them unevaluated).
            cut = last and last_only and T > 1
            h, x = self.block(L, h, x, nxt, cache, i, masks[windows[i]], pos, rope, cut)
        cache.advance(T)
        if last_only:
            x = x[:, -1, :]
        if v is None:
            return be.linear(x, self.head)
        # (..., rows) of this rank -> (..., vocab) on every rank, the padding cut
        return be.all_gather(be.linear(x, self.head), v.vocab)
