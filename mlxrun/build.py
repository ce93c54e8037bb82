"""From checkpoint tensors to a Transformer on a backend: name and shape checks, the
quantized-or-dense decision per layer (by whether `<path>.scales` exists), and optional
quantization on load, one tensor at a time.

On a checkpoint that is already quantized, `--quant` keeps each stored layer whose format
already is the one asked for (same mode and bits, and the group size asked, if any) and
re-quantizes the others from their dequantized values; `--quant none` dequantizes every
stored layer to the compute dtype. Either way one layer at a time is expanded, never the
whole model.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .errors import MlxrunError
from .model import Layer, Transformer
from .moe import Experts
from .weights import Tensor

# Tensors a checkpoint may carry that the model derives itself: rope inverse frequencies
# (recomputed from the config) and an lm_head stored beside a tied embedding (transformers
# ties it to the embedding and ignores the stored copy).
_DERIVABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def _unused(tensors: dict[str, Tensor], used: set[str], tied: bool) -> list[str]:
    """Checkpoint tensors the model did not consume and cannot derive, sorted."""
    return sorted(
        n
        for n in tensors
        if n not in used
        and not n.endswith(_DERIVABLE_SUFFIXES)
        and not (tied and n == "lm_head.weight")
    )


def _progress(total: int, show: bool):
    from tqdm.auto import tqdm  # noqa: PLC0415 (notebook-aware bar)

    return tqdm(total=total, desc="loading", unit="tensor", disable=not show, leave=False)


def stored_dense(w: Tensor, s: Tensor, b: Tensor | None, spec) -> np.ndarray:
    """One packed layer (weight uint32 [out, in*bits/32], scales, biases) -> float32
    [out, in], as a float32 backend computes it: affine scales and biases widened first,
    the float modes decoded straight to float32."""
    from mlxrun.quant.reference import dequantize  # noqa: PLC0415

    if spec.mode == "affine":
        return dequantize(w.data, s.float32(), b.float32(), spec)
    return dequantize(w.data, np.asarray(s.data), None, spec, dtype="float32")


def target_spec(quant, qconfig: dict | None, group_asked: bool):
    """The format to re-quantize stored layers to: `quant`, but with the checkpoint's group
    size when none was asked and the mode allows it (re-grouping adds error: SmolLM2's
    Q4_1 g32 moved to g64 loses its answers)."""
    from mlxrun.quant.formats import ALLOWED, QuantSpec, from_config  # noqa: PLC0415

    if quant is None or group_asked or not qconfig:
        return quant
    g = from_config(qconfig).group_size
    if g in ALLOWED[quant.mode][1]:
        return QuantSpec(quant.mode, quant.bits, g)
    return quant


def widened(be, spec) -> bool:
    """Whether backend `be` runs stored affine layers of `spec` widened to 8-bit codes: the
    CUDA kernels read 4- and 8-bit codes only, and a 2, 3, 5 or 6-bit code (GGUF Q5_0/Q5_1
    and mlx-lm's mixed recipes) fits an 8-bit one exactly, with the same scales and biases."""
    return (
        be.name == "torch"
        and be.triton_kernels
        and spec.mode == "affine"
        and spec.bits in (2, 3, 5, 6)
    )


def check_runnable(be, spec, path: str) -> None:
    """Raise MlxrunError, naming what would work, when backend `be` has no kernel for a
    stored format. MLX and PyTorch on cpu/mps run every mode (fused or per-layer dequant);
    the CUDA Triton kernels take only the five user formats (affine 4/8-bit)."""
    if not (be.name == "torch" and str(be.device).startswith("cuda")):
        return
    from mlxrun.quant.formats import USER_FORMATS  # noqa: PLC0415

    if any((f.mode, f.bits) == (spec.mode, spec.bits) for f in USER_FORMATS.values()):
        return
    raise MlxrunError(
        f"{path} is stored as {spec.label} g{spec.group_size}, which --backend cuda cannot "
        "run (its kernels take int4, int8, fp8, fp4 and nvfp4): use --backend cpu or mlx, "
        "or re-quantize on load with --quant int4 (or int8, fp8, fp4, nvfp4)"
    )


def _gathered(path: str, lead: tuple[int, ...] = ()) -> bool:
    """Rows of the embedding are gathered (and a tied head reuses it), and so are the
    experts of a stacked (lead: (E,)) weight, so a backend that repacks for its matmul
    kernels must also keep the canonical bytes of these."""
    return path == "model.embed_tokens" or bool(lead)


# Byte codes of the packed float modes that can spell NaN: mode -> {tensor: code}.
_CODES = {
    "mxfp4": {"scales": "E8M0"},
    "mxfp8": {"scales": "E8M0", "weight": "E4M3"},
    "nvfp4": {"scales": "E4M3"},
}


def check_finite(name: str, t: Tensor, code: str | None = None) -> None:
    """Raise MlxrunError naming tensor `name` if it holds a NaN or an infinity."""
    from .weights import first_nonfinite  # noqa: PLC0415

    i = first_nonfinite(t, code)
    if i is None:
        return
    if code is None:
        at = f"index {[int(j) for j in np.unravel_index(i, t.shape)]}"
    else:
        at = f"byte {i}, {code}"
    raise MlxrunError(
        f"tensor {name!r} holds a NaN or infinite value ({at}): the checkpoint is corrupt; "
        "re-download or re-convert it (--no-check-weights skips this check)"
    )


class _Builder:
    def __init__(
        self, cfg: ModelConfig, tensors: dict[str, Tensor], be, quant, bar, dense, asked, check
    ):
        self.cfg, self.t, self.be, self.quant, self.bar = cfg, tensors, be, quant, bar
        self.check = check  # refuse non-finite weights (a pass over the host bytes)
        self.group_asked = asked
        self.dense_only = dense  # --quant none: expand stored layers to the compute dtype
        self.qconfig = cfg.quantization
        if self.qconfig is not None:
            from mlxrun.quant.formats import from_config  # noqa: PLC0415

            from_config(self.qconfig)  # validates the mode before anything is loaded
        self.notes: list[str] = []
        self.used: set[str] = set()
        # stored layers by what happened to them, for one note each at the end
        self.kept: list[str] = []
        self.requantized: dict[str, list[str]] = {}
        self.expanded: list[str] = []
        self.widened: dict = {}  # stored QuantSpec -> its layers run with 8-bit codes

    def _get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        t = self.t.get(name)
        if t is None:
            raise MlxrunError(
                f"the checkpoint has no tensor {name!r} (config.json says "
                f"{self.cfg.model_type} with {self.cfg.num_hidden_layers} "
                "layers); is the download complete?"
            )
        if t.shape != shape:
            raise MlxrunError(
                f"tensor {name!r} has shape {list(t.shape)} but config.json implies {list(shape)}"
            )
        if self.check:
            check_finite(name, t)
        self.used.add(name)
        self.bar.update(1)
        return t

    def dense(self, name: str, shape: tuple[int, ...]):
        return self.be.array(self._get(name, shape))

    def norm(self, name: str, n: int):
        """An RMSNorm weight; with the config's norm_offset (Gemma's 1 + w) added in fp32."""
        t = self._get(name, (n,))
        if not self.cfg.norm_offset:
            return self.be.array(t)
        return self.be.array(t.float32() + np.float32(self.cfg.norm_offset))

    def _stored(self, path: str, out: int, inp: int, lead: tuple[int, ...] = ()):
        """A layer stored packed: kept, re-quantized to `quant`, or expanded (--quant none).
        lead: leading dimensions of a stacked weight (experts: (E,))."""
        from mlxrun.quant.formats import layer_spec  # noqa: PLC0415

        spec = layer_spec(self.qconfig or {}, path)
        if spec is None:
            raise MlxrunError(
                f"{path} is stored quantized but config.json has no quantization block for it"
            )
        qc = self.qconfig or {}
        if path not in qc and any(isinstance(v, (dict, bool)) for v in qc.values()):
            # A mixed (per-layer) checkpoint that does not name this layer: mlx-lm 0.32 takes
            # its format from the stored shapes, as the global values can be wrong for it, and
            # so do we. A uniform one (no per-layer entries) must match its global block.
            from mlxrun.quant.formats import infer_spec  # noqa: PLC0415

            w, s = self.t.get(f"{path}.weight"), self.t.get(f"{path}.scales")
            if w is not None and (w.shape, s.shape) != ((*lead, out, inp * spec.bits // 32),
                                                        (*lead, out, inp // spec.group_size)):  # fmt: skip
                spec = infer_spec(path, inp, w.shape[-1], s.shape[-1], s.dtype == "U8")
                self.notes.append(
                    f"{path} is not named in config.json's per-layer quantization and is "
                    f"stored as {spec.label} g{spec.group_size}: read as stored, as mlx-lm does"
                )
        if inp % spec.group_size:
            raise MlxrunError(
                f"{path}: input size {inp} is not a multiple of the group size "
                f"{spec.group_size} that config.json gives it; fix the quantization block"
            )
        w = self._get(f"{path}.weight", (*lead, out, inp * spec.bits // 32))
        s = self._get(f"{path}.scales", (*lead, out, inp // spec.group_size))
        b = None
        if spec.mode == "affine":
            b = self._get(f"{path}.biases", (*lead, out, inp // spec.group_size))
        if self.check:  # what _get could not see: NaN codes in uint8 bytes
            for k, code in _CODES.get(spec.mode, {}).items():
                check_finite(f"{path}.{k}", w if k == "weight" else s, code)
        q = self.quant
        same = q is not None and (q.mode, q.bits) == (spec.mode, spec.bits)
        if not self.dense_only and (q is None or (same and (q == spec or not self.group_asked))):
            if q is not None:
                self.kept.append(path)
            if widened(self.be, spec):
                from mlxrun.quant.formats import QuantSpec  # noqa: PLC0415
                from mlxrun.quant.reference import pack, unpack  # noqa: PLC0415

                self.widened.setdefault(spec, []).append(path)
                w = Tensor("U32", pack(unpack(w.data, spec.bits), 8))
                spec = QuantSpec("affine", 8, spec.group_size)
            check_runnable(self.be, spec, path)
            return self.be.quantized(
                w, s, b, spec.mode, spec.bits, spec.group_size, embedding=_gathered(path, lead)
            )
        x = self.be.array(stored_dense(w, s, b, spec))  # this one layer, in the compute dtype
        if self.dense_only:
            self.expanded.append(path)
            return x
        if inp % q.group_size:
            self.notes.append(
                f"{path} is dequantized, not re-quantized: its input size {inp} is not a "
                f"multiple of the group size {q.group_size}"
            )
            return x
        self.requantized.setdefault(f"{spec.label} g{spec.group_size}", []).append(path)
        return self._quantize(x, q, path, lead)

    def matrix(self, path: str, out: int, inp: int, lead: tuple[int, ...] = ()):
        """A linear/embedding weight (out, in), or a stack of them (*lead, out, in):
        packed when the checkpoint is quantized, quantized here when asked, else dense."""
        if f"{path}.scales" in self.t:
            return self._stored(path, out, inp, lead)
        t = self.t.get(f"{path}.weight")
        if t is not None and t.block is not None and not lead:
            return self._blocks(path, t.block, out, inp)
        w = self.dense(f"{path}.weight", (*lead, out, inp))
        q = self.quant
        if q is None:
            return w
        if inp % q.group_size:
            self.notes.append(
                f"{path} stays unquantized: its input size {inp} is not a "
                f"multiple of the group size {q.group_size}"
            )
            return w
        return self._quantize(w, q, path, lead)

    def stored_or_dense(self, path: str, out: int, inp: int):
        """A small matrix whose precision matters (a MoE router: it picks the experts): as
        stored, never quantized on load."""
        if f"{path}.scales" in self.t:
            return self._stored(path, out, inp)
        return self.dense(f"{path}.weight", (out, inp))

    def experts(self, p: str) -> Experts:
        """Layer prefix `p`'s router and stacked experts, from either stored layout."""
        from .moe import expert_names, fused_experts, stack_per_expert  # noqa: PLC0415

        c, o = self.cfg, self.cfg.moe
        E, I, H = o.num_experts, o.intermediate_size, c.hidden_size
        n = expert_names(c.model_type, p)
        dims = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        stacked = set(self.t)
        self.used.update(stack_per_expert(self.t, n, E))
        self.used.update(fused_experts(self.t, n))
        stacked = set(self.t) - stacked  # stacks made here from per-expert tensors
        mats = {k: self.matrix(f"{n.stacked}.{k}", *d, lead=(E,)) for k, d in dims.items()}
        e = Experts(self.stored_or_dense(n.router, E, H), *mats.values())
        if o.shared_intermediate_size:  # its MLP is the layer's (build_model); the gate here
            e.shared_gate = self.stored_or_dense(n.shared_gate, 1, H)
        if o.bias:
            e.router_bias = self.dense(f"{n.router}.bias", (E,))
            for k, (out, _) in dims.items():
                b = self.dense(f"{n.stacked}.{k}.bias", (E, out))
                setattr(e, k.replace("_proj", "_bias"), b)
        for k in stacked:  # on the device now: the host copies go
            del self.t[k]
        return e

    def _blocks(self, path: str, kind: str, out: int, inp: int):
        """A GGUF K-quant layer kept as its raw blocks (the backend's `gguf_blocks`): read
        as stored, or expanded (--quant none) or re-quantized (--quant FORMAT) as any
        stored layer."""
        from mlxrun.quant import gguf_blocks as gb  # noqa: PLC0415

        nbytes, per = gb.BLOCKS[kind]
        if inp % per:
            raise MlxrunError(f"{path}: input size {inp} is not a whole number of {kind} blocks")
        t = self._get(f"{path}.weight", (out, inp // per * nbytes))
        if self.quant is None and not self.dense_only:
            return self.be.kquant(t)
        x = self.be.array(gb.dequantize(np.asarray(t.data), kind))
        if self.dense_only:
            self.expanded.append(path)
            return x
        self.requantized.setdefault(kind, []).append(path)
        if inp % self.quant.group_size:
            return x
        return self._quantize(x, self.quant, path)

    def _quantize(self, w, q, path: str, lead: tuple[int, ...] = ()):
        out = self.be.quantize(w, q.mode, q.bits, q.group_size, embedding=_gathered(path, lead))
        # MLX is lazy: evaluated here, the full-precision source is freed now, one matrix at a
        # time, not at the first forward pass (SmolLM2 --quant int4 held 75 MiB of it there)
        self.be.eval(*(a for a in (out.weight, out.scales, out.biases) if a is not None))
        return out

    def summary(self) -> list[str]:
        """One note per kind of decision on stored layers."""
        q, out = self.quant, []
        if self.kept:
            out.append(
                f"{len(self.kept)} stored layer(s) already are {q.label}: keeping their "
                "stored weights"
            )
        if self.requantized:
            n = sum(len(p) for p in self.requantized.values())
            out.append(
                f"re-quantizing {n} layer(s) from a quantized source "
                f"({', '.join(sorted(self.requantized))}) to {q.label} g{q.group_size}: the "
                "rounding errors add up; quantize the full-precision checkpoint for the best "
                "quality"
            )
        for s, paths in self.widened.items():
            out.append(
                f"{len(paths)} layer(s) stored as {s.label} g{s.group_size} run with 8-bit "
                f"codes on {self.be.device} (its kernels read 4 and 8 bits; exact, "
                f"{8 / s.bits:.2f}x the code bytes)"
            )
        if self.expanded:
            out.append(
                f"--quant none: dequantized {len(self.expanded)} stored layer(s) to {self.be.dtype}"
            )
        return out + self.notes


def build_model(
    cfg: ModelConfig,
    tensors: dict[str, Tensor],
    be,
    quant=None,
    progress: bool = True,
    *,
    dense: bool = False,
    group_asked: bool = True,
    check_weights: bool = True,
    vocab=None,
) -> tuple[Transformer, list[str]]:
    """Check names and shapes, move weights to `be` (quantizing with `quant`, a QuantSpec,
    if given); returns the model and notes for the user (layers left unquantized, stored
    layers kept or re-quantized).

    dense: expand stored quantized layers to the compute dtype (`--quant none`).
    group_asked: False when the user gave no group size, so stored layers may keep theirs.
    check_weights: refuse, naming the tensor, a weight that holds NaN or inf (each tensor's
    bytes are checked on the host as they are copied to the device).
    vocab: this rank's rows of the embedding and head (a shard.VocabShard; `tensors` hold
    only those rows), None when they are whole.
    """
    if dense and quant is not None:
        raise ValueError("build_model: dense=True and a quant spec exclude each other")
    quant = target_spec(quant, cfg.quantization, group_asked)
    c = cfg
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size if vocab is None else vocab.rows
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    tied = c.tie_word_embeddings
    per_layer = 9 + 3 * c.attention_bias + c.o_bias + 3 * c.mlp_bias + 2 * c.qk_norm
    per_layer += c.attention_sinks
    per_layer += 2 * c.sandwich_norms
    # Gemma's names: its pre_feedforward_layernorm is the norm before the MLP (Llama's
    # post_attention_layernorm); its post_attention / post_feedforward norms sandwich
    pre_mlp = "pre_feedforward_layernorm" if c.sandwich_norms else "post_attention_layernorm"
    bar = _progress(2 + c.num_hidden_layers * per_layer + (0 if tied else 1), progress)
    b = _Builder(cfg, tensors, be, quant, bar, dense, group_asked, check_weights)
    try:
        embed = b.matrix("model.embed_tokens", V, H)
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            moe = c.moe is not None and c.moe.is_moe(i)
            # the dense MLP: the layer's, or in a MoE layer its shared expert (Qwen2-MoE)
            mlp, width = f"{p}.mlp", I
            if moe and c.moe.shared_intermediate_size:
                from .moe import expert_names  # noqa: PLC0415

                mlp = expert_names(c.model_type, p).shared
                width = c.moe.shared_intermediate_size
            dense_mlp = not moe or bool(c.moe.shared_intermediate_size)
            L = Layer(
                input_layernorm=b.norm(f"{p}.input_layernorm.weight", H),
                post_attention_layernorm=b.norm(f"{p}.{pre_mlp}.weight", H),
                q_proj=b.matrix(f"{p}.self_attn.q_proj", q_out, H),
                k_proj=b.matrix(f"{p}.self_attn.k_proj", kv_out, H),
                v_proj=b.matrix(f"{p}.self_attn.v_proj", kv_out, H),
                o_proj=b.matrix(f"{p}.self_attn.o_proj", H, q_out),
                gate_proj=b.matrix(f"{mlp}.gate_proj", width, H) if dense_mlp else None,
                up_proj=b.matrix(f"{mlp}.up_proj", width, H) if dense_mlp else None,
                down_proj=b.matrix(f"{mlp}.down_proj", H, width) if dense_mlp else None,
                moe=b.experts(p) if moe else None,
            )
            if c.attention_bias:
                L.q_bias = b.dense(f"{p}.self_attn.q_proj.bias", (q_out,))
                L.k_bias = b.dense(f"{p}.self_attn.k_proj.bias", (kv_out,))
                L.v_bias = b.dense(f"{p}.self_attn.v_proj.bias", (kv_out,))
            if c.o_bias:
                L.o_bias = b.dense(f"{p}.self_attn.o_proj.bias", (H,))
            if c.mlp_bias:
                L.gate_bias = b.dense(f"{p}.mlp.gate_proj.bias", (I,))
                L.up_bias = b.dense(f"{p}.mlp.up_proj.bias", (I,))
                L.down_bias = b.dense(f"{p}.mlp.down_proj.bias", (H,))
            if c.qk_norm:
                L.q_norm = b.norm(f"{p}.self_attn.q_norm.weight", c.head_dim)
                L.k_norm = b.norm(f"{p}.self_attn.k_norm.weight", c.head_dim)
            if c.attention_sinks:
                L.sinks = b.dense(f"{p}.self_attn.sinks", (c.num_attention_heads,))
            if c.sandwich_norms:
                L.attn_out_norm = b.norm(f"{p}.post_attention_layernorm.weight", H)
                L.mlp_out_norm = b.norm(f"{p}.post_feedforward_layernorm.weight", H)
            layers.append(L)
        norm = b.norm("model.norm.weight", H)
        head = embed if tied else b.matrix("lm_head", V, H)
    finally:
        bar.close()
    extra = _unused(tensors, b.used, tied)
    if extra:
        shown = ", ".join(extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
        raise MlxrunError(
            f"the checkpoint has {len(extra)} tensor(s) that a {c.model_type} model with this "
            f"config.json does not use ({shown}): the config and weights disagree (an option "
            "missing from config.json, or another architecture); mlxrun refuses rather than "
            "drop them"
        )
    return Transformer(cfg, be, embed, layers, norm, head, vocab), b.summary()
